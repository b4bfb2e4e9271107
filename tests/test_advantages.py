"""Axis 1: golden values (docs/algorithms.md §2, §11), identities, zero-variance groups, GAE."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import advantages as adv

R = jnp.array([1.0, 0.0, 0.0, 0.0])


def _adv(variant, rewards, **kw):
    return variant(lambda r: adv.group_advantages(r, **kw))(rewards)


class GroupAdvantagesTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_spec_check_values(self):
        # mean 0.25; population std sqrt(0.25*0.75) = 0.4330127:
        # 0.75/0.4330127 = 1.7320508, -0.25/0.4330127 = -0.5773503.
        out = _adv(self.variant, R, group_size=4)
        np.testing.assert_allclose(out.advantages_B,
                                   [1.7320508, -0.5773503, -0.5773503, -0.5773503],
                                   rtol=1e-5)
        # ddof 1: std sqrt(0.75/3) = 0.5 -> (1.5, -0.5 x3).
        out = _adv(self.variant, R, group_size=4, ddof=1)
        np.testing.assert_allclose(out.advantages_B, [1.5, -0.5, -0.5, -0.5], rtol=1e-5)
        # No scale: r - mean.
        out = _adv(self.variant, R, group_size=4, scale="none")
        np.testing.assert_allclose(out.advantages_B, [0.75, -0.25, -0.25, -0.25])
        # Leave-one-out: 1 - 0 = 1; 0 - 1/3.
        out = _adv(self.variant, R, group_size=4, baseline="leave_one_out",
                   scale="none")
        np.testing.assert_allclose(out.advantages_B, [1.0, -1 / 3, -1 / 3, -1 / 3],
                                   rtol=1e-6)
        # MaxRL: (r - 0.25) / 0.25 -> 3, -1.
        out = _adv(self.variant, R, group_size=4, scale="group_mean")
        np.testing.assert_allclose(out.advantages_B, [3.0, -1.0, -1.0, -1.0], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_groups_are_independent_and_batch_std(self):
        r = jnp.array([1.0, 0.0, 2.0, 4.0])
        out = _adv(self.variant, r, group_size=2, scale="none")
        # Group (1, 0): mean .5 -> (.5, -.5); group (2, 4): mean 3 -> (-1, 1).
        np.testing.assert_allclose(out.advantages_B, [0.5, -0.5, -1.0, 1.0])
        out = _adv(self.variant, r, group_size=2, scale="batch_std", eps=0.0)
        # Batch mean 1.75; deviations (-.75, -1.75, .25, 2.25); squares sum
        # .5625 + 3.0625 + .0625 + 5.0625 = 8.75; var 8.75/4 = 2.1875;
        # std 1.4790199.
        np.testing.assert_allclose(out.advantages_B,
                                   np.array([0.5, -0.5, -1.0, 1.0]) / 1.4790199,
                                   rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_all_equal_group_is_exactly_zero_and_counted(self):
        # 0.1 is not exact in binary; the mean of three 0.1's can differ
        # from 0.1 by an ulp, which over eps=1e-6 would be ~1e-2, not 0.
        r = jnp.array([0.1, 0.1, 0.1, 1.0, 0.0, 0.0, 7.0, 7.0, 7.0])
        for baseline, scale in [("group_mean", "group_std"),
                                ("leave_one_out", "none"),
                                ("group_mean", "group_mean"),
                                ("group_mean", "batch_std")]:
            out = _adv(self.variant, r, group_size=3, baseline=baseline, scale=scale)
            a = np.asarray(out.advantages_B)
            assert np.all(a[:3] == 0.0) and np.all(a[6:] == 0.0), (baseline, scale, a)
            assert np.all(a[3:6] != 0.0)
            assert int(out.zero_std_groups) == 2

    @chex.variants(with_jit=True, without_jit=True)
    def test_maxrl_nonpositive_group_mean_gives_zero(self):
        # Group (-1, 1) has mean 0 and (0, -2) mean -1: both all-zero.
        r = jnp.array([-1.0, 1.0, 0.0, -2.0, 1.0, 0.0])
        out = _adv(self.variant, r, group_size=2, scale="group_mean")
        # Group (1, 0): mean .5 -> (.5/.5, -.5/.5) = (1, -1).
        np.testing.assert_array_equal(out.advantages_B, [0, 0, 0, 0, 1, -1])

    @chex.variants(with_jit=True, without_jit=True)
    def test_nonfinite_reward_skips_only_its_group(self):
        r = jnp.array([1.0, jnp.nan, 0.0, 0.0, 1.0, 0.0])
        out = _adv(self.variant, r, group_size=3, scale="none")
        a = np.asarray(out.advantages_B)
        assert np.all(np.isfinite(a))
        np.testing.assert_array_equal(a[:3], 0.0)
        np.testing.assert_allclose(a[3:], [-1 / 3, 2 / 3, -1 / 3], rtol=1e-6)
        assert int(out.invalid_groups) == 1
        g = jax.grad(lambda x: jnp.sum(adv.group_advantages(
            x, group_size=3, scale="group_std").advantages_B ** 2))(r)
        assert np.all(np.isfinite(g))

    def test_rejects_bad_configuration(self):
        with pytest.raises(ValueError, match="leave_one_out.*group_size >= 2"):
            adv.group_advantages(R, group_size=1, baseline="leave_one_out")
        with pytest.raises(ValueError, match="divide the batch"):
            adv.group_advantages(R, group_size=3)
        with pytest.raises(ValueError, match="advantage.scale.*group_std"):
            adv.group_advantages(R, group_size=4, scale="std")
        with pytest.raises(ValueError, match="rank 1"):
            adv.group_advantages(R[None], group_size=4)


class GAETest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_values(self):
        # One row, 3 completion tokens, gamma .9, lam .5, V = (1, 2, 3),
        # reward 1 on the last token:
        # t2: delta = 1 + 0 - 3 = -2;            A2 = -2
        # t1: delta = 0 + .9*3 - 2 = .7;         A1 = .7 + .45*(-2) = -.2
        # t0: delta = 0 + .9*2 - 1 = .8;         A0 = .8 + .45*(-.2) = .71
        r = jnp.array([[0.0, 0.0, 1.0]])
        v = jnp.array([[1.0, 2.0, 3.0]])
        m = jnp.ones((1, 3))
        out = self.variant(lambda r, v, m: adv.gae(r, v, m, gamma=0.9, lam=0.5))(r, v, m)
        np.testing.assert_allclose(out.advantages_BxT, [[0.71, -0.2, -2.0]], rtol=1e-5)
        np.testing.assert_allclose(out.returns_BxT, [[1.71, 1.8, 1.0]], rtol=1e-5)

    def test_lambda_one_is_discounted_return_minus_value(self):
        rng = np.random.default_rng(0)
        r = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(3, 7)), jnp.float32)
        m = jnp.ones((3, 7))
        gamma = 0.8
        out = adv.gae(r, v, m, gamma=gamma, lam=1.0)
        ret = np.zeros((3, 7))
        acc = np.zeros(3)
        for t in reversed(range(7)):
            acc = np.asarray(r[:, t]) + gamma * acc
            ret[:, t] = acc
        np.testing.assert_allclose(out.advantages_BxT, ret - np.asarray(v), rtol=1e-4,
                                   atol=1e-5)

    def test_environment_tokens_are_skipped(self):
        # Two turns with 2 environment tokens between them: the result on the
        # completion tokens equals GAE on the row with those tokens removed.
        r = jnp.array([[0.0, 0.5, 9.0, 9.0, 0.0, 1.0]])
        v = jnp.array([[0.3, 0.2, 5.0, 5.0, 0.4, 0.6]])
        m = jnp.array([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
        out = adv.gae(r, v, m, gamma=0.9, lam=0.95)
        keep = np.array([0, 1, 4, 5])
        ref = adv.gae(r[:, keep], v[:, keep], jnp.ones((1, 4)), gamma=0.9, lam=0.95)
        np.testing.assert_allclose(np.asarray(out.advantages_BxT)[:, keep],
                                   ref.advantages_BxT, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(out.advantages_BxT)[:, 2:4], 0.0)

    def test_outcome_rewards_on_last_completion_token(self):
        m = jnp.array([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0]], jnp.float32)
        out = adv.outcome_token_rewards(jnp.array([2.0, 3.0]), m)
        np.testing.assert_array_equal(out, [[0, 0, 0, 0, 2, 0], [0] * 6])

    def test_whiten(self):
        x = jnp.array([[1.0, 3.0, 100.0]])
        m = jnp.array([[1.0, 1.0, 0.0]])
        # mean 2, population std 1 -> (-1, 1); the masked value is ignored.
        np.testing.assert_allclose(adv.whiten(x, m), [[-1.0, 1.0, 0.0]], rtol=1e-6)
