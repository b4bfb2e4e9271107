"""Rollout -> Streams -> TrainBatch on rollouts written by hand: no model, no sampler.

One rollout exercises every path of the composition (docs/algorithms.md §10):
two rl sources with different estimators (one with echo on environment
tokens), an sft source (ce), an opd-like source (ref_kl), a stale row, a row
continuing a multi-turn episode after a prefix break, and a filler row.
Every expected number is derived by hand next to it.
"""

import numpy as np
import pytest

import rljax
from rljax import objective

N, T = 2, 5
EPS = 1e-6
A = 0.5 / (0.5 + EPS)   # group (1, 0): mean 0.5, population std 0.5 -> +-0.999998

SOURCES = (
    objective.SourceSpec("a", "rl", objective.Estimator(), env_weight=0.1),   # grpo + echo
    objective.SourceSpec("b", "rl", objective.Estimator(baseline="leave_one_out",
                                                        scale="none")),       # rloo
    objective.SourceSpec("s", "ce", weight=0.5),                               # sft
    objective.SourceSpec("d", "ref_kl"),                                       # opd
)
# row: (source, episode, reward, completion tokens, environment tokens, version)
ROWS = [
    (0, 0, 1.0, [1, 2], [3], 2),
    (0, 1, 0.0, [1, 2, 3], [4], 2),
    (1, 2, 1.0, [2], [], 2),
    (1, 3, 0.0, [1, 2], [], 0),      # sampled 2 versions ago: stale (max_staleness 1)
    (2, 4, 1.0, [1, 2, 3], [], 1),
    (2, 5, 1.0, [1], [], 1),
    (3, 6, 0.0, [1, 2], [], 2),
    (3, 7, 0.0, [1, 2, 3, 4], [], 2),
    (0, 1, 0.0, [2, 3], [1], 2),     # continues row 1's episode
    (0, -1, 0.0, [], [], 2),         # filler
]
VERSION = 2


def _rollout():
    b = len(ROWS)
    mask, env = np.zeros((b, T), np.float32), np.zeros((b, T), np.float32)
    for i, (_, _, _, toks, env_toks, _) in enumerate(ROWS):
        mask[i, toks] = 1.0
        env[i, env_toks] = 1.0
    return rljax.Rollout.from_arrays(
        np.array([r[2] for r in ROWS], np.float32), mask,
        behavior_logp_BxT=np.where(mask > 0, -1.0, 0.0).astype(np.float32),
        source_B=np.array([r[0] for r in ROWS], np.int32),
        episode_B=np.array([r[1] for r in ROWS], np.int32),
        active_B=np.array([r[1] >= 0 for r in ROWS]),
        version_B=np.array([r[5] for r in ROWS], np.int32), env_mask_BxT=env)


def _objective(**kw):
    return objective.Objective(sources=SOURCES, loss=objective.LossConfig(), group_size=N,
                               norm=kw.pop("norm", "seq_mean_token_mean"), max_tokens=8, **kw)


def _teacher():
    return np.where(_rollout().loss_mask_BxT > 0, -0.5, 0.0).astype(np.float32)


def _streams(**kw):
    return objective.token_streams(_objective(**kw), _rollout(),
                                   objective.Logprobs(teacher_logp_BxT=_teacher()),
                                   version=VERSION)


def _grid(cells):
    """{(row, t): value} -> [B, T]."""
    out = np.zeros((len(ROWS), T))
    for (b, t), v in cells.items():
        out[b, t] = v
    return out


