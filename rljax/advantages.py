"""Axis 1: advantage estimators.

Outcome estimators turn one scalar reward per row into `A_b = (r_b - baseline_b)
/ scale_b` over groups of `n` consecutive rows that share a prompt; GAE turns
per-token rewards and a critic's values into per-token advantages.

References: GRPO (Shao et al. 2024), RLOO (Ahmadian et al. 2024), Dr. GRPO (Liu
et al. 2025), REINFORCE++ batch std, MaxRL (arXiv 2602.02710), GAE (Schulman et
al. 2016).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rljax import _checks

BASELINES = ("group_mean", "leave_one_out", "none")
SCALES = ("none", "group_std", "batch_std", "group_mean")


class AdvantageOutput(NamedTuple):
    """Per-row advantages and the group statistics the trainer logs.

    advantages_B: float32 [B]; exactly 0 for groups whose rewards are all equal
      (when there is a baseline) and for groups holding a non-finite reward.
    zero_std_groups: int32 []; groups whose rewards are all equal.
    invalid_groups: int32 []; groups skipped because a reward was NaN or inf.
    """

    advantages_B: jax.Array
    zero_std_groups: jax.Array
    invalid_groups: jax.Array


def group_advantages(
    rewards_B: jax.Array,
    *,
    group_size: int,
    baseline: str = "group_mean",
    scale: str = "group_std",
    ddof: int = 0,
    eps: float = 1e-6,
) -> AdvantageOutput:
    """Group-relative outcome advantages `(r - baseline) / scale`.

    baseline: `group_mean` (GRPO), `leave_one_out` (RLOO: mean of the other
    n-1 rows), `none`. scale: `none`, `group_std` (`std_g(ddof) + eps`),
    `batch_std` (std over the whole batch + eps), `group_mean` (MaxRL: divide
    by the group mean; a group with mean <= 0 gets all-zero advantages).

    Non-finite rewards cannot be raised on under jit, so the group holding one
    is skipped (advantages 0) and counted in `invalid_groups`.
    """
    _checks.check_rank("rewards_B", rewards_B, 1)
    _checks.check_choice("advantage.baseline", baseline, BASELINES)
    _checks.check_choice("advantage.scale", scale, SCALES)
    n = int(group_size)
    b = rewards_B.shape[0]
    if n < 1 or b % n:
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the batch of {b} rows")
    if baseline == "leave_one_out" and n < 2:
        raise ValueError("advantage.baseline='leave_one_out' needs group_size >= 2")
    if scale in ("group_std",) and n - ddof <= 0:
        raise ValueError(f"advantage.ddof={ddof} needs group_size > ddof, got {n}")

    r_GxN = jnp.asarray(rewards_B, jnp.float32).reshape(b // n, n)
    finite_G = jnp.all(jnp.isfinite(r_GxN), axis=1)
    # Double-where: keep NaN out of every statistic (and out of gradients).
    r_GxN = jnp.where(finite_G[:, None], r_GxN, 0.0)
    mean_G = jnp.mean(r_GxN, axis=1)
    # Exact equality, not std < tol: rounding in the mean must not turn an
    # all-equal group into +-1e-2 advantages after dividing by eps.
    equal_G = jnp.all(r_GxN == r_GxN[:, :1], axis=1)

    if baseline == "group_mean":
        centered = r_GxN - mean_G[:, None]
    elif baseline == "leave_one_out":
        others = (jnp.sum(r_GxN, axis=1, keepdims=True) - r_GxN) / (n - 1)
        centered = r_GxN - others
    else:
        centered = r_GxN

    if scale == "none":
        adv = centered
    elif scale == "group_std":
        var_G = jnp.sum(jnp.square(r_GxN - mean_G[:, None]), axis=1) / (n - ddof)
        adv = centered / (jnp.sqrt(var_G)[:, None] + eps)
    elif scale == "batch_std":
        w = finite_G[:, None].astype(jnp.float32) * jnp.ones_like(r_GxN)
        count = jnp.sum(w)
        mu = jnp.sum(r_GxN * w) / jnp.maximum(count, 1.0)
        var = jnp.sum(jnp.square(r_GxN - mu) * w) / jnp.maximum(count - ddof, 1.0)
        adv = centered / (jnp.sqrt(var) + eps)
    else:  # group_mean (MaxRL)
        pos_G = mean_G > 0
        safe = jnp.where(pos_G, mean_G, 1.0)
        adv = jnp.where(pos_G[:, None], centered / safe[:, None], 0.0)

    if baseline != "none":
        adv = jnp.where(equal_G[:, None], 0.0, adv)
    adv = jnp.where(finite_G[:, None], adv, 0.0)
    return AdvantageOutput(
        advantages_B=adv.reshape(b),
        zero_std_groups=jnp.sum(equal_G & finite_G).astype(jnp.int32),
        invalid_groups=jnp.sum(~finite_G).astype(jnp.int32),
    )


def broadcast_to_tokens(values_B: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Row values on every completion token of the row, 0 elsewhere."""
    return values_B[:, None] * mask_BxT.astype(jnp.float32)


