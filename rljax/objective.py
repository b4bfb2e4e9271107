"""Composes the five axes from a config into one batch loss.

Two halves, matching where they run:
- `rl_streams` (host side or a jitted pre-pass over the whole optimizer-step
  batch): rewards -> advantages (axis 1, with KL-in-reward, axis 5) and the
  normalizer coefficients (axis 2).
- `policy_loss` (inside the jitted step, per micro-batch): the trust region
  (axis 3), behavior correction (axis 4), KL-in-loss (axis 5) and the `ce` and
  `ref_kl` components, summed with their coefficients. It never reads a recipe
  name, only the config's axis settings and the batch's data.
"""

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import ml_collections

from rljax import _checks
from rljax import advantages as adv_lib
from rljax import kl as kl_lib
from rljax import normalizers
from rljax import offpolicy
from rljax import surrogates
from rljax.batch import TrainBatch


class RLStreams(NamedTuple):
    """advantages_BxT and coef_BxT for the `rl` component.

    returns_BxT: GAE value targets (None for outcome estimators).
    metrics: advantage statistics and group counts.
    mask_BxT: the loss mask after skipping rows with non-finite rewards.
    """

    advantages_BxT: jax.Array
    coef_BxT: jax.Array
    returns_BxT: Optional[jax.Array]
    metrics: dict
    mask_BxT: jax.Array


def _trust_region_params(config) -> dict:
    return {k: config.loss[k] for k in surrogates.DEFAULTS}


def row_advantages(config, rewards_B, *, group_size: int):
    """Axis 1 for outcome estimators: `AdvantageOutput` from row rewards."""
    a = config.advantage
    if a.estimator != "group":
        raise ValueError(
            f"advantage.estimator={a.estimator!r} gives per-token advantages from "
            "a critic; use rl_streams(..., values_BxT=...) instead")
    return adv_lib.group_advantages(
        rewards_B, group_size=group_size, baseline=a.baseline, scale=a.scale,
        ddof=a.ddof, eps=a.eps)


def rl_streams(
    config,
    rewards_B: jax.Array,
    mask_BxT: jax.Array,
    *,
    group_size: Optional[int] = None,
    max_tokens: Optional[int] = None,
    old_logp_BxT: Optional[jax.Array] = None,
    ref_logp_BxT: Optional[jax.Array] = None,
    values_BxT: Optional[jax.Array] = None,
    token_rewards_BxT: Optional[jax.Array] = None,
) -> RLStreams:
    """Advantages and coefficients of the whole optimizer-step batch.

    KL in the reward (placement `reward`) uses the sampling policy's log-probs
    `old_logp_BxT` against `ref_logp_BxT`. GAE needs `values_BxT`; the outcome
    reward sits on the row's last completion token unless `token_rewards_BxT`
    gives per-turn rewards (multi-turn rows; `rewards_B` is then their sum).
    """
    _checks.check_rank("rewards_B", rewards_B, 1)
    _checks.check_rank("mask_BxT", mask_BxT, 2)
    if rewards_B.shape[0] != mask_BxT.shape[0]:
        raise ValueError(f"rewards_B has {rewards_B.shape[0]} rows but mask_BxT "
                         f"has shape {mask_BxT.shape}")
    _checks.check_same_shape(mask_BxT=mask_BxT, old_logp_BxT=old_logp_BxT,
                             ref_logp_BxT=ref_logp_BxT, values_BxT=values_BxT)
    group_size = config.group_size if group_size is None else group_size
    max_tokens = config.max_tokens if max_tokens is None else max_tokens
    mask = (jnp.asarray(mask_BxT) > 0).astype(jnp.float32)
    rewards = jnp.asarray(rewards_B, jnp.float32)
    kl_cfg = config.kl
    kl_in_reward = kl_cfg.placement == "reward"
    if kl_in_reward and (old_logp_BxT is None or ref_logp_BxT is None):
        raise ValueError("kl.placement='reward' needs old_logp_BxT and ref_logp_BxT")
    metrics = {}

    if config.advantage.estimator == "gae":
        if values_BxT is None:
            raise ValueError("advantage.estimator='gae' needs values_BxT from the critic")
        finite_B = jnp.isfinite(rewards)
        # A row with a non-finite reward is skipped and counted, never NaN; it
        # leaves the mask first so it cannot move the whitening statistics.
        mask = jnp.where(finite_B[:, None], mask, 0.0)
        if token_rewards_BxT is not None:
            token_r = jnp.where(mask > 0, jnp.nan_to_num(jnp.asarray(token_rewards_BxT,
                                                                     jnp.float32)), 0.0)
        else:
            token_r = adv_lib.outcome_token_rewards(jnp.where(finite_B, rewards, 0.0), mask)
        if kl_in_reward:
            token_r = kl_lib.kl_penalized_token_rewards(
                token_r, old_logp_BxT, ref_logp_BxT, mask, beta=kl_cfg.beta,
                estimator=kl_cfg.estimator)
        out = adv_lib.gae(token_r, values_BxT, mask, gamma=config.advantage.gamma,
                          lam=config.advantage.lam)
        adv_BxT, returns = out.advantages_BxT, out.returns_BxT
        if config.advantage.whiten:
            adv_BxT = adv_lib.whiten(adv_BxT, mask)
        adv_BxT = jnp.where(finite_B[:, None], adv_BxT, 0.0)
        metrics["invalid_rows"] = jnp.sum(~finite_B).astype(jnp.int32)
    else:
        if kl_in_reward:
            rewards = kl_lib.kl_penalized_rewards(
                rewards, old_logp_BxT, ref_logp_BxT, mask, beta=kl_cfg.beta,
                estimator=kl_cfg.estimator)
        out = row_advantages(config, rewards, group_size=group_size)
        adv_BxT = adv_lib.broadcast_to_tokens(out.advantages_B, mask)
        returns = None
        num_groups = rewards.shape[0] // group_size
        metrics["zero_std_groups"] = out.zero_std_groups
        metrics["frac_zero_std_groups"] = out.zero_std_groups / max(num_groups, 1)
        metrics["invalid_groups"] = out.invalid_groups
        # Rows of a skipped group leave the loss entirely (and its denominator).
        finite_G = jnp.all(jnp.isfinite(rewards.reshape(num_groups, group_size)), 1)
        mask = mask * jnp.repeat(finite_G, group_size)[:, None]

    coef = normalizers.coefficients(mask, mode=config.loss.norm, group_size=group_size,
                                    max_tokens=max_tokens)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    metrics["adv_mean"] = jnp.sum(adv_BxT * mask) / count
    metrics["adv_abs_mean"] = jnp.sum(jnp.abs(adv_BxT) * mask) / count
    return RLStreams(adv_BxT, coef, returns, metrics, mask)


