"""Token weights `w = -d loss / d logp` of every recipe on worked batches.

All expected values are derived by hand from docs/algorithms.md (§2 advantages, §3 normalizers and
trust-region tables); the arithmetic sits next to each. Advantages use the
default `eps = 1e-6` added to the population std.
"""

import math

import numpy as np
import pytest

import rljax
from rljax import recipes

EPS = 1e-6                    # advantage.eps default
SD_1000 = math.sqrt(3 / 16)   # population std of (1, 0, 0, 0) = 0.4330127


def _mask(lengths, t):
    return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def _row_weights(per_row, lengths, t):
    """Expected [B, T]: row b's weight on its first L_b tokens, 0 on padding."""
    return np.asarray(per_row, np.float64)[:, None] * _mask(lengths, t)


# --- the small worked batch ------------------------------------------------------
# Two groups of 4; group 1 rewards (1,0,0,1), group 2 (1,0,0,0); one empty row.
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
LENGTHS = [2, 5, 3, 4, 6, 1, 0, 3]
T, N, LMAX = 6, 4, 8
# sum L = 2+5+3+4+6+1+0+3 = 24; B' = 7 non-empty rows (B = 8); G' = 2;
# group token sums 2+5+3+4 = 14 and 6+1+0+3 = 10.
B_PRIME, SUM_L = 7, 24

# group_mean / group_std(ddof 0): group 1 mean .5, std .5 -> +-0.5/(0.5+1e-6)
A1 = 0.5 / (0.5 + EPS)                 # 0.999998
# group 2 mean .25, std sqrt(3/16) = 0.4330127 -> 0.75/0.4330137, -0.25/0.4330137
A2P = 0.75 / (SD_1000 + EPS)           # 1.7320468
A2N = -0.25 / (SD_1000 + EPS)          # -0.5773489
A_STD = [A1, -A1, -A1, A1, A2P, A2N, A2N, A2N]
# group_mean / none: r - mean
A_CENTER = [0.5, -0.5, -0.5, 0.5, 0.75, -0.25, -0.25, -0.25]
# leave_one_out: r - (sum - r)/3. g1: the others of a 1 are (0,0,1): 1 - 1/3 = 2/3;
# the others of a 0 are (1,0,1): 0 - 2/3. g2: 1 - 0 = 1; 0 - 1/3.
A_LOO = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.0, -1 / 3, -1 / 3, -1 / 3]
# MaxRL (r - mean)/mean: g1 (+-0.5)/0.5 = +-1; g2 0.75/0.25 = 3, -0.25/0.25 = -1.
A_MAXRL = [1.0, -1.0, -1.0, 1.0, 3.0, -1.0, -1.0, -1.0]


def _seq_mean_token_mean(adv):
    # c = 1 / (B' L_b) = 1 / (7 L_b); the empty row has no tokens.
    return [a / (B_PRIME * l) if l else 0.0 for a, l in zip(adv, LENGTHS)]


def _ppo_expected():
    # GAE, V = 0, gamma 1, lambda .95, reward on the last token:
    # delta_t = r on the last token, 0 before; A_t = 0.95^(L-1-t) r.
    # Coefficient token_mean 1/24; on-policy rho = 1 inside the clip: w = A_t / 24.
    w = np.zeros((len(LENGTHS), T))
    for b, (r, l) in enumerate(zip(REWARDS, LENGTHS)):
        for t in range(l):
            w[b, t] = 0.95 ** (l - 1 - t) * r / SUM_L
    # e.g. row 0 (L=2): (0.95/24, 1/24) = (0.0395833, 0.0416667);
    # row 4 (L=6) first token 0.95^5/24 = 0.7737809/24 = 0.0322409.
    return w


