"""Axis 5: KL to a reference policy, its estimators and where it enters.

With `x = ref_logp - logp` on tokens sampled from the policy (Schulman's
"Approximating KL divergence"): `k1 = -x`, `k2 = x^2 / 2`,
`k3 = exp(x) - x - 1` (with `x` clamped to +-20, as every log-ratio here, so
it cannot overflow); `low_var_kl` is k3 with the result also clamped to
[-10, 10] (verl). Placement `loss` adds `beta * kl` to every token's
term (GRPO: k3, beta 0.04); placement `reward` subtracts `beta * k1` from the
reward (PPO/RLOO: beta 0.05), summed over the row for outcome rewards or per
token for GAE.
"""

import jax
import jax.numpy as jnp

from rljax import _checks

ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
PLACEMENTS = ("none", "loss", "reward")


def kl_estimate(kind: str, logp_BxT: jax.Array, ref_logp_BxT: jax.Array) -> jax.Array:
    """Per-token KL(pi || ref) estimate of kind `k1 | k2 | k3 | low_var_kl`."""
    _checks.check_choice("kl.estimator", kind, ESTIMATORS)
    _checks.check_same_shape(logp_BxT=logp_BxT, ref_logp_BxT=ref_logp_BxT)
    x = jnp.asarray(ref_logp_BxT, jnp.float32) - jnp.asarray(logp_BxT, jnp.float32)
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * jnp.square(x)
    # k3 exponentiates: clamp x to +-20 like every log-ratio in rljax, or a
    # reference 89 nats above the policy overflows float32 into an inf weight.
    x = jnp.clip(x, -20.0, 20.0)
    if kind == "k3":
        return jnp.expm1(x) - x
    return jnp.clip(jnp.expm1(x) - x, -10.0, 10.0)


def kl_penalized_rewards(
    rewards_B: jax.Array, logp_BxT: jax.Array, ref_logp_BxT: jax.Array,
    mask_BxT: jax.Array, *, beta: float, estimator: str = "k1",
) -> jax.Array:
    """Outcome reward shaping `r_b - beta sum_t kl[b, t]` (no gradient)."""
    m = jnp.asarray(mask_BxT) > 0
    kl = jnp.where(m, kl_estimate(estimator, jax.lax.stop_gradient(logp_BxT),
                                  ref_logp_BxT), 0.0)
    return jnp.asarray(rewards_B, jnp.float32) - beta * jnp.sum(kl, axis=1)


def kl_penalized_token_rewards(
    token_rewards_BxT: jax.Array, logp_BxT: jax.Array, ref_logp_BxT: jax.Array,
    mask_BxT: jax.Array, *, beta: float, estimator: str = "k1",
) -> jax.Array:
    """Per-token shaping for GAE: `r_t - beta kl_t` on completion tokens."""
    m = jnp.asarray(mask_BxT) > 0
    kl = kl_estimate(estimator, jax.lax.stop_gradient(logp_BxT), ref_logp_BxT)
    return jnp.where(m, token_rewards_BxT - beta * kl, 0.0)
