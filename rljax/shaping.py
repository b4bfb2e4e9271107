"""DAPO's reward-side extras: dynamic sampling's group filter and overlong shaping.

Dynamic sampling (Yu et al. 2025) drops groups whose rewards are all equal
(they carry no group-relative signal) and keeps sampling until the step has
enough informative groups. Overlong shaping penalises lengths in the last
`buffer` tokens before the limit, counted in tokens (Tunix counts characters).
"""

import jax
import jax.numpy as jnp

from rljax import _checks


def informative_groups(rewards_B: jax.Array, *, group_size: int) -> jax.Array:
    """bool [G]: groups whose finite rewards are not all equal."""
    _checks.check_rank("rewards_B", rewards_B, 1)
    b = rewards_B.shape[0]
    if group_size < 1 or b % group_size:
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the batch of {b} rows")
    r = jnp.asarray(rewards_B, jnp.float32).reshape(b // group_size, group_size)
    finite = jnp.all(jnp.isfinite(r), axis=1)
    return finite & jnp.any(r != r[:, :1], axis=1)


def overlong_penalty(
    lengths_B: jax.Array, *, max_tokens: int, buffer: int, factor: float = 1.0,
) -> jax.Array:
    """Soft overlong punishment (DAPO eq. 13), in tokens.

    0 if `L <= L_max - L_buf`; else `((L_max - L_buf) - L) / L_buf * factor`,
    floored at `-factor` (reached at `L = L_max`).
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(
            f"dapo.overlong_buffer={buffer} must be in (0, max_tokens={max_tokens}]")
    start = max_tokens - buffer
    lengths = jnp.asarray(lengths_B, jnp.float32)
    pen = (start - lengths) / buffer * factor
    return jnp.clip(jnp.where(lengths <= start, 0.0, pen), -factor, 0.0)