SMALL_EXPECTED = {
    # GRPO: A / (B' L_b): row 0 0.999998/14 = 0.0714284, row 1 -0.999998/35 =
    # -0.0285714, row 4 1.7320468/42 = 0.0412392, row 5 -0.5773489/7 = -0.0824784.
    # KL in the loss has zero gradient on-policy (ref = logp: 1 - e^0 = 0).
    "grpo": _row_weights(_seq_mean_token_mean(A_STD), LENGTHS, T),
    # DAPO: A / sum L = A / 24: 0.0416666, -0.0416666, 0.0721686, -0.0240562.
    "dapo": _row_weights([a / SUM_L for a in A_STD], LENGTHS, T),
    # Dr. GRPO: unscaled A / (B L_max) = A / (8 * 8): +-0.0078125, 0.0117188, -0.0039063.
    "dr_grpo": _row_weights([a / (8 * LMAX) for a in A_CENTER], LENGTHS, T),
    # RLOO: leave-one-out A / B' = A / 7: +-0.0952381, 0.1428571, -0.0476190.
    "rloo": _row_weights([a / B_PRIME for a in A_LOO], LENGTHS, T),
    # CISPO: group_token_mean 1/(G' sum_g L) = 1/(2*14) and 1/(2*10); weight
    # clip(1, 0, 5) = 1: +-0.0357142, 0.0866023, -0.0288674.
    "cispo": _row_weights([a / 28 for a in A_STD[:4]] + [a / 20 for a in A_STD[4:]],
                          LENGTHS, T),
    # GSPO on-policy: s_b = 1 unclipped, d s_b / d logp_t = 1/L_b, row coef 1/B'.
    "gspo": _row_weights(_seq_mean_token_mean(A_STD), LENGTHS, T),
    # GMPO on-policy: exp(mean 0) = 1, d/d logp_t = 1/L_b, row coef 1/B'.
    "gmpo": _row_weights(_seq_mean_token_mean(A_STD), LENGTHS, T),
    # SAPO on-policy: gate weight 4 s (1-s) = 1 at rho = 1 -> GRPO's weights.
    "sapo": _row_weights(_seq_mean_token_mean(A_STD), LENGTHS, T),
    # MaxRL on GRPO: (1,-1,-1,1,3,-1,-1,-1) / (7 L_b): 1/14 = 0.0714286,
    # -1/35, -1/21, 1/28, 3/42 = 0.0714286, -1/7, -, -1/21.
    "max_rl": _row_weights(_seq_mean_token_mean(A_MAXRL), LENGTHS, T),
    "ppo": _ppo_expected(),
}


def test_every_recipe_has_a_worked_expectation():
    assert sorted(SMALL_EXPECTED) == sorted(recipes.names())


@pytest.mark.parametrize("name", recipes.names())
def test_small_batch_weights(name):
    w = rljax.token_weights(recipes.get(name), REWARDS, _mask(LENGTHS, T),
                            group_size=N, max_tokens=LMAX)
    w = np.asarray(w)
    assert w.shape == (8, T) and w.dtype == np.float32
    np.testing.assert_allclose(w, SMALL_EXPECTED[name], rtol=2e-6, atol=1e-9)
    # Padding (and the whole empty row 6) is exactly zero.
    np.testing.assert_array_equal(w[_mask(LENGTHS, T) == 0], 0.0)


def test_small_batch_recipes_are_distinguishable():
    # The worked batch separates every normalizer: the table is not degenerate.
    distinct = {k: v for k, v in SMALL_EXPECTED.items()
                if k not in ("gspo", "gmpo", "sapo")}
    keys = sorted(distinct)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert not np.allclose(distinct[a], distinct[b]), (a, b)


# --- docs/algorithms.md §11's example -----------------------------------------------------------
# rewards (1,0,0,0), lengths (200, 800, 800, 800), a 1000-token limit, one group.
D_REWARDS = [1.0, 0.0, 0.0, 0.0]
D_LENGTHS = [200, 800, 800, 800]
D_T, D_LMAX = 800, 1000
D_SUM_L = 2600                         # 200 + 3 * 800
DP = 0.75 / (SD_1000 + EPS)            # 1.7320468
DN = -0.25 / (SD_1000 + EPS)           # -0.5773489

