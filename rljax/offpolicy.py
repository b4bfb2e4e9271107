"""Axis 4: off-policy handling.

Three policies meet in a step: the behavior policy `mu` whose log-probs the
sampler recorded, the old / proximal policy `pi_old` the trust region is
measured against (the trainer's own log-probs at the start of the batch when
`recompute_old_logp`, else `mu`), and the current policy.

The behavior correction `w = sg(pi_old / mu)` multiplies each term (decoupled
PPO, AReaL; truncated IS, Yao et al. 2025; masked IS). Row filters drop stale
rows and truncated rows before they reach a step, and are counted.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rljax import _checks

LEVELS = ("none", "token", "sequence", "geometric")
MODES = ("truncate", "mask")


class BehaviorWeights(NamedTuple):
    """weights_BxT: float32, 0 on padding; metrics: fractions and the mean."""

    weights_BxT: jax.Array
    metrics: dict


def behavior_weights(
    old_logp_BxT: jax.Array,
    behavior_logp_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> BehaviorWeights:
    """Importance weights `sg(pi_old / mu)` at a `level`, bounded by a `mode`.

    level: `token` (per token), `sequence` (product over the row), `geometric`
    (geometric mean over the row), `none` (all ones).
    mode: `truncate` -> `min(w, cap)` (TIS); `mask` -> `w` inside
    `[low, high]`, 0 outside (masked IS; the test happens in log space so an
    extreme ratio is never exponentiated).
    """
    _checks.check_choice("offpolicy.level", level, LEVELS)
    _checks.check_choice("offpolicy.mode", mode, MODES)
    _checks.check_same_shape(old_logp_BxT=old_logp_BxT,
                             behavior_logp_BxT=behavior_logp_BxT, mask_BxT=mask_BxT)
    m = jnp.asarray(mask_BxT) > 0
    if level == "none":
        return BehaviorWeights(m.astype(jnp.float32),
                               {"is_weight_mean": jnp.float32(1.0),
                                "is_clip_frac": jnp.float32(0.0)})
    logw = jnp.where(m, jax.lax.stop_gradient(old_logp_BxT - behavior_logp_BxT), 0.0)
    logw = logw.astype(jnp.float32)
    if level == "sequence":
        logw = jnp.broadcast_to(jnp.sum(logw, axis=1, keepdims=True), m.shape)
    elif level == "geometric":
        len_B1 = jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1)
        logw = jnp.broadcast_to(jnp.sum(logw, axis=1, keepdims=True) / len_B1, m.shape)
    logw = jnp.clip(logw, -20.0, 20.0)
    if mode == "truncate":
        w = jnp.minimum(jnp.exp(logw), cap)
        cut = logw > np.log(cap)
    else:
        keep = (logw >= np.log(low)) & (logw <= np.log(high))
        w = jnp.where(keep, jnp.exp(jnp.where(keep, logw, 0.0)), 0.0)
        cut = ~keep
    w = jnp.where(m, w, 0.0)
    count = jnp.maximum(jnp.sum(m), 1)
    return BehaviorWeights(w, {
        "is_weight_mean": jnp.sum(w) / count,
        "is_clip_frac": jnp.sum(cut & m) / count,
    })


def mismatch_metrics(logp_BxT, behavior_logp_BxT, mask_BxT) -> dict:
    """Trainer-sampler mismatch: mean |logp - mu| and the k3 KL(mu || pi)."""
    m = jnp.asarray(mask_BxT) > 0
    diff = jnp.where(m, jax.lax.stop_gradient(logp_BxT - behavior_logp_BxT), 0.0)
    count = jnp.maximum(jnp.sum(m), 1)
    # Samples come from mu, so x = log pi/mu estimates KL(mu || pi) via k3.
    k3 = jnp.where(m, jnp.expm1(jnp.clip(diff, -20, 20)) - diff, 0.0)
    return {"mismatch_abs": jnp.sum(jnp.abs(diff)) / count,
            "mismatch_k3": jnp.sum(k3) / count}


# Row filters read host-side row metadata (versions, flags), so they are
# numpy: their counts are known before anything is traced or dispatched.


def staleness_keep(policy_version_B, current_version, max_staleness: int) -> np.ndarray:
    """Rows sampled at most `max_staleness` versions ago (bool [B])."""
    if max_staleness < 0:
        raise ValueError(f"offpolicy.max_staleness={max_staleness} must be >= 0")
    return (current_version - np.asarray(policy_version_B)) <= max_staleness


def truncation_keep(truncated_B, mask_truncated: bool) -> np.ndarray:
    """Drops rows that hit the token limit without a stop token when asked."""
    t = np.asarray(truncated_B, bool)
    return ~t if mask_truncated else np.ones_like(t)


def apply_row_filter(mask_BxT: jax.Array, keep_B: jax.Array):
    """Zeroes the loss mask of dropped rows; returns (mask, dropped count)."""
    keep_B = jnp.asarray(keep_B, bool)
    return (jnp.where(keep_B[:, None], mask_BxT, 0).astype(mask_BxT.dtype),
            jnp.sum(~keep_B).astype(jnp.int32))
