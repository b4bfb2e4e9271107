"""Axis 2: normalization, as coefficient streams `c[b, t]`.

The batch loss is always `sum_{b,t} c[b,t] * l[b,t]`. The coefficients are
computed once over the optimizer-step batch, before it is split into
micro-batches or across devices, so that summing the pieces' losses gives the
full-batch loss exactly (verl's legacy path normalizes each micro-batch
locally, which changes the gradient with the micro-batch size).

A sequence-level surrogate (GSPO, GMPO) spreads its row term `l_b` over the
row's tokens; its row coefficient is then `sum_t c[b, t]`, so `seq_mean` is
`1 / (B' L_b)` per token, i.e. `1 / B'` per row.
"""

import jax
import jax.numpy as jnp

from rljax import _checks

MODES = (
    "seq_mean_token_mean",   # GRPO, SAPO: 1 / (B' L_b)
    "token_mean",            # DAPO, PPO: 1 / sum_b L_b
    "group_token_mean",      # CISPO: 1 / (G' sum_{j in g} L_j)
    "seq_mean_token_sum",    # RLOO, REINFORCE: 1 / B'
    "token_sum_norm",        # Dr. GRPO: 1 / (B L_max), a constant
    "seq_mean",              # GSPO, GMPO: 1 / B' per row
)


def _safe_recip(x):
    # Double-where: 1/0 would be inf (and its gradient NaN) on empty rows.
    nonzero = x > 0
    return jnp.where(nonzero, 1.0 / jnp.where(nonzero, x, 1.0), 0.0)


def coefficients(
    mask_BxT: jax.Array,
    *,
    mode: str,
    group_size: int | None = None,
    max_tokens: int | None = None,
) -> jax.Array:
    """Normalizer coefficients `c[b, t]` (float32, 0 where mask is 0).

    `B'` counts rows with at least one token, `G'` groups with at least one
    token; `token_sum_norm` divides by all `B` rows times the generation limit
    `max_tokens` (Dr. GRPO and TRL; verl divides by the padded width instead).
    An all-zero mask gives all-zero coefficients, never NaN.
    """
    _checks.check_rank("mask_BxT", mask_BxT, 2)
    _checks.check_choice("loss.norm", mode, MODES)
    m = (jnp.asarray(mask_BxT) > 0).astype(jnp.float32)
    b, _ = m.shape
    len_B = jnp.sum(m, axis=1)
    rows = jnp.sum(len_B > 0).astype(jnp.float32)

    if mode in ("seq_mean_token_mean", "seq_mean"):
        row_c = _safe_recip(rows * len_B)
    elif mode == "token_mean":
        row_c = jnp.broadcast_to(_safe_recip(jnp.sum(len_B)), (b,))
    elif mode == "group_token_mean":
        if group_size is None or group_size < 1 or b % group_size:
            raise ValueError(
                f"loss.norm='group_token_mean' needs a group_size dividing the "
                f"batch of {b} rows, got {group_size}")
        len_G = jnp.sum(len_B.reshape(b // group_size, group_size), axis=1)
        groups = jnp.sum(len_G > 0).astype(jnp.float32)
        row_c = jnp.repeat(_safe_recip(groups * len_G), group_size)
    elif mode == "seq_mean_token_sum":
        row_c = jnp.broadcast_to(_safe_recip(rows), (b,))
    else:  # token_sum_norm
        if max_tokens is None or max_tokens < 1:
            raise ValueError(
                "loss.norm='token_sum_norm' needs max_tokens (the generation "
                f"limit L_max) >= 1, got {max_tokens}")
        row_c = jnp.full((b,), 1.0 / (b * max_tokens), jnp.float32)
    return row_c[:, None] * m


def weighted_coefficients(
    weights_BxT: jax.Array, *, mode: str, group_size: int | None = None,
    max_tokens: int | None = None,
) -> jax.Array:
    """Coefficients for a weighted component (`ce`, `ref_kl`).

    A token with weight 0 leaves both numerator and denominator; the others
    are normalized as if mask = (weight > 0) and then scaled by their weight.
    """
    w = jnp.asarray(weights_BxT, jnp.float32)
    c = coefficients(w > 0, mode=mode, group_size=group_size,
                     max_tokens=max_tokens)
    return c * w


def row_coefficients(coef_BxT: jax.Array) -> jax.Array:
    """The coefficient of a row-level term: `c_b = sum_t c[b, t]`."""
    return jnp.sum(coef_BxT, axis=1)