def policy_loss(config, logp_BxT: jax.Array, batch: TrainBatch):
    """`sum c l` over the `rl`, `ce` and `ref_kl` components; returns (loss, metrics).

    rl:     trust-region terms (against `old_logp`, else the behavior log-probs),
            times the behavior correction `sg(pi_old / mu)`, plus `beta kl` when
            `kl.placement == 'loss'`, weighted by `batch.coef`.
    ce:     `-logp` weighted by `batch.ce_coef` (SFT, echo).
    ref_kl: on-policy distillation; the per-token signal `sg(teacher - logp)`
            is the advantage, weighted by `batch.ref_kl_coef`. Its value is the
            k1 estimate of KL(pi || teacher).

    For exact gradient accumulation the coefficients must come from the whole
    optimizer-step batch; summing this loss over micro-batches then equals the
    full-batch loss.
    """
    _checks.check_rank("logp_BxT", logp_BxT, 2)
    if tuple(logp_BxT.shape) != tuple(batch.tokens.shape):
        raise ValueError(f"logp_BxT has shape {logp_BxT.shape} but the batch's "
                         f"tokens have {batch.tokens.shape}")
    batch.validate()
    mask = batch.loss_mask > 0
    logp = logp_BxT.astype(jnp.float32)
    old = batch.old_logp if batch.old_logp is not None else batch.behavior_logp

    sur = surrogates.surrogate_terms(config.loss.type, logp, old, batch.advantages,
                                     mask, **_trust_region_params(config))
    terms = sur.terms_BxT
    metrics = dict(sur.metrics)

    o = config.offpolicy
    if o.level != "none" and batch.old_logp is not None:
        bw = offpolicy.behavior_weights(batch.old_logp, batch.behavior_logp, mask,
                                        level=o.level, mode=o.mode, cap=o.cap,
                                        low=o.low, high=o.high)
        terms = terms * bw.weights_BxT
        metrics.update(bw.metrics)
    metrics.update(offpolicy.mismatch_metrics(logp, batch.behavior_logp, mask))

    if config.kl.placement == "loss":
        if batch.ref_logp is None:
            raise ValueError("kl.placement='loss' needs batch.ref_logp")
        ref = jnp.where(mask, batch.ref_logp, 0.0)
        kl_bt = jnp.where(mask, kl_lib.kl_estimate(config.kl.estimator,
                                                   jnp.where(mask, logp, 0.0), ref), 0.0)
        terms = terms + config.kl.beta * kl_bt
        metrics["kl"] = jnp.sum(jax.lax.stop_gradient(kl_bt) * batch.coef)
    rl_loss = jnp.sum(jnp.where(mask, batch.coef * terms, 0.0))
    loss = rl_loss
    metrics["loss_rl"] = rl_loss

    if batch.ce_coef is not None:
        ce_on = batch.ce_coef != 0
        ce_loss = -jnp.sum(jnp.where(ce_on, batch.ce_coef * jnp.where(ce_on, logp, 0.0), 0.0))
        loss = loss + ce_loss
        metrics["loss_ce"] = ce_loss

    if batch.ref_kl_coef is not None:
        teacher = batch.teacher_logp if batch.teacher_logp is not None else batch.ref_logp
        if teacher is None:
            raise ValueError("batch.ref_kl_coef needs batch.teacher_logp (or ref_logp)")
        on = batch.ref_kl_coef != 0
        lp = jnp.where(on, logp, 0.0)
        gap = jax.lax.stop_gradient(lp - jnp.where(on, teacher, 0.0))
        # Value k1 = logp - teacher; gradient (logp - teacher) grad logp.
        term = gap * (1.0 + lp - jax.lax.stop_gradient(lp))
        kl_loss = jnp.sum(jnp.where(on, batch.ref_kl_coef * term, 0.0))
        loss = loss + kl_loss
        metrics["loss_ref_kl"] = kl_loss

    metrics["loss"] = loss
    metrics["num_tokens"] = jnp.sum(mask).astype(jnp.float32)
    return loss, metrics