# (weight per success token, weight per failure token)
LONG_TAIL_EXPECTED = {
    # GRPO: 1.7320468 / (4 * 200) = 2.1650585e-3 ; -0.5773489 / (4 * 800) = -1.8042154e-4
    "grpo": (DP / 800, DN / 3200),
    "gspo": (DP / 800, DN / 3200),
    "gmpo": (DP / 800, DN / 3200),
    "sapo": (DP / 800, DN / 3200),
    # DAPO: A / 2600 = 6.6617185e-4 ; -2.2205728e-4
    "dapo": (DP / D_SUM_L, DN / D_SUM_L),
    # CISPO: one group, G' = 1: 1 / 2600, same as DAPO here.
    "cispo": (DP / D_SUM_L, DN / D_SUM_L),
    # Dr. GRPO: (0.75, -0.25) / (4 * 1000) = 1.875e-4 ; -6.25e-5
    "dr_grpo": (0.75 / 4000, -0.25 / 4000),
    # RLOO: (1, -1/3) / 4 = 0.25 ; -0.0833333 (per token: seq_mean_token_sum)
    "rloo": (1.0 / 4, -1 / 3 / 4),
    # MaxRL: (3, -1) / (4 L): 3/800 = 3.75e-3 ; -1/3200 = -3.125e-4
    "max_rl": (3.0 / 800, -1.0 / 3200),
    # PPO (V=0): success row A_t = 0.95^(199-t); last token 1/2600 = 3.8461538e-4,
    # first token 0.95^199/2600 = 3.6897e-5/2600 = 1.4191363e-8; failures 0.
    "ppo": (1.0 / D_SUM_L, 0.0),
}


@pytest.fixture(scope="module")
def long_tail_weights():
    m = _mask(D_LENGTHS, D_T)
    return {n: np.asarray(rljax.token_weights(recipes.get(n), D_REWARDS, m,
                                              group_size=4, max_tokens=D_LMAX))
            for n in recipes.names()}


def test_long_tail_example_grpo_exact(long_tail_weights):
    w = long_tail_weights["grpo"]
    # About +2.2e-3 per success token and -1.8e-4 per failure token (docs/algorithms.md §11).
    np.testing.assert_allclose(w[0, :200], 1.7320468 / (4 * 200), rtol=1e-6)
    np.testing.assert_allclose(w[1:, :], -0.5773489 / (4 * 800), rtol=1e-6)
    np.testing.assert_array_equal(w[0, 200:], 0.0)


@pytest.mark.parametrize("name", recipes.names())
def test_long_tail_example_every_recipe(name, long_tail_weights):
    w = long_tail_weights[name]
    succ, fail = LONG_TAIL_EXPECTED[name]
    if name == "ppo":
        # last success token, first success token, failures.
        np.testing.assert_allclose(w[0, 199], succ, rtol=2e-6)
        np.testing.assert_allclose(w[0, 0], 0.95 ** 199 / D_SUM_L, rtol=1e-4)
        np.testing.assert_allclose(w[0, :200], 0.95 ** np.arange(199, -1, -1) / D_SUM_L,
                                   rtol=1e-4)
        np.testing.assert_array_equal(w[1:], 0.0)
    else:
        np.testing.assert_allclose(w[0, :200], succ, rtol=2e-6)
        np.testing.assert_allclose(w[1:, :], fail, rtol=2e-6)
    np.testing.assert_array_equal(w[0, 200:], 0.0)