def test_streams_of_a_mixed_rollout():
    s = _streams()
    # rl: the stale row 3 and the filler leave; sft / ref_kl rows never enter.
    rl = _grid({(0, 1): 1, (0, 2): 1, (1, 1): 1, (1, 2): 1, (1, 3): 1, (2, 2): 1,
                (8, 2): 1, (8, 3): 1})
    np.testing.assert_array_equal(s.rl_mask_BxT, rl)
    # a: group (1, 0) -> +-A. b: leave-one-out (1 - 0, 0 - 1) = (1, -1), row 3
    # masked. Row 8 takes row 1's row advantage, sum(-A * 3) / 3 = -A.
    adv = _grid({(0, 1): A, (0, 2): A, (1, 1): -A, (1, 2): -A, (1, 3): -A, (2, 2): 1.0,
                 (8, 2): -A, (8, 3): -A})
    np.testing.assert_allclose(s.advantages_BxT, adv, rtol=1e-6)
    # ce: sft rows at weight 0.5; echo's 0.1 on environment tokens of source a.
    ce = _grid({(4, 1): .5, (4, 2): .5, (4, 3): .5, (5, 1): .5,
                (0, 3): .1, (1, 4): .1, (8, 1): .1})
    np.testing.assert_allclose(s.ce_weights_BxT, ce, rtol=1e-6)
    rk = _grid({(6, 1): 1, (6, 2): 1, (7, 1): 1, (7, 2): 1, (7, 3): 1, (7, 4): 1})
    np.testing.assert_array_equal(s.ref_kl_weights_BxT, rk)
    assert s.metrics["stale_rows"] == 1 and s.metrics["dropped_rows"] == 1
    # Per-source advantage metrics: a's 5 tokens have |A| = 0.999998 (row 8 is
    # not a group row, so it is not in a's statistics).
    np.testing.assert_allclose(s.metrics["a/adv_abs_mean"], A, rtol=1e-6)
    np.testing.assert_allclose(s.metrics["b/adv_mean"], 1.0, rtol=1e-6)  # only row 2 trains
    assert int(s.metrics["a/zero_std_groups"]) == 0
    assert "dropped_overflow_rows" not in s.metrics  # only GAE drops continuation rows


def test_train_batch_coefficients_once_per_optimizer_step():
    obj, s = _objective(), _streams()
    # Minibatch of groups 0 and 4 (rows 0, 1, 8, 9), seq_mean_token_mean:
    # rl rows 0 (L 2), 1 (L 3), 8 (L 2): B' = 3 -> 1/6, 1/9, 1/6; ce: one env
    # token in each of rows 0, 1, 8 -> 1/(3 * 1) * 0.1.
    b1 = rljax.train_batch(obj, s, [0, 1, 8, 9])
    np.testing.assert_allclose(b1.coef, _grid({
        (0, 1): 1 / 6, (0, 2): 1 / 6, (1, 1): 1 / 9, (1, 2): 1 / 9, (1, 3): 1 / 9,
        (8, 2): 1 / 6, (8, 3): 1 / 6})[[0, 1, 8, 9]], rtol=1e-6)
    np.testing.assert_allclose(b1.ce_coef, _grid({(0, 3): .1 / 3, (1, 4): .1 / 3,
                                                  (8, 1): .1 / 3})[[0, 1, 8, 9]], rtol=1e-6)
    np.testing.assert_array_equal(b1.ref_kl_coef, 0.0)
    # Groups 1-3 (rows 2..7): rl only row 2 (L 1) -> 1; ce rows 4 (L 3), 5 (L 1),
    # B' = 2 -> 0.5/(2*3) = 1/12 and 0.5/(2*1) = 1/4; ref_kl rows 6 (L 2),
    # 7 (L 4) -> 1/4 and 1/8.
    rows = np.arange(2, 8)
    b2 = rljax.train_batch(obj, s, rows)
    np.testing.assert_allclose(b2.coef, _grid({(2, 2): 1.0})[rows], rtol=1e-6)
    np.testing.assert_allclose(b2.ce_coef, _grid({(4, 1): 1 / 12, (4, 2): 1 / 12,
                                                  (4, 3): 1 / 12, (5, 1): .25})[rows],
                               rtol=1e-6)
    np.testing.assert_allclose(b2.ref_kl_coef, _grid({
        (6, 1): .25, (6, 2): .25, (7, 1): .125, (7, 2): .125, (7, 3): .125,
        (7, 4): .125})[rows], rtol=1e-6)
    # The same rows under token_mean: rl 1/sum L = 1 (row 2 alone), ce 1/4 * 0.5.
    b3 = rljax.train_batch(_objective(norm="token_mean"), s, rows)
    np.testing.assert_allclose(b3.ce_coef[2, 1], 0.5 / 4, rtol=1e-6)