def outcome_token_rewards(rewards_B: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Places each row's scalar reward on its last completion token."""
    _checks.check_rank("mask_BxT", mask_BxT, 2)
    mask = mask_BxT > 0
    t = mask.shape[1]
    idx_T = jnp.arange(t)
    last_B = jnp.max(jnp.where(mask, idx_T[None, :], -1), axis=1)
    hit_BxT = (idx_T[None, :] == last_B[:, None]) & mask
    return jnp.where(hit_BxT, jnp.asarray(rewards_B, jnp.float32)[:, None], 0.0)


class GAEOutput(NamedTuple):
    """advantages_BxT and returns_BxT (`A + V`), both 0 where mask is 0."""

    advantages_BxT: jax.Array
    returns_BxT: jax.Array


def gae(
    rewards_BxT: jax.Array,
    values_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> GAEOutput:
    """Generalised advantage estimation over completion tokens only.

    `delta_t = r_t + gamma V_next - V_t`, `A_t = delta_t + gamma lam A_next`,
    where "next" is the next position with mask 1: masked positions (prompt,
    padding, environment tokens between turns) carry `V_next` and `A_next`
    through unchanged. After the last completion token the episode ends
    (`V_next = A_next = 0`).
    """
    _checks.check_rank("rewards_BxT", rewards_BxT, 2)
    _checks.check_same_shape(
        rewards_BxT=rewards_BxT, values_BxT=values_BxT, mask_BxT=mask_BxT)
    m_TxB = (mask_BxT > 0).T
    r_TxB = jnp.where(m_TxB, jnp.asarray(rewards_BxT, jnp.float32).T, 0.0)
    v_TxB = jnp.where(m_TxB, jnp.asarray(values_BxT, jnp.float32).T, 0.0)

    def step(carry, inputs):
        next_v, next_a = carry
        r, v, m = inputs
        a = r + gamma * next_v - v + gamma * lam * next_a
        carry = (jnp.where(m, v, next_v), jnp.where(m, a, next_a))
        return carry, jnp.where(m, a, 0.0)

    zeros_B = jnp.zeros(m_TxB.shape[1], jnp.float32)
    _, a_TxB = jax.lax.scan(step, (zeros_B, zeros_B), (r_TxB, v_TxB, m_TxB),
                            reverse=True)
    adv = a_TxB.T
    returns = jnp.where(mask_BxT > 0, adv + v_TxB.T, 0.0)
    return GAEOutput(adv, returns)


def whiten(x_BxT: jax.Array, mask_BxT: jax.Array, eps: float = 1e-8) -> jax.Array:
    """`(x - mean) / (std + eps)` over the masked tokens of the batch."""
    m = (mask_BxT > 0).astype(jnp.float32)
    count = jnp.maximum(jnp.sum(m), 1.0)
    mean = jnp.sum(x_BxT * m) / count
    var = jnp.sum(jnp.square(x_BxT - mean) * m) / count
    return jnp.where(m > 0, (x_BxT - mean) / (jnp.sqrt(var) + eps), 0.0)