# --- off-policy ----------------------------------------------------------------------
# One group: rewards (1,0,0,1), lengths (2,5,3,4), T = 6. old_logp = -1,
# ref_logp = -1.5, logp = -1 + ln(rho) with the ratios below.
O_REWARDS = [1.0, 0.0, 0.0, 1.0]
O_LENGTHS = [2, 5, 3, 4]
RHO = [
    [6.0, 1.1],                      # A+
    [0.5, 0.9, 1.5, 1.0, 1.25],      # A-
    [1.0, 0.7, 1.3],                 # A-
    [1.3, 0.9, 1.0, 1.25],           # A+
]
O_ADV = [A1, -A1, -A1, A1]
O_MASK = _mask(O_LENGTHS, T)


def _logp_arrays():
    logp = np.full((4, T), -1.0, np.float32)
    for b, row in enumerate(RHO):
        logp[b, :len(row)] = -1.0 + np.log(row)
    return logp, np.full((4, T), -1.0, np.float32), np.full((4, T), -1.5, np.float32)


def _expected(per_token):
    """per_token(b, t, A, rho, L) -> weight, over the real tokens."""
    w = np.zeros((4, T))
    for b, row in enumerate(RHO):
        for t, rho in enumerate(row):
            w[b, t] = per_token(b, t, O_ADV[b], rho, len(row))
    return w


# Hand-labelled PPO clip (eps 0.2, range [0.8, 1.2]): A>0 keeps rho <= 1.2,
# A<0 keeps rho >= 0.8; a clipped token has zero PPO gradient.
KEPT_02 = [
    [False, True],                        # 6.0 > 1.2 ; 1.1 ok
    [False, True, True, True, True],      # 0.5 < 0.8 ; rest >= 0.8
    [True, False, True],                  # 0.7 < 0.8
    [False, True, True, False],           # 1.3, 1.25 > 1.2
]
# DAPO clip-higher (0.2 / 0.28, range [0.8, 1.28]): 1.25 now kept for A>0.
KEPT_DAPO = [
    [False, True],
    [False, True, True, True, True],
    [True, False, True],
    [False, True, True, True],
]


@pytest.mark.parametrize("recompute", [False, True])
def test_off_policy_grpo_clip_and_kl(recompute):
    logp, old, ref = _logp_arrays()
    cfg = recipes.get("grpo", **{"offpolicy.recompute_old_logp": recompute})
    w = np.asarray(rljax.token_weights(cfg, O_REWARDS, O_MASK, group_size=4,
                                       logp=logp, old_logp=old, ref_logp=ref))

    # loss = sum c (l_clip + beta k3(x)), x = ref - logp, c = 1/(4 L_b), beta .04.
    # d k3 / d logp = d(e^x - x - 1)/d logp = -(e^x - 1) = 1 - e^x, so the KL part
    # of w = -d loss / d logp is c beta (e^x - 1), e^x = e^(-1.5 + 1 - ln rho)
    # = e^-0.5 / rho = 0.6065307 / rho: negative for rho > 0.6065, pulling logp
    # back toward ref. PPO part: c A rho when kept, 0 when clipped.
    def grpo(b, t, a, rho, l):
        c = 1.0 / (4 * l)
        ppo = a * rho if KEPT_02[b][t] else 0.0
        return c * ppo + c * 0.04 * (math.exp(-0.5) / rho - 1.0)

    expected = _expected(grpo)
    # Spot checks: row 0 token 0 (A+, rho 6, clipped): only KL,
    # 0.04 * (0.6065307/6 - 1) / 8 = 0.04 * -0.8989116 / 8 = -0.0044946.
    np.testing.assert_allclose(expected[0, 0], -0.0044946, rtol=1e-4)
    # row 0 token 1 (rho 1.1): 0.999998 * 1.1 / 8 + 0.04 * (0.5513915 - 1) / 8
    #   = 0.1374997 - 0.0022430 = 0.1352567
    np.testing.assert_allclose(expected[0, 1], 0.1352567, rtol=1e-5)
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-8)
    np.testing.assert_array_equal(w[O_MASK == 0], 0.0)