def test_rollout_token_weights_per_minibatch():
    # On-policy (logp = mu): rl w = c A, ce w = c, ref_kl w = c (teacher - logp)
    # = c (-0.5 - -1) = c / 2.
    rollout, obj = _rollout(), _objective()
    logp = rollout.behavior_logp_BxT
    lp = objective.Logprobs(teacher_logp_BxT=_teacher())
    w1 = rljax.rollout_token_weights(obj, rollout, logp, lp, rows=[0, 1, 8, 9], version=VERSION)
    np.testing.assert_allclose(w1, _grid({
        (0, 1): A / 6, (0, 2): A / 6, (0, 3): .1 / 3, (1, 1): -A / 9, (1, 2): -A / 9,
        (1, 3): -A / 9, (1, 4): .1 / 3, (8, 1): .1 / 3, (8, 2): -A / 6,
        (8, 3): -A / 6})[[0, 1, 8, 9]], rtol=1e-5, atol=1e-9)
    rows = np.arange(2, 8)
    w2 = rljax.rollout_token_weights(obj, rollout, logp, lp, rows=rows, version=VERSION)
    np.testing.assert_allclose(w2, _grid({
        (2, 2): 1.0, (4, 1): 1 / 12, (4, 2): 1 / 12, (4, 3): 1 / 12, (5, 1): .25,
        (6, 1): .125, (6, 2): .125, (7, 1): .0625, (7, 2): .0625, (7, 3): .0625,
        (7, 4): .0625})[rows], rtol=1e-5, atol=1e-9)
    # Without a version the staleness filter is off: row 3 trains (A = -1).
    w_all = rljax.rollout_token_weights(obj, rollout, logp, lp, rows=rows)
    assert np.all(np.asarray(w_all)[1, [1, 2]] < 0) and np.all(np.asarray(w2)[1] == 0)


def test_truncated_rows_are_dropped_only_when_asked():
    rollout = _rollout().replace(truncated_B=np.arange(len(ROWS)) == 0)
    lp = objective.Logprobs(teacher_logp_BxT=_teacher())
    kept = objective.token_streams(_objective(), rollout, lp, version=VERSION)
    dropped = objective.token_streams(_objective(mask_truncated=True), rollout, lp,
                                      version=VERSION)
    assert kept.rl_mask_BxT[0].sum() == 2 and dropped.rl_mask_BxT[0].sum() == 0
    assert dropped.metrics["dropped_rows"] == 2 and dropped.metrics["stale_rows"] == 1
    # Row 0's group partner keeps its advantage: rewards still define the group.
    np.testing.assert_allclose(dropped.advantages_BxT[1, 1], -A, rtol=1e-6)
    # A filtered row trains nothing at all, echo's environment tokens included.
    assert dropped.ce_weights_BxT[0].sum() == 0 and kept.ce_weights_BxT[0, 3] == np.float32(.1)


def test_gae_drops_continuation_rows_and_counts_them():
    est = objective.Estimator(kind="gae", baseline="none", scale="none")
    obj = objective.Objective(sources=(objective.SourceSpec("main", "rl", est),),
                              loss=objective.LossConfig(), group_size=2, norm="token_mean",
                              max_tokens=8)
    mask = np.zeros((4, T), np.float32)
    mask[0, 1:3] = mask[1, 1:4] = mask[2, 1:3] = 1.0
    rollout = rljax.Rollout.from_arrays(np.array([1.0, 0.0, 1.0, 0.0], np.float32), mask,
                                        episode_B=np.array([0, 1, 0, -1], np.int32),
                                        active_B=np.array([True, True, True, False]))
    s = objective.token_streams(obj, rollout, objective.Logprobs(values_BxT=np.zeros((4, T))))
    assert s.metrics["dropped_overflow_rows"] == 1
    np.testing.assert_array_equal(s.rl_mask_BxT[2], 0.0)
    # Row 0 (V = 0, gamma 1, lam 0.95, reward on its last token t = 2):
    # A_2 = 1, A_1 = 0.95; returns = A + V.
    np.testing.assert_allclose(s.advantages_BxT[0, 1:3], [0.95, 1.0], rtol=1e-6)
    np.testing.assert_allclose(s.returns_BxT[0, 1:3], [0.95, 1.0], rtol=1e-6)


def test_bad_rollouts_fail_before_any_work():
    lp = objective.Logprobs(teacher_logp_BxT=_teacher())
    with pytest.raises(ValueError, match="episode_B"):
        objective.token_streams(_objective(), _rollout().replace(
            episode_B=np.full(len(ROWS), len(ROWS))), lp)
    with pytest.raises(ValueError, match="Rollout.rewards_B"):
        objective.token_streams(_objective(), _rollout().replace(rewards_B=np.zeros(3)), lp)
    with pytest.raises(ValueError, match="teacher_logp"):
        objective.token_streams(_objective(), _rollout())
    with pytest.raises(ValueError, match="component"):
        objective.SourceSpec("x", "kl")
