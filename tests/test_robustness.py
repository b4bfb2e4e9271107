"""Bad input gets a finite answer or a clear ValueError, never a silent NaN.

Hypothesis draws masks (empty rows, all-zero batches), log-ratios up to +-1e4
and non-finite rewards on one fixed shape, B = 8 rows in groups of 4, T = 6,
so every jitted function compiles once per config.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, HealthCheck
from hypothesis import strategies as st

import rljax
from rljax import recipes
from rljax.batch import TrainBatch

B, T, N, LMAX = 8, 6, 4, 8
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

lengths_st = st.lists(st.integers(0, T), min_size=B, max_size=B)
logr_st = st.lists(st.one_of(st.floats(-1e4, 1e4, width=32),
                             st.sampled_from([-1e4, 1e4, 0.0, 25.0, -25.0])),
                   min_size=B * T, max_size=B * T)
rewards_st = st.lists(st.sampled_from([0.0, 1.0, 0.5, -1.0]), min_size=B, max_size=B)


def _mask(lengths):
    return (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def _assert_clean(w, mask):
    w = np.asarray(w)
    assert np.all(np.isfinite(w)), w
    np.testing.assert_array_equal(w[mask == 0], 0.0)


@SETTINGS
@given(name=st.sampled_from(recipes.names()), lengths=lengths_st, logr=logr_st,
       rewards=rewards_st)
def test_random_masks_and_extreme_log_ratios_give_finite_weights(name, lengths, logr,
                                                                  rewards):
    mask = _mask(lengths)
    old = np.full((B, T), -2.0, np.float32)
    logp = old + np.asarray(logr, np.float32).reshape(B, T)
    # The reference stays near the current policy (the extreme ref gap is its
    # own test below); the trust region sees log-ratios up to +-1e4.
    ref = logp - 0.5
    w = rljax.token_weights(recipes.get(name), rewards, mask, group_size=N,
                            max_tokens=LMAX, logp=logp, old_logp=old, ref_logp=ref)
    _assert_clean(w, mask)
    # An all-equal group contributes exactly nothing (without KL, which moves
    # rewards or adds its own gradient).
    cfg = recipes.get(name)
    if cfg.advantage.estimator == "group" and cfg.kl.placement == "none":
        for g in range(B // N):
            rows = slice(g * N, (g + 1) * N)
            if len(set(rewards[rows])) == 1:
                np.testing.assert_array_equal(np.asarray(w)[rows], 0.0)


@pytest.mark.parametrize("name", recipes.names())
def test_all_zero_mask_gives_zero_weights_loss_and_finite_metrics(name):
    cfg = recipes.get(name)
    zero = np.zeros((B, T), np.float32)
    w = rljax.token_weights(cfg, [1, 0, 0, 0, 1, 1, 0, 0], zero, group_size=N,
                            max_tokens=LMAX)
    np.testing.assert_array_equal(w, 0.0)
    obj = rljax.Objective.from_config(cfg, group_size=N, max_tokens=LMAX)
    rollout = rljax.Rollout.from_arrays(np.asarray([1.0, 0, 0, 0, 1, 1, 0, 0], np.float32), zero,
                                        behavior_logp_BxT=np.full((B, T), np.nan, np.float32))
    s = rljax.token_streams(obj, rollout, rljax.Logprobs(
        ref_logp_BxT=jnp.full((B, T), jnp.nan), values_BxT=jnp.asarray(zero)))
    batch = rljax.train_batch(obj, s, np.arange(B))
    np.testing.assert_array_equal(batch.coef, 0.0)
    lp = jnp.full((B, T), -jnp.inf)
    (loss, m), g = jax.value_and_grad(
        lambda x: rljax.policy_loss(obj.loss, x, batch), has_aux=True)(lp)
    assert loss == 0.0
    np.testing.assert_array_equal(g, 0.0)
    for k, v in m.items():
        assert np.all(np.isfinite(np.asarray(v))), k


@pytest.mark.parametrize("name", ["grpo", "max_rl"])
def test_kl_in_loss_with_an_extreme_reference_gap_is_finite(name):
    mask = _mask([2, 5, 3, 4, 6, 1, 0, 3])
    old = np.full((B, T), -2.0, np.float32)
    logp = old.copy()
    logp[0, 0] = -2.0 - 1e4      # log-ratio -1e4 against old, and against ref = old
    logp[1, 1] = -2.0 - 100.0    # a gap of 100 nats already overflows exp
    w = rljax.token_weights(recipes.get(name), [1, 0, 0, 1, 1, 0, 0, 0], mask,
                            group_size=N, logp=logp, old_logp=old)
    _assert_clean(w, mask)


# --- non-finite rewards --------------------------------------------------------------

bad_rewards_st = st.tuples(
    rewards_st, st.lists(st.integers(0, B - 1), min_size=1, max_size=3, unique=True),
    st.sampled_from([np.nan, np.inf, -np.inf]))


@SETTINGS
@given(data=bad_rewards_st, name=st.sampled_from(["grpo", "rloo", "dr_grpo", "max_rl",
                                                   "cispo", "gspo"]))
def test_nan_or_inf_rewards(data, name):
    rewards, bad_rows, bad = data
    r = np.asarray(rewards, np.float32)
    r[bad_rows] = bad
    cfg = recipes.get(name)
    mask = _mask([2, 5, 3, 4, 6, 1, 0, 3])
    # Concrete: a clear ValueError naming the rewards.
    with pytest.raises(ValueError, match="rewards"):
        rljax.compute_advantages(cfg, r, group_size=N)
    with pytest.raises(ValueError, match="rewards"):
        rljax.token_weights(cfg, r, mask, group_size=N, max_tokens=LMAX)
    # Under jit: finite outputs, the bad groups skipped and counted.
    adv, coef, _, metrics = _jit_pipeline(name)(jnp.asarray(r), jnp.asarray(mask),
                                                jnp.zeros((B, T)))
    bad_groups = sorted({b // N for b in bad_rows})
    assert int(metrics["invalid_groups"]) == len(bad_groups)
    for k, v in metrics.items():
        assert np.all(np.isfinite(np.asarray(v))), k
    adv, coef = np.asarray(adv), np.asarray(coef)
    assert np.all(np.isfinite(adv)) and np.all(np.isfinite(coef))
    for g in bad_groups:
        np.testing.assert_array_equal(adv[g * N:(g + 1) * N], 0.0)
        np.testing.assert_array_equal(coef[g * N:(g + 1) * N], 0.0)
    # The skipped rows also leave the denominators: the good group's coefficients
    # equal those of the batch with the bad group's mask zeroed.
    m2 = mask.copy()
    for g in bad_groups:
        m2[g * N:(g + 1) * N] = 0.0
    adv2, coef2, _, _ = _jit_pipeline(name)(
        jnp.asarray(np.nan_to_num(r, posinf=0.0, neginf=0.0)), jnp.asarray(m2),
        jnp.zeros((B, T)))
    np.testing.assert_allclose(coef, coef2, rtol=1e-6)
    good = [b for b in range(B) if b // N not in bad_groups]
    np.testing.assert_allclose(adv[good], np.asarray(adv2)[good], rtol=1e-6)


_PIPELINES = {}


def _jit_pipeline(name, **overrides):
    """Jitted rollout -> streams -> one-step TrainBatch, as the trainer runs them:
    (advantages, coefficients, returns, advantage metrics). Values are zeros."""
    key = (name, tuple(sorted(overrides.items())))
    if key not in _PIPELINES:
        obj = rljax.Objective.from_config(recipes.get(name, **overrides), group_size=N,
                                          max_tokens=LMAX)

        def run(r, m, values):
            z = jnp.zeros((B, T))
            rollout = rljax.Rollout.from_arrays(r, m, behavior_logp_BxT=z)
            s = rljax.token_streams(obj, rollout, rljax.Logprobs(ref_logp_BxT=z,
                                                                 values_BxT=values))
            batch = rljax.train_batch(obj, s, np.arange(B))
            metrics = {k: v for k, v in s.metrics.items() if not isinstance(v, int)}
            return s.advantages_BxT, batch.coef, s.returns_BxT, metrics
        _PIPELINES[key] = jax.jit(run)
    return _PIPELINES[key]


def test_gae_nan_reward_row_is_skipped_and_counted():
    mask = _mask([2, 5, 3, 4, 6, 1, 0, 3])
    r = np.asarray([1, np.nan, 0, 1, 1, 0, np.inf, 0], np.float32)
    adv, coef, returns, metrics = _jit_pipeline("ppo")(jnp.asarray(r), jnp.asarray(mask),
                                                       jnp.zeros((B, T)))
    assert int(metrics["invalid_rows"]) == 2
    adv = np.asarray(adv)
    assert np.all(np.isfinite(adv)) and np.all(np.isfinite(np.asarray(returns)))
    np.testing.assert_array_equal(adv[1], 0.0)
    np.testing.assert_array_equal(np.asarray(coef)[1], 0.0)
    # token_mean over the 24 - 5 = 19 remaining tokens (row 6 is already empty).
    np.testing.assert_allclose(np.asarray(coef)[0, 0], 1 / 19, rtol=1e-6)


def test_gae_whitening_ignores_skipped_rows():
    mask = _mask([2, 5, 3, 4, 6, 1, 0, 3])
    values = jnp.full((B, T), 0.2)
    r = np.asarray([1, np.nan, 0, 1, 1, 0, 0, 0], np.float32)
    f = _jit_pipeline("ppo", **{"advantage.whiten": True})
    adv = f(jnp.asarray(r), jnp.asarray(mask), values)[0]
    # The same batch with row 1 dropped up front (mask 0, finite reward).
    m2 = mask.copy()
    m2[1] = 0.0
    adv2 = f(jnp.asarray(np.nan_to_num(r)), jnp.asarray(m2), values)[0]
    # Sanity: whitened advantages of the kept tokens have mean 0 there.
    np.testing.assert_allclose(np.sum(np.asarray(adv2) * m2), 0.0, atol=1e-4)
    np.testing.assert_allclose(adv, adv2, rtol=1e-5, atol=1e-6)


# --- shapes ---------------------------------------------------------------------------

def _good_batch():
    z = jnp.zeros((B, T))
    return TrainBatch(tokens=jnp.zeros((B, T), jnp.int32),
                      positions=jnp.zeros((B, T), jnp.int32), loss_mask=jnp.ones((B, T)),
                      behavior_logp=z, advantages=z, coef=z, old_logp=z, ref_logp=z)


_GRPO = recipes.get("grpo")
_GRPO_LOSS = rljax.LossConfig.from_config(_GRPO)
_MASK = _mask([2, 5, 3, 4, 6, 1, 0, 3])
_R = [1.0, 0, 0, 1, 1, 0, 0, 0]

SHAPE_ERRORS = [
    ("token_weights logp", lambda: rljax.token_weights(
        _GRPO, _R, _MASK, group_size=N, logp=np.zeros((B, T - 1))), "logp="),
    ("token_weights old_logp", lambda: rljax.token_weights(
        _GRPO, _R, _MASK, group_size=N, old_logp=np.zeros((B, T + 1))), "old_logp="),
    ("token_weights rewards", lambda: rljax.token_weights(
        _GRPO, _R[:4], _MASK, group_size=N), "rewards"),
    ("token_weights rewards rank", lambda: rljax.token_weights(
        _GRPO, np.zeros((B, 1)), _MASK, group_size=N), "rewards"),
    ("token_weights mask rank", lambda: rljax.token_weights(
        _GRPO, _R, np.ones(B), group_size=N), "mask"),
    ("group_size", lambda: rljax.compute_advantages(_GRPO, _R, group_size=3), "group_size"),
    ("rl_streams values", lambda: rljax.rl_streams(
        rljax.Estimator.from_config(recipes.get("ppo")), jnp.asarray(_R), jnp.asarray(_MASK),
        group_size=N, old_logp_BxT=jnp.zeros((B, T)), ref_logp_BxT=jnp.zeros((B, T)),
        values_BxT=jnp.zeros((B, T - 2))), "values_BxT"),
    ("policy_loss takes a LossConfig", lambda: rljax.policy_loss(
        _GRPO, jnp.zeros((B, T)), _good_batch()), "LossConfig"),
    ("rollout source out of range", lambda: rljax.token_streams(
        rljax.Objective.from_config(_GRPO), rljax.Rollout.from_arrays(
            np.zeros(B, np.float32), _MASK, source_B=np.full(B, 3))), "source_B"),
    ("rollout not whole groups", lambda: rljax.token_streams(
        rljax.Objective.from_config(_GRPO, group_size=3),
        rljax.Rollout.from_arrays(np.zeros(B, np.float32), _MASK)), "whole groups"),
    ("rollout shapes", lambda: rljax.Rollout.from_arrays(
        np.zeros(B, np.float32), _MASK, behavior_logp_BxT=np.zeros((B, T + 1))).validate(),
     "Rollout.behavior_logp_BxT"),
    ("minibatch not whole groups", lambda: rljax.train_batch(
        rljax.Objective.from_config(_GRPO, group_size=N), rljax.token_streams(
            rljax.Objective.from_config(_GRPO, group_size=N),
            rljax.Rollout.from_arrays(np.zeros(B, np.float32), _MASK),
            rljax.Logprobs(ref_logp_BxT=jnp.zeros((B, T)))), np.arange(3)), "whole groups"),
    ("ref_kl without a teacher", lambda: rljax.policy_loss(
        _GRPO_LOSS, jnp.zeros((B, T)), _good_batch().replace(ref_kl_coef=jnp.zeros((B, T)))),
     "teacher_logp"),
    ("policy_loss logp", lambda: rljax.policy_loss(
        _GRPO_LOSS, jnp.zeros((B, T - 1)), _good_batch()), "logp_BxT"),
    ("policy_loss coef", lambda: rljax.policy_loss(
        _GRPO_LOSS, jnp.zeros((B, T)), _good_batch().replace(coef=jnp.zeros((B, 1)))),
     "TrainBatch.coef"),
    ("policy_loss row advantages", lambda: rljax.policy_loss(
        _GRPO_LOSS, jnp.zeros((B, T)), _good_batch().replace(advantages=jnp.zeros(B))),
     "TrainBatch.advantages"),
    ("policy_loss old_logp", lambda: rljax.policy_loss(
        _GRPO_LOSS, jnp.zeros((B, T)), _good_batch().replace(old_logp=jnp.zeros((B - 1, T)))),
     "TrainBatch.old_logp"),
    ("policy_loss NaN advantages", lambda: rljax.policy_loss(
        _GRPO_LOSS, jnp.zeros((B, T)), _good_batch().replace(advantages=jnp.full((B, T), jnp.nan))),
     "advantages"),
    ("policy_loss grpo without ref", lambda: rljax.policy_loss(
        _GRPO_LOSS, jnp.zeros((B, T)), _good_batch().replace(ref_logp=None)), "ref_logp"),
    ("split", lambda: _good_batch().split(3), "micro-batches"),
]


@pytest.mark.parametrize("case,fn,needle", SHAPE_ERRORS, ids=[c[0] for c in SHAPE_ERRORS])
def test_bad_input_raises_value_error_naming_the_field(case, fn, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        fn()