def test_off_policy_dapo_clip_higher():
    logp, old, _ = _logp_arrays()
    w = np.asarray(rljax.token_weights(recipes.get("dapo"), O_REWARDS, O_MASK,
                                       group_size=4, logp=logp, old_logp=old))
    # c = 1 / sum L = 1/14; no KL. Row 3 token 3 (A+, rho 1.25) is kept by the
    # 0.28 upper bound (GRPO's 0.2 drops it): 0.999998 * 1.25 / 14 = 0.0892855.
    expected = _expected(lambda b, t, a, rho, l: a * rho / 14 if KEPT_DAPO[b][t] else 0.0)
    np.testing.assert_allclose(expected[3, 3], 0.0892855, rtol=1e-5)
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-8)


def test_off_policy_cispo_truncated_weight():
    logp, old, _ = _logp_arrays()
    w = np.asarray(rljax.token_weights(recipes.get("cispo"), O_REWARDS, O_MASK,
                                       group_size=4, logp=logp, old_logp=old))
    # w = c A sg(clip(rho, 0, 5)), c = 1/(G' * 14) = 1/14, every token kept.
    # Row 0 token 0: rho 6 truncated to 5: 0.999998 * 5 / 14 = 0.3571421.
    # Row 1 token 0: A-, rho 0.5 (PPO would clip): -0.999998 * 0.5 / 14 = -0.0357142.
    expected = _expected(lambda b, t, a, rho, l: a * min(rho, 5.0) / 14)
    np.testing.assert_allclose(expected[0, 0], 0.3571421, rtol=1e-6)
    np.testing.assert_allclose(expected[1, 0], -0.0357142, rtol=1e-5)
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-8)
    assert np.all(w[O_MASK > 0] != 0.0)


def test_off_policy_sapo_soft_gate():
    logp, old, _ = _logp_arrays()
    w = np.asarray(rljax.token_weights(recipes.get("sapo"), O_REWARDS, O_MASK,
                                       group_size=4, logp=logp, old_logp=old))

    # w = c A 4 s (1 - s) rho, s = sig(tau (rho - 1)), tau 1 (A>0) or 1.05 (A<0);
    # c = 1/(4 L_b). E.g. row 0 token 1 (rho 1.1, tau 1): s = sig(0.1) = 0.5249792,
    # 4 s(1-s) = 0.9975042, w = 0.999998 * 0.9975042 * 1.1 / 8 = 0.1371566.
    def sapo(b, t, a, rho, l):
        tau = 1.0 if a > 0 else 1.05
        s = 1 / (1 + math.exp(-tau * (rho - 1)))
        return a * 4 * s * (1 - s) * rho / (4 * l)

    expected = _expected(sapo)
    np.testing.assert_allclose(expected[0, 1], 0.1371566, rtol=1e-5)
    np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-8)


def test_recompute_old_logp_measures_the_trust_region_against_old_not_behavior():
    logp, old, _ = _logp_arrays()
    behavior = np.full((4, T), -1.0, np.float32) + np.log(1.15).astype(np.float32)
    kw = dict(group_size=4, logp=logp, old_logp=old, behavior_logp=behavior)
    # recompute: rho = pi / pi_old (the RHO table) -> DAPO's expectation above.
    w_old = np.asarray(rljax.token_weights(
        recipes.get("dapo", **{"offpolicy.recompute_old_logp": True}),
        O_REWARDS, O_MASK, **kw))
    exp_old = _expected(lambda b, t, a, rho, l: a * rho / 14 if KEPT_DAPO[b][t] else 0.0)
    np.testing.assert_allclose(w_old, exp_old, rtol=1e-5, atol=1e-8)
    # no recompute: pi_old := mu, rho' = rho / 1.15. Row 3 token 0: 1.3/1.15 =
    # 1.1304348 <= 1.28, now kept: 0.999998 * 1.1304348 / 14 = 0.0807452.
    w_mu = np.asarray(rljax.token_weights(recipes.get("dapo"), O_REWARDS, O_MASK, **kw))
    np.testing.assert_allclose(w_mu[3, 0], 0.0807452, rtol=1e-5)
    assert w_old[3, 0] == 0.0


