"""Axis 3: per-token terms and gradients of every trust region (docs/algorithms.md §4).

Every golden value below is derived by hand from docs/algorithms.md §4; the arithmetic sits
next to it. Single tokens use `old_logp = 0`, `logp = log(rho)`, so the ratio is
exactly `rho` and `d rho / d logp = rho`. Gradients are `d l / d logp`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import surrogates

LN = math.log


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x))


# Every call uses one shape, [2, 4], so eager primitives compile once for the file.
SHAPE = (2, 4)


def _pad(rows, fill=0.0):
    out = np.full(SHAPE, fill, np.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return jnp.asarray(out)


def _row(kind, logr, adv, *, jit=False, coef=None, **params):
    """Terms and d(sum coef * terms)/d logp for one row, padded into SHAPE."""
    n = len(logr)
    logp = _pad([logr])
    old = jnp.zeros(SHAPE, jnp.float32)
    adv_ = _pad([np.broadcast_to(np.asarray(adv, np.float32), (n,))])
    m = _pad([[1.0] * n])
    c = _pad([[1.0] * n if coef is None else coef])

    def f(lp):
        out = surrogates.surrogate_terms(kind, lp, old, adv_, m, **params)
        return jnp.sum(c * out.terms_BxT), out

    fn = jax.value_and_grad(f, has_aux=True)
    if jit:
        fn = jax.jit(fn)
    (_, out), g = fn(logp)
    t, g = np.asarray(out.terms_BxT), np.asarray(g)
    # Padding (the rest of row 0 and row 1) is exactly zero in terms and gradient.
    assert np.all(t[np.asarray(m) == 0] == 0.0) and np.all(g[np.asarray(m) == 0] == 0.0)
    return t[0, :n], g[0, :n], out.metrics


# --- the check values of docs/algorithms.md §4 ----------------------------------------------------

# (kind, params, rho, A, term, gradient)
CHECK_VALUES = [
    # A=+1, rho=1.5, eps 0.2: -min(1.5, clip(1.5, .8, 1.2)=1.2) = -1.2; the
    # clipped branch is constant -> zero gradient.
    ("clip", {}, 1.5, 1.0, -1.2, 0.0),
    # A=-1, rho=0.5: -min(-0.5, -0.8) = 0.8; clipped branch -> zero gradient.
    ("clip", {}, 0.5, -1.0, 0.8, 0.0),
    # A=-1, rho=5, no dual clip: -min(-5, -1.2) = 5, unclipped side: d(5)/dlogp
    # = rho = 5.
    ("clip", {}, 5.0, -1.0, 5.0, 5.0),
    # ... with dual clip c=3: min(5, -3 * -1 = 3) = 3, a constant -> zero grad.
    ("clip", {"dual_clip": 3.0}, 5.0, -1.0, 3.0, 0.0),
    # SAPO gate (4/tau) sigmoid(tau (rho - 1)) at tau=1, A=+1 so l = -gate;
    # gradient -A 4 s(1-s) rho.
    # rho=0.5: 4 sig(-0.5) = 4 * 0.3775407 = 1.5101627; grad -0.9400148 * 0.5
    ("sapo", {}, 0.5, 1.0, -1.510163, -0.4700074),
    # rho=1: 4 sig(0) = 2.0; grad -4 * 0.25 * 1 = -1 (weight 1 at rho = 1)
    ("sapo", {}, 1.0, 1.0, -2.0, -1.0),
    # rho=3: 4 sig(2) = 4 * 0.8807971 = 3.5231883;
    # grad -4 * 0.8807971 * 0.1192029 * 3 = -0.4199743 * 3 = -1.2599229
    ("sapo", {}, 3.0, 1.0, -3.523188, -1.2599229),
    # Same gate for A=-1 with tau_neg=1: l = +gate.
    ("sapo", {"sapo_tau_neg": 1.0}, 3.0, -1.0, 3.523188, 1.2599229),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind,params,rho,adv,term,grad", CHECK_VALUES)
def test_spec_check_values(jit, kind, params, rho, adv, term, grad):
    t, g, _ = _row(kind, [LN(rho)], adv, jit=jit, **params)
    np.testing.assert_allclose(t[0], term, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(g[0], grad, rtol=1e-5, atol=1e-7)


# --- every type, hand-derived ---------------------------------------------------

TOKEN_CASES = [
    # none: l = -A exp(logp - sg(logp)) = -A whatever rho; gradient -A.
    ("none", {}, 1.5, 2.0, -2.0, -2.0),
    ("none", {}, 0.3, -1.0, 1.0, 1.0),
    # clip, asymmetric DAPO 0.2/0.28: range (0.8, 1.28).
    # A=+1, rho=1.25 inside: -1.25, grad -rho = -1.25
    ("clip", {"eps_high": 0.28}, 1.25, 1.0, -1.25, -1.25),
    # A=+1, rho=1.3 > 1.28: -1.28, grad 0
    ("clip", {"eps_high": 0.28}, 1.3, 1.0, -1.28, 0.0),
    # A=+1, rho=0.5 (below, unclipped side for A>0): max(-0.5, -0.8) = -0.5, grad -0.5
    ("clip", {"eps_high": 0.28}, 0.5, 1.0, -0.5, -0.5),
    # A=-1, rho=0.85 inside: 0.85, grad 0.85
    ("clip", {"eps_high": 0.28}, 0.85, -1.0, 0.85, 0.85),
    # A=-1, rho=0.75 < 0.8: max(0.75, 0.8) = 0.8, grad 0
    ("clip", {"eps_high": 0.28}, 0.75, -1.0, 0.8, 0.0),
    # A=-1, rho=1.5 (above, unclipped side for A<0): max(1.5, 1.28) = 1.5, grad 1.5
    ("clip", {"eps_high": 0.28}, 1.5, -1.0, 1.5, 1.5),
    # Dual clip does not touch A>0: A=+1, rho=0.5 as above.
    ("clip", {"dual_clip": 3.0}, 0.5, 1.0, -0.5, -0.5),
    # Dual clip inactive below c: A=-1, rho=2.5: min(2.5, 3) = 2.5, grad 2.5
    ("clip", {"dual_clip": 3.0}, 2.5, -1.0, 2.5, 2.5),
    # cispo: l = -sg(clip(rho, 0, 5)) A logp; gradient -clip(rho, 0, 5) A.
    # A=+1, rho=1.5: l = -1.5 * ln 1.5 = -1.5 * 0.4054651 = -0.6081977; grad -1.5
    # (PPO clip gives 0 here: the CISPO point). A non-detached weight would
    # give -(rho + rho ln rho) = -2.108.
    ("cispo", {}, 1.5, 1.0, -0.6081977, -1.5),
    # A=+1, rho=6: weight truncated to 5: l = -5 ln 6 = -8.9587973; grad -5
    ("cispo", {}, 6.0, 1.0, -8.9587973, -5.0),
    # A=-1, rho=0.5: no lower bound, weight 0.5: l = 0.5 ln 0.5 = -0.3465736;
    # grad +0.5 (PPO clip: 0)
    ("cispo", {}, 0.5, -1.0, -0.3465736, 0.5),
    # sapo, default tau_pos 1, tau_neg 1.05: l = -A (4/tau) s, s = sig(tau (rho-1)),
    # gradient -A 4 s (1-s) rho.
    # A=+1, rho=2: s = sig(1) = 0.7310586; l = -2.9242343;
    # 4 s(1-s) = 0.7864477, grad -1.5728955
    ("sapo", {}, 2.0, 1.0, -2.9242343, -1.5728955),
    # A=-1, rho=2: tau 1.05, s = sig(1.05) = 0.7407749; l = (4/1.05) s = 2.8219996;
    # 4 s(1-s) = 0.7681098 < 0.7864477 (falls faster), grad 1.5362196
    ("sapo", {}, 2.0, -1.0, 2.8219996, 1.5362196),
    # A=-1, rho=0.5: s = sig(-0.525); l = (4/1.05) * 0.3716855 = 1.4159383;
    # 4 s(1-s) = 0.9341398 (< 0.9400148 at tau 1), grad 0.9341398 * 0.5 = 0.4670699
    ("sapo", {}, 0.5, -1.0, 1.4159383, 0.4670699),
    # ratio_mask (IcePop) [0.5, 2]: rho=1.5 kept: -A rho, grad -A rho.
    ("ratio_mask", {}, 1.5, 1.0, -1.5, -1.5),
    ("ratio_mask", {}, 0.6, -2.0, 1.2, 1.2),
    # rho=2.5 > 2 and rho=0.4 < 0.5: dropped, 0 and zero gradient.
    ("ratio_mask", {}, 2.5, 1.0, 0.0, 0.0),
    ("ratio_mask", {}, 0.4, -1.0, 0.0, 0.0),
]


@pytest.mark.parametrize("kind,params,rho,adv,term,grad", TOKEN_CASES)
def test_token_level_types(kind, params, rho, adv, term, grad):
    t, g, _ = _row(kind, [LN(rho)], adv, **params)
    np.testing.assert_allclose(t[0], term, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g[0], grad, rtol=1e-5, atol=1e-7)


def test_cispo_keeps_gradient_where_ppo_clip_zeroes_it():
    # The same token under clip and cispo: A=+1, rho=1.5.
    _, g_clip, _ = _row("clip", [LN(1.5)], 1.0)
    _, g_cispo, _ = _row("cispo", [LN(1.5)], 1.0)
    assert g_clip[0] == 0.0
    # -clip(1.5, 0, 5) * A = -1.5
    np.testing.assert_allclose(g_cispo[0], -1.5, rtol=1e-6)


def test_sapo_gate_weight_peaks_at_one_and_falls_faster_for_negative_advantages():
    rhos = [0.5, 0.8, 1.0, 2.0]
    logr = [LN(r) for r in rhos]
    # Gate weight = |grad| / rho = 4 s (1 - s).
    _, gp, _ = _row("sapo", logr, 1.0)
    _, gn, _ = _row("sapo", logr, -1.0)
    wp = np.abs(gp) / np.asarray(rhos)
    wn = np.abs(gn) / np.asarray(rhos)
    np.testing.assert_allclose(wp[2], 1.0, rtol=1e-6)   # 4 * 0.5 * 0.5
    np.testing.assert_allclose(wn[2], 1.0, rtol=1e-6)
    assert np.all(wp[[0, 1, 3]] < 1.0) and np.all(wn[[0, 1, 3]] < 1.0)
    # tau_neg = 1.05 > tau_pos = 1: narrower bump away from rho = 1.
    assert np.all(wn[[0, 1, 3]] < wp[[0, 1, 3]])
    # Hand value at rho=0.8, tau 1: s = sig(-0.2) = 0.4501660,
    # 4 s(1-s) = 4 * 0.4501660 * 0.5498340 = 0.9900663
    np.testing.assert_allclose(wp[1], 4 * _sig(-0.2) * (1 - _sig(-0.2)), rtol=1e-5)
    np.testing.assert_allclose(wp[1], 0.9900663, rtol=1e-6)


# prob_mask: p_old = 0.5 (old_logp = ln 0.5); eps 0.2.
PROB_CASES = [
    # (p, A, signed, term, grad); kept -> l = -A rho, rho = p / 0.5; grad -A rho.
    # p=0.6: |0.1| <= 0.2 kept: rho 1.2, A=+1: -1.2, grad -1.2
    (0.6, 1.0, False, -1.2, -1.2),
    # p=0.8: |0.3| > 0.2 dropped (unsigned), whatever A.
    (0.8, 1.0, False, 0.0, 0.0),
    (0.8, -1.0, False, 0.0, 0.0),
    # signed: A=+1 and p up by 0.3 > 0.2 -> dropped
    (0.8, 1.0, True, 0.0, 0.0),
    # signed: A=-1 and p up by 0.3: A pushes p down, kept: rho 1.6 -> l = 1.6, grad 1.6
    (0.8, -1.0, True, 1.6, 1.6),
    # p=0.2: down by 0.3; unsigned dropped
    (0.2, 1.0, False, 0.0, 0.0),
    # signed, A=+1 pushes up: kept, rho 0.4 -> l = -0.4, grad -0.4
    (0.2, 1.0, True, -0.4, -0.4),
    # signed, A=-1 and p down by 0.3 > 0.2: dropped
    (0.2, -1.0, True, 0.0, 0.0),
]


@pytest.mark.parametrize("p,adv,signed,term,grad", PROB_CASES)
def test_prob_mask(p, adv, signed, term, grad):
    logp = _pad([[LN(p)]])
    old = _pad([[LN(0.5)]])
    a = _pad([[adv]])
    m = _pad([[1.0]])

    def f(lp):
        return jnp.sum(surrogates.surrogate_terms(
            "prob_mask", lp, old, a, m, prob_signed=signed).terms_BxT)

    v, g = jax.value_and_grad(f)(logp)
    np.testing.assert_allclose(v, term, rtol=1e-5, atol=1e-7)
    assert np.count_nonzero(np.asarray(g)) <= 1
    np.testing.assert_allclose(g[0, 0], grad, rtol=1e-5, atol=1e-7)


# --- sequence-level -------------------------------------------------------------

def _seq(kind, logr, adv, **params):
    # Coefficient 1/L on each token so the row term counts once (seq_mean, docs/algorithms.md §3).
    n = len(logr)
    return _row(kind, logr, adv, coef=[1.0 / n] * n, **params)


@pytest.mark.parametrize("kind", ["sequence_clip", "sequence_clip_token"])
def test_sequence_clip_row_ratio(kind):
    # logr (0.1, 0.3): s = exp(mean) = exp(0.2) = 1.2214028.
    # A=+1, eps 0.2: s > 1.2 -> l = -1.2 on both tokens, zero gradient.
    t, g, m = _seq(kind, [0.1, 0.3], 1.0)
    np.testing.assert_allclose(t, [-1.2, -1.2], rtol=1e-6)
    np.testing.assert_array_equal(g, [0.0, 0.0])
    np.testing.assert_allclose(m["seq_ratio_mean"], 1.2214028, rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac"], 1.0)
    # A=-1: l = max(s, 1.2) = 1.2214028; d l / d logp_t = s / L = 0.6107014.
    t, g, m = _seq(kind, [0.1, 0.3], -1.0)
    np.testing.assert_allclose(t, [1.2214028] * 2, rtol=1e-6)
    np.testing.assert_allclose(g, [0.6107014] * 2, rtol=1e-5)
    np.testing.assert_allclose(m["clip_frac"], 0.0)


@pytest.mark.parametrize("kind", ["sequence_clip", "sequence_clip_token"])
def test_sequence_clip_gspo_window(kind):
    gspo = dict(eps_low=3e-4, eps_high=4e-4)
    # logr (2e-4, 4e-4): mean 3e-4, s = 1.0003000 < 1.0004: inside.
    # A=+1: l = -1.0003000, grad -s/2 = -0.5001500 per token.
    t, g, _ = _seq(kind, [2e-4, 4e-4], 1.0, **gspo)
    np.testing.assert_allclose(t, [-1.0003000] * 2, rtol=1e-6)
    np.testing.assert_allclose(g, [-0.5001500] * 2, rtol=1e-5)
    # logr (6e-4, 4e-4): mean 5e-4, s = 1.0005001 > 1.0004: clipped to -1.0004, grad 0.
    t, g, _ = _seq(kind, [6e-4, 4e-4], 1.0, **gspo)
    np.testing.assert_allclose(t, [-1.0004] * 2, rtol=1e-6)
    np.testing.assert_array_equal(g, [0.0, 0.0])


GMPO_CASES = [
    # d = 0.4. clipped_logr = sgn(A) min(sgn(A) logr, sgn(A) clip(logr, -.4, .4)).
    # A=+1, logr (0.2, 0.6) -> (0.2, 0.4): mean 0.3, l = -exp(0.3) = -1.3498588;
    # grad token0 -exp(0.3)/2 = -0.6749294, token1 clipped 0.
    (1.0, [0.2, 0.6], -1.3498588, [-0.6749294, 0.0]),
    # A=-1, logr (0.2, 0.6) -> max(logr, clip) = (0.2, 0.6): mean 0.4,
    # l = exp(0.4) = 1.4918247; grads exp(0.4)/2 = 0.7459123 each.
    (-1.0, [0.2, 0.6], 1.4918247, [0.7459123, 0.7459123]),
    # A=-1, logr (-0.6, 0.2) -> (-0.4, 0.2): mean -0.1, l = exp(-0.1) = 0.9048374;
    # grads (0, exp(-0.1)/2 = 0.4524187).
    (-1.0, [-0.6, 0.2], 0.9048374, [0.0, 0.4524187]),
    # A=+1, logr (-0.6, 0.2) -> min: (-0.6, 0.2): mean -0.2, l = -exp(-0.2) = -0.8187308;
    # grads -exp(-0.2)/2 = -0.4093654 each.
    (1.0, [-0.6, 0.2], -0.8187308, [-0.4093654, -0.4093654]),
    # A=+2: l = -2 exp(mean 0.1) = -2.2103418; grads -exp(0.1) = -1.1051709 each.
    (2.0, [0.0, 0.2], -2.2103418, [-1.1051709, -1.1051709]),
]


@pytest.mark.parametrize("adv,logr,term,grad", GMPO_CASES)
def test_gmpo(adv, logr, term, grad):
    t, g, _ = _seq("gmpo", logr, adv)
    np.testing.assert_allclose(t, [term] * 2, rtol=1e-6)
    np.testing.assert_allclose(g, grad, rtol=1e-5, atol=1e-7)


# --- metrics --------------------------------------------------------------------

def test_clip_frac_and_ratio_stats_on_a_hand_built_case():
    # Tokens (A, rho): (+1, 1.5) clipped; (+1, 1.1) not; (-1, 0.5) clipped;
    # (-1, 1.5) unclipped side; a padded token with rho 10 that must not count.
    logp = _pad([[LN(1.5), LN(1.1), LN(0.5), LN(1.5)], [LN(10.0)]])
    adv = _pad([[1.0, 1.0, -1.0, -1.0], [1.0]])
    m = _pad([[1, 1, 1, 1], [0]])
    out = surrogates.surrogate_terms("clip", logp, jnp.zeros_like(logp), adv, m)
    np.testing.assert_allclose(out.metrics["clip_frac"], 2 / 4)
    # mean (1.5 + 1.1 + 0.5 + 1.5) / 4 = 1.15; min 0.5; max 1.5 (not 10).
    np.testing.assert_allclose(out.metrics["ratio_mean"], 1.15, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["ratio_min"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["ratio_max"], 1.5, rtol=1e-6)
    assert out.terms_BxT[1, 0] == 0.0
    # Dual clip c=3 with (-1, rho=5): 1 of 1 A<0 token beyond c.
    out = surrogates.surrogate_terms(
        "clip", _pad([[LN(5.0), LN(0.9)]]), jnp.zeros(SHAPE),
        _pad([[-1.0, -1.0]]), _pad([[1.0, 1.0]]), dual_clip=3.0)
    # rho=5: dual-clipped (5 > 3); rho=0.9: inside. clip_frac 1/2, dual 1/2.
    np.testing.assert_allclose(out.metrics["dual_clip_frac"], 0.5)
    np.testing.assert_allclose(out.metrics["clip_frac"], 0.5)


def test_empty_batch_metrics_are_neutral():
    z = jnp.zeros(SHAPE, jnp.float32)
    for kind in surrogates.TYPES:
        out = surrogates.surrogate_terms(kind, z, z, z, z)
        np.testing.assert_array_equal(out.terms_BxT, z)
        assert out.metrics["clip_frac"] == 0.0
        assert out.metrics["ratio_mean"] == 1.0, kind


# --- padding and extreme ratios ---------------------------------------------------

@pytest.mark.parametrize("kind", surrogates.TYPES)
@pytest.mark.parametrize("pad", [np.nan, -np.inf, np.inf], ids=["nan", "-inf", "inf"])
def test_padding_is_exactly_zero_with_garbage_logprobs(kind, pad):
    # Row 0: two real tokens then padding; row 1: empty.
    logp = jnp.asarray([[LN(1.1), LN(0.9), pad, pad], [pad] * 4], jnp.float32)
    old = jnp.asarray([[0.0, 0.0, pad, -pad], [pad, -pad, pad, 0.0]], jnp.float32)
    adv = jnp.asarray([[1.0, 1.0, pad, pad], [pad] * 4], jnp.float32)
    m = _pad([[1, 1]])
    c = _pad([[0.5, 0.5]])

    def f(lp):
        out = surrogates.surrogate_terms(kind, lp, old, adv, m)
        return jnp.sum(c * out.terms_BxT), out

    (v, out), g = jax.value_and_grad(f, has_aux=True)(logp)
    assert np.isfinite(v)
    assert np.all(np.isfinite(np.asarray(out.terms_BxT)))
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_array_equal(np.asarray(out.terms_BxT)[m == 0], 0.0)
    np.testing.assert_array_equal(np.asarray(g)[m == 0], 0.0)
    # Real tokens still carry a gradient (A=+1 inside every trust region).
    assert np.all(np.asarray(g)[0, :2] != 0.0)
    for k, val in out.metrics.items():
        assert np.isfinite(val), (kind, k)


@pytest.mark.parametrize("kind", surrogates.TYPES)
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_extreme_log_ratios_give_finite_terms_and_gradients(kind, adv):
    # logr = +1e4 and -1e4 (old_logp = -+1e4 against logp = 0).
    logp = jnp.zeros(SHAPE, jnp.float32)
    old = jnp.asarray([[-1e4, 1e4, -1e4, 1e4], [1e4, 1e4, -1e4, -1e4]], jnp.float32)
    a = jnp.full(SHAPE, adv, jnp.float32)
    m = jnp.ones(SHAPE, jnp.float32)

    def f(lp):
        out = surrogates.surrogate_terms(kind, lp, old, a, m)
        return jnp.sum(out.terms_BxT), out

    (v, out), g = jax.value_and_grad(f, has_aux=True)(logp)
    assert np.isfinite(v), kind
    assert np.all(np.isfinite(np.asarray(g))), kind
    for k, val in out.metrics.items():
        assert np.isfinite(val), (kind, k)


def test_ratio_mask_extreme_ratios_are_dropped_with_zero_gradient():
    # IcePop: logr = +-1e4 is outside [ln 0.5, ln 2]: term 0, gradient exactly 0.
    logp = jnp.zeros(SHAPE, jnp.float32)
    old = _pad([[-1e4, 1e4, LN(1 / 1.5)]])   # rho 1.5 on token 2
    a = jnp.ones(SHAPE, jnp.float32)

    def f(lp):
        return jnp.sum(surrogates.surrogate_terms("ratio_mask", lp, old, a,
                                                  _pad([[1, 1, 1]])).terms_BxT)

    v, g = jax.value_and_grad(f)(logp)
    # Only token 2 is kept: l = -1.5, grad -1.5.
    np.testing.assert_allclose(v, -1.5, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g[0]), [0.0, 0.0, -1.5, 0.0], rtol=1e-6)
    assert g[0, 0] == 0.0 and g[0, 1] == 0.0


def test_log_ratio_is_clamped_before_exp():
    # docs/algorithms.md §4: logr clamped to [-20, 20] before exp. ratio for logr = 50 is e^20.
    logp = _pad([[50.0]])
    out = surrogates.surrogate_terms("clip", logp, jnp.zeros(SHAPE),
                                     -jnp.ones(SHAPE), _pad([[1.0]]))
    np.testing.assert_allclose(out.metrics["ratio_max"], math.exp(20.0), rtol=1e-5)
    # A=-1: l = max(rho, 1.2) = e^20 = 4.8516520e8
    np.testing.assert_allclose(out.terms_BxT[0, 0], 4.8516520e8, rtol=1e-5)


def test_surrogate_rejects_bad_input_naming_it():
    z = jnp.zeros(SHAPE)
    with pytest.raises(ValueError, match="loss.type"):
        surrogates.surrogate_terms("ppo", z, z, z, z)
    with pytest.raises(ValueError, match="eps_hi"):
        surrogates.surrogate_terms("clip", z, z, z, z, eps_hi=0.3)
    with pytest.raises(ValueError, match="advantages_BxT"):
        surrogates.surrogate_terms("clip", z, z, jnp.zeros(SHAPE[:1]), z)
    with pytest.raises(ValueError, match="dual_clip"):
        surrogates.surrogate_terms("clip", z, z, z, z, dual_clip=0.5)
    with pytest.raises(ValueError, match="ratio_low"):
        surrogates.surrogate_terms("ratio_mask", z, z, z, z, ratio_low=2.0, ratio_high=1.0)


def test_jit_and_eager_agree_for_every_type():
    logr = [LN(0.7), LN(1.1), LN(1.6), 0.05]
    adv = [1.0, -0.5, 2.0, -1.0]   # row mean 0.375 > 0 for the row-level types
    for kind in surrogates.TYPES:
        t0, g0, _ = _row(kind, logr, adv)
        t1, g1, _ = _row(kind, logr, adv, jit=True)
        np.testing.assert_allclose(t0, t1, rtol=1e-6, err_msg=kind)
        np.testing.assert_allclose(g0, g1, rtol=1e-6, atol=1e-8, err_msg=kind)
        assert np.any(g0 != 0.0), kind