@functools.lru_cache(maxsize=64)
def _weights_fn(frozen_config):
    def neg_grad(logp, batch):
        return -jax.grad(lambda lp: policy_loss(frozen_config, lp, batch)[0])(logp)
    return jax.jit(neg_grad)


def _freeze(config):
    return ml_collections.FrozenConfigDict(config)


def token_weights(
    config,
    rewards,
    mask,
    *,
    group_size: int,
    max_tokens: Optional[int] = None,
    logp=None,
    old_logp=None,
    ref_logp=None,
    behavior_logp=None,
    values=None,
) -> jax.Array:
    """`w[b, t] = -d loss / d logp[b, t]` for the recipe's full batch loss.

    With `logp`/`old_logp` omitted it is evaluated on-policy (all log-probs
    equal, zero). Off-policy: `old_logp` defaults to `logp`, `ref_logp` to
    `old_logp`, `behavior_logp` to `old_logp` (so the behavior correction is
    1 unless given). `values` feeds GAE (zeros when omitted).
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    mask = jnp.asarray(mask, jnp.float32)
    _checks.check_rank("rewards", rewards, 1)
    _checks.check_rank("mask", mask, 2)
    _checks.check_finite("rewards", rewards)
    zeros = jnp.zeros(mask.shape, jnp.float32)
    logp = zeros if logp is None else jnp.asarray(logp, jnp.float32)
    old_logp = logp if old_logp is None else jnp.asarray(old_logp, jnp.float32)
    ref_logp = old_logp if ref_logp is None else jnp.asarray(ref_logp, jnp.float32)
    behavior = old_logp if behavior_logp is None else jnp.asarray(behavior_logp,
                                                                  jnp.float32)
    _checks.check_same_shape(mask=mask, logp=logp, old_logp=old_logp,
                             ref_logp=ref_logp, behavior_logp=behavior)
    if values is None and config.advantage.estimator == "gae":
        values = zeros
    streams = rl_streams(config, rewards, mask, group_size=group_size,
                         max_tokens=max_tokens, old_logp_BxT=old_logp,
                         ref_logp_BxT=ref_logp, values_BxT=values)
    batch = TrainBatch(
        tokens=jnp.zeros(mask.shape, jnp.int32),
        positions=jnp.zeros(mask.shape, jnp.int32),
        loss_mask=mask, behavior_logp=behavior,
        advantages=streams.advantages_BxT, coef=streams.coef_BxT,
        old_logp=old_logp if config.offpolicy.recompute_old_logp else None,
        ref_logp=ref_logp)
    return _weights_fn(_freeze(config))(logp, batch)


def compute_advantages(config, rewards, *, group_size: int) -> jax.Array:
    """Row advantages `[B]` of an outcome estimator (raises on NaN rewards)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    _checks.check_finite("rewards", rewards)
    return row_advantages(config, rewards, group_size=group_size).advantages_B