def test_kl_in_the_reward_rloo_and_ppo():
    # ref = old - 0.3 on-policy (logp = old): k1 = -(ref - logp) = 0.3 per token.
    logp = np.full((4, T), -1.0, np.float32)
    ref = logp - 0.3
    kw = dict(group_size=4, logp=logp, old_logp=logp, ref_logp=ref)
    w = np.asarray(rljax.token_weights(recipes.get("rloo"), O_REWARDS, O_MASK, **kw))
    # RLOO: r_b -= 0.05 * 0.3 * L_b = 0.015 L_b: (1 - .03, -.075, -.045, 1 - .06)
    # = (0.97, -0.075, -0.045, 0.94), sum S = 1.79. LOO A = r - (S - r)/3:
    # 0.97 - 0.82/3 = 0.6966667; -0.075 - 1.865/3 = -0.6966667;
    # -0.045 - 1.835/3 = -0.6566667; 0.94 - 0.85/3 = 0.6566667. w = A / B' = A / 4.
    a = [0.6966667, -0.6966667, -0.6566667, 0.6566667]
    np.testing.assert_allclose(w, _row_weights([x / 4 for x in a], O_LENGTHS, T),
                               rtol=1e-5, atol=1e-9)
    w = np.asarray(rljax.token_weights(recipes.get("ppo"), O_REWARDS, O_MASK, **kw))
    # PPO: per-token reward -0.05 * 0.3 = -0.015, plus r on the last token; V = 0,
    # A_t = r_t + 0.95 A_{t+1}. Row 0 (r 1, L 2): A_1 = 0.985,
    # A_0 = -0.015 + 0.95 * 0.985 = 0.92075. Row 2 (r 0, L 3): A_2 = -0.015,
    # A_1 = -0.015 - 0.01425 = -0.02925, A_0 = -0.015 - 0.0277875 = -0.0427875.
    # Coefficient token_mean 1/14.
    np.testing.assert_allclose(w[0, :2], [0.92075 / 14, 0.985 / 14], rtol=1e-5)
    np.testing.assert_allclose(w[2, :3], [-0.0427875 / 14, -0.02925 / 14, -0.015 / 14],
                               rtol=1e-5)
    np.testing.assert_array_equal(w[O_MASK == 0], 0.0)


@pytest.mark.parametrize("name", recipes.names())
def test_padded_tokens_weigh_exactly_zero_with_garbage_logprobs(name):
    logp, old, ref = _logp_arrays()
    if name == "gspo":
        # Every row's mean log-ratio is far outside GSPO's 3e-4 window; evaluate
        # on-policy (ref still differs) so the row terms carry a gradient.
        logp = old.copy()
    clean = np.asarray(rljax.token_weights(recipes.get(name), O_REWARDS, O_MASK,
                                           group_size=4, max_tokens=LMAX, logp=logp,
                                           old_logp=old, ref_logp=ref))
    pad = O_MASK == 0
    logp[pad], old[pad], ref[pad] = np.nan, -np.inf, np.nan
    dirty = np.asarray(rljax.token_weights(recipes.get(name), O_REWARDS, O_MASK,
                                           group_size=4, max_tokens=LMAX, logp=logp,
                                           old_logp=old, ref_logp=ref,
                                           behavior_logp=np.where(pad, np.inf, old)))
    assert np.all(np.isfinite(dirty)), name
    np.testing.assert_array_equal(dirty[pad], 0.0)
    np.testing.assert_allclose(dirty, clean, rtol=1e-6, atol=1e-9)
    assert np.any(clean != 0.0)
