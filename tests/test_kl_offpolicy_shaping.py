"""Axes 4 and 5 and the DAPO extras: golden values and counted filters."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import kl
from rljax import offpolicy
from rljax import shaping


class KLTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_spec_check_values(self):
        # logp = -1, ref = -1.5: x = -0.5; k1 = .5, k2 = .125,
        # k3 = e^-.5 + .5 - 1 = .6065307 - .5 = .1065307.
        logp, ref = jnp.array([[-1.0]]), jnp.array([[-1.5]])
        for kind, want in [("k1", 0.5), ("k2", 0.125), ("k3", 0.1065307),
                           ("low_var_kl", 0.1065307)]:
            got = self.variant(lambda a, b: kl.kl_estimate(kind, a, b))(logp, ref)
            np.testing.assert_allclose(got, [[want]], rtol=1e-5)

    def test_low_var_kl_is_bounded_and_k3_gradient(self):
        logp, ref = jnp.array([[-30.0, 0.0]]), jnp.array([[0.0, -30.0]])
        out = kl.kl_estimate("low_var_kl", logp, ref)
        # x = 30 clamps to 20: e^20 - 21 -> clamped to 10; x = -30 -> -20:
        # e^-20 + 19 = 19 -> clamped to 10.
        np.testing.assert_allclose(out, [[10.0, 10.0]])
        # d k3 / d logp = -(e^x - 1) with x = ref - logp; at x = -.5: 1 - e^-.5.
        g = jax.grad(lambda lp: kl.kl_estimate("k3", lp, jnp.array([[-1.5]]))[0, 0])(
            jnp.array([[-1.0]]))
        np.testing.assert_allclose(g, [[1 - np.exp(-0.5)]], rtol=1e-5)

    def test_reward_placement(self):
        # Row 0: k1 = logp - ref = .5 and .25 -> sum .75; r = 1 - .1 * .75.
        logp = jnp.array([[-1.0, -2.0, 0.0]])
        ref = jnp.array([[-1.5, -2.25, -9.0]])
        m = jnp.array([[1.0, 1.0, 0.0]])
        r = kl.kl_penalized_rewards(jnp.array([1.0]), logp, ref, m, beta=0.1)
        np.testing.assert_allclose(r, [0.925], rtol=1e-6)
        tr = kl.kl_penalized_token_rewards(jnp.array([[0.0, 1.0, 0.0]]), logp, ref, m,
                                           beta=0.1)
        np.testing.assert_allclose(tr, [[-0.05, 0.975, 0.0]], rtol=1e-6)

    def test_unknown_estimator(self):
        with pytest.raises(ValueError, match="kl.estimator.*k3"):
            kl.kl_estimate("k4", jnp.zeros((1, 1)), jnp.zeros((1, 1)))


class BehaviorWeightsTest(chex.TestCase):
    OLD = jnp.array([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # log(pi_old / mu) = (ln 3, ln .5, 0) and (ln 1.5, 0, junk on padding).
    MU = jnp.log(jnp.array([[1 / 3, 2.0, 1.0], [1 / 1.5, 1.0, 1e-30]]))
    MASK = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_levels_and_modes(self):
        f = self.variant(lambda o, m, k, level, mode: offpolicy.behavior_weights(
            o, m, k, level=level, mode=mode, cap=2.0, low=0.5, high=2.0).weights_BxT,
            static_argnums=(3, 4))
        # token/truncate: min(w, 2): (2, .5, 1), (1.5, 1, 0).
        np.testing.assert_allclose(f(self.OLD, self.MU, self.MASK, "token", "truncate"),
                                   [[2, 0.5, 1], [1.5, 1, 0]], rtol=1e-5)
        # token/mask: 3 is outside [.5, 2] -> 0; .5 stays.
        np.testing.assert_allclose(f(self.OLD, self.MU, self.MASK, "token", "mask"),
                                   [[0, 0.5, 1], [1.5, 1, 0]], rtol=1e-5)
        # sequence: row 0 product 3 * .5 * 1 = 1.5; row 1 1.5.
        np.testing.assert_allclose(f(self.OLD, self.MU, self.MASK, "sequence",
                                     "truncate"), [[1.5] * 3, [1.5, 1.5, 0]], rtol=1e-5)
        # geometric: row 0 1.5^(1/3) = 1.1447142; row 1 1.5^(1/2) = 1.2247449.
        np.testing.assert_allclose(f(self.OLD, self.MU, self.MASK, "geometric",
                                     "truncate"),
                                   [[1.1447142] * 3, [1.2247449, 1.2247449, 0]],
                                   rtol=1e-5)

    def test_extreme_ratio_is_finite_and_counted(self):
        out = offpolicy.behavior_weights(jnp.array([[0.0]]), jnp.array([[-1e4]]),
                                         jnp.ones((1, 1)), level="token", mode="mask")
        assert float(out.weights_BxT[0, 0]) == 0.0
        assert float(out.metrics["is_clip_frac"]) == 1.0

    def test_mismatch_metrics(self):
        # |diffs| = .1 and .3 -> mean .2; k3(x) = e^x - x - 1.
        d = np.array([0.1, -0.3])
        got = offpolicy.mismatch_metrics(jnp.array([[0.1, -0.3, 5.0]]),
                                         jnp.zeros((1, 3)), jnp.array([[1, 1, 0]]))
        np.testing.assert_allclose(got["mismatch_abs"], 0.2, rtol=1e-6)
        np.testing.assert_allclose(got["mismatch_k3"], np.mean(np.expm1(d) - d),
                                   rtol=1e-5)

    def test_row_filters(self):
        keep = offpolicy.staleness_keep(jnp.array([5, 3, 4, 1]), 5, max_staleness=1)
        np.testing.assert_array_equal(keep, [True, False, True, False])
        mask, dropped = offpolicy.apply_row_filter(jnp.ones((4, 2)), keep)
        np.testing.assert_array_equal(mask, [[1, 1], [0, 0], [1, 1], [0, 0]])
        assert int(dropped) == 2
        np.testing.assert_array_equal(
            offpolicy.truncation_keep(jnp.array([True, False]), True), [False, True])
        np.testing.assert_array_equal(
            offpolicy.truncation_keep(jnp.array([True, False]), False), [True, True])
        with pytest.raises(ValueError, match="max_staleness"):
            offpolicy.staleness_keep(jnp.array([1]), 1, max_staleness=-1)


class ShapingTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_overlong_penalty_spec_values(self):
        # L_max 20480, L_buf 4096: free up to 16384; 18432 -> -2048/4096 = -.5;
        # 20480 -> -1; beyond is floored at -factor.
        f = self.variant(lambda l: shaping.overlong_penalty(
            l, max_tokens=20480, buffer=4096, factor=1.0))
        np.testing.assert_allclose(f(jnp.array([100, 16384, 18432, 20480, 30000])),
                                   [0, 0, -0.5, -1.0, -1.0])

    def test_informative_groups(self):
        r = jnp.array([1, 1, 0, 1, jnp.nan, 0, 2, 2])
        np.testing.assert_array_equal(shaping.informative_groups(r, group_size=2),
                                      [False, True, False, False])

    def test_overlong_bad_buffer(self):
        with pytest.raises(ValueError, match="overlong_buffer"):
            shaping.overlong_penalty(jnp.array([1]), max_tokens=10, buffer=0)
