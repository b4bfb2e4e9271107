"""Axis 3: loss terms and trust regions.

Each surrogate returns per-token terms `l[b, t]` for the batch loss
`sum c[b,t] l[b,t]`. A sequence-level surrogate (GSPO, GMPO) writes its row
term `l_b` on every token of the row, so that `sum_t c[b,t] l_b = c_b l_b`
with the row coefficient `c_b = sum_t c[b,t]` (see normalizers.py).

Every log-ratio is `logr = logp - old_logp` clamped to +-LOG_RATIO_CLAMP
before `exp`, and every input is zeroed on padding before use (double-where),
so padded tokens get exactly zero gradient even when their log-probs are
garbage.

Sources: PPO (Schulman et al. 2017), dual clip (Ye et al. 2020), DAPO clip-
higher (Yu et al. 2025), GSPO (Zheng et al. 2025), CISPO (MiniMax-M1), GMPO
(Zhao et al. 2025), SAPO (Qwen 2025), IcePop (Ring-1T), IPO/DPPO probability
mask (prime-rl).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rljax import _checks

LOG_RATIO_CLAMP = 20.0

TOKEN_LEVEL = ("none", "clip", "sequence_clip_token", "cispo", "sapo",
               "prob_mask", "ratio_mask")
SEQUENCE_LEVEL = ("sequence_clip", "gmpo")
TYPES = TOKEN_LEVEL + SEQUENCE_LEVEL

# Defaults of every trust-region parameter (docs/algorithms.md §4). Recipes override.
DEFAULTS = dict(
    eps_low=0.2,        # clip / sequence_clip: lower bound 1 - eps_low
    eps_high=0.2,       # clip / sequence_clip: upper bound 1 + eps_high
    dual_clip=0.0,      # clip: c of dual clip for A < 0; 0 turns it off
    cispo_min=0.0,      # cispo: truncation floor of the IS weight (0: none)
    cispo_max=5.0,      # cispo: truncation cap of the IS weight
    gmpo_delta=0.4,     # gmpo: log-ratio clip (-d, d)
    sapo_tau_pos=1.0,   # sapo: temperature for A > 0
    sapo_tau_neg=1.05,  # sapo: temperature for A <= 0
    prob_eps=0.2,       # prob_mask: drop when |p - p_old| > eps
    prob_signed=False,  # prob_mask: test only the direction A pushes (DPPO)
    ratio_low=0.5,      # ratio_mask (IcePop): keep low <= rho <= high
    ratio_high=2.0,
)


class SurrogateOutput(NamedTuple):
    """terms_BxT: float32 per-token terms (0 on padding).

    metrics: `clip_frac` (fraction of tokens whose gradient the trust region
    removed or truncated), `ratio_mean`, `ratio_min`, `ratio_max` (over
    tokens with mask 1; rows for sequence-level surrogates).
    """

    terms_BxT: jax.Array
    metrics: dict


def _masked_stats(x, m, prefix):
    count = jnp.sum(m)
    any_ = count > 0
    mean = jnp.sum(jnp.where(m, x, 0.0)) / jnp.maximum(count, 1.0)
    lo = jnp.min(jnp.where(m, x, jnp.inf))
    hi = jnp.max(jnp.where(m, x, -jnp.inf))
    # An empty batch reports the neutral ratio 1, not +-inf.
    return {
        f"{prefix}_mean": jnp.where(any_, mean, 1.0),
        f"{prefix}_min": jnp.where(any_, lo, 1.0),
        f"{prefix}_max": jnp.where(any_, hi, 1.0),
    }


def _frac(flag, m):
    return jnp.sum(jnp.where(m, flag, False)) / jnp.maximum(jnp.sum(m), 1.0)


def _row_mean(x_BxT, m_BxT):
    len_B = jnp.sum(m_BxT, axis=1)
    return jnp.sum(jnp.where(m_BxT, x_BxT, 0.0), axis=1) / jnp.maximum(len_B, 1.0)


def _ppo_clip(ratio, adv, eps_low, eps_high):
    # -min(rho A, clip(rho) A) written as max of the two losses.
    return jnp.maximum(-ratio * adv,
                       -jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)


def surrogate_terms(
    kind: str,
    logp_BxT: jax.Array,
    old_logp_BxT: jax.Array,
    advantages_BxT: jax.Array,
    mask_BxT: jax.Array,
    **params,
) -> SurrogateOutput:
    """Per-token terms of trust region `kind` (docs/algorithms.md §4).

    none:   -A rho, rho = exp(logp - sg(logp)): REINFORCE, gradient A grad logp.
    clip:   -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A); dual clip: for
            A < 0, min(l, -c A).
    sequence_clip: s_b = exp(mean_t logr), row term -min(s A, clip(s) A).
    sequence_clip_token: s_bt = sg(s_b) exp(logp - sg(logp)), clipped per token.
    cispo:  -sg(clip(rho, cispo_min, cispo_max)) A logp.
    gmpo:   row term -A exp(mean_t clipped_logr) with
            clipped_logr = sgn(A) min(sgn(A) logr, sgn(A) clip(logr, -d, d)).
    sapo:   -A (4/tau) sigmoid(tau (rho - 1)), tau by the sign of A.
    prob_mask: drop tokens with |p - p_old| > prob_eps, else -A rho.
    ratio_mask: IcePop, keep ratio_low <= rho <= ratio_high, else drop.
    """
    _checks.check_choice("loss.type", kind, TYPES)
    unknown = set(params) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown trust-region parameters {sorted(unknown)}; "
                         f"valid: {sorted(DEFAULTS)}")
    p = dict(DEFAULTS, **params)
    _checks.check_rank("logp_BxT", logp_BxT, 2)
    _checks.check_same_shape(logp_BxT=logp_BxT, old_logp_BxT=old_logp_BxT,
                             advantages_BxT=advantages_BxT, mask_BxT=mask_BxT)

    m = jnp.asarray(mask_BxT) > 0
    logp = jnp.where(m, logp_BxT.astype(jnp.float32), 0.0)
    old = jnp.where(m, jax.lax.stop_gradient(old_logp_BxT).astype(jnp.float32), 0.0)
    adv = jnp.where(m, jax.lax.stop_gradient(advantages_BxT).astype(jnp.float32), 0.0)
    logr = jnp.clip(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(logr)
    metrics = _masked_stats(jax.lax.stop_gradient(ratio), m, "ratio")
    on_policy = jnp.exp(logp - jax.lax.stop_gradient(logp))

    if kind == "none":
        terms = -adv * on_policy
        clipped = jnp.zeros_like(m)
    elif kind == "clip":
        terms = _ppo_clip(ratio, adv, p["eps_low"], p["eps_high"])
        clipped = (((adv > 0) & (ratio > 1 + p["eps_high"]))
                   | ((adv < 0) & (ratio < 1 - p["eps_low"])))
        if p["dual_clip"]:
            c = p["dual_clip"]
            if c <= 1.0:
                raise ValueError(f"loss.dual_clip={c} must be > 1 (0 turns it off)")
            dual = (adv < 0) & (terms > -c * adv)
            terms = jnp.where(adv < 0, jnp.minimum(terms, -c * adv), terms)
            clipped = clipped | dual
            metrics["dual_clip_frac"] = _frac(dual, m)
    elif kind in ("sequence_clip", "sequence_clip_token"):
        len_B = jnp.sum(m, axis=1)
        row_logr_B = jnp.clip(_row_mean(logr, m), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        s_B = jnp.exp(row_logr_B)
        if kind == "sequence_clip":
            row_adv_B = _row_mean(adv, m)
            row_B = _ppo_clip(s_B, row_adv_B, p["eps_low"], p["eps_high"])
            terms = jnp.where(m, row_B[:, None], 0.0)
            s_bt = jnp.broadcast_to(s_B[:, None], m.shape)
        else:
            s_bt = jax.lax.stop_gradient(s_B)[:, None] * on_policy
            terms = _ppo_clip(s_bt, adv, p["eps_low"], p["eps_high"])
        clipped = (((adv > 0) & (s_bt > 1 + p["eps_high"]))
                   | ((adv < 0) & (s_bt < 1 - p["eps_low"])))
        rows = len_B > 0
        metrics.update(_masked_stats(jax.lax.stop_gradient(s_B), rows, "seq_ratio"))
    elif kind == "cispo":
        w = jax.lax.stop_gradient(jnp.clip(ratio, p["cispo_min"], p["cispo_max"]))
        terms = -w * adv * logp
        clipped = (ratio > p["cispo_max"]) | (ratio < p["cispo_min"])
    elif kind == "gmpo":
        d = p["gmpo_delta"]
        sgn = jnp.sign(adv)
        clipped_logr = sgn * jnp.minimum(sgn * logr, sgn * jnp.clip(logr, -d, d))
        row_B = -_row_mean(adv, m) * jnp.exp(_row_mean(clipped_logr, m))
        terms = jnp.where(m, row_B[:, None], 0.0)
        clipped = ((adv > 0) & (logr > d)) | ((adv < 0) & (logr < -d))
    elif kind == "sapo":
        tau = jnp.where(adv > 0, p["sapo_tau_pos"], p["sapo_tau_neg"])
        terms = -adv * (4.0 / tau) * jax.nn.sigmoid(tau * (ratio - 1.0))
        # Nothing is cut, but report where the soft gate has fallen below half.
        s = jax.nn.sigmoid(tau * (ratio - 1.0))
        clipped = 4.0 * s * (1.0 - s) < 0.5
    elif kind == "prob_mask":
        delta = jnp.exp(logp) - jnp.exp(old)
        if p["prob_signed"]:
            drop = ((adv > 0) & (delta > p["prob_eps"])) | (
                (adv < 0) & (-delta > p["prob_eps"]))
        else:
            drop = jnp.abs(delta) > p["prob_eps"]
        drop = jax.lax.stop_gradient(drop)
        terms = jnp.where(drop, 0.0, -adv * ratio)
        clipped = drop
    else:  # ratio_mask (IcePop)
        lo, hi = p["ratio_low"], p["ratio_high"]
        if not 0 < lo < hi:
            raise ValueError(f"loss.ratio_low={lo} and loss.ratio_high={hi} "
                             "need 0 < low < high")
        keep = (logr >= math.log(lo)) & (logr <= math.log(hi))
        # Test in log space and exponentiate only kept tokens: a rejected
        # extreme ratio never makes 0 * inf.
        kept_ratio = jnp.exp(jnp.where(keep, logr, 0.0))
        terms = jnp.where(keep, -adv * kept_ratio, 0.0)
        clipped = ~keep

    metrics["clip_frac"] = _frac(clipped, m)
    return SurrogateOutput(jnp.where(m, terms, 0.0), metrics)
