"""Composes the five axes into one batch loss, along the trainer's data flow.

    Rollout + Logprobs --token_streams--> Streams     (whole rollout, host side)
    Streams + rows     --train_batch-->   TrainBatch  (one optimizer step)
    logp + TrainBatch  --policy_loss-->   loss        (inside the jitted step)

`token_streams` runs axis 1 (advantages, per source), axis 4's row filters
and axis 5's KL in the reward, and lays out the `rl`, `ce` and `ref_kl`
streams; `train_batch` computes each component's axis-2 coefficients over
the optimizer-step rows, once; `policy_loss` applies axis 3 (trust region),
axis 4 (behavior correction) and axis 5 (KL in the loss) and sums the
components with their coefficients. The trainer (rljax.train.loop) and the
inspection API (`token_weights`, `rollout_token_weights`) call exactly these
three functions, so what a notebook shows is what the trainer applies.

Nothing here reads a recipe or algorithm name. A config is resolved once
into an `Objective`: one `SourceSpec` per source (its loss component, its
`Estimator`, its weights) and the `LossConfig` the jitted loss reads
(docs/algorithms.md §9-§10).
"""

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from rljax import _checks
from rljax import advantages as adv_lib
from rljax import kl as kl_lib
from rljax import normalizers
from rljax import offpolicy
from rljax import surrogates
from rljax.batch import Rollout
from rljax.batch import TrainBatch

COMPONENTS = ("rl", "ce", "ref_kl")


@dataclasses.dataclass(frozen=True)
class Estimator:
    """Axis 1 of an `rl` stream, and KL placed in the reward (axis 5).

    kind: `group` (outcome advantages over groups) or `gae` (critic values).
    kl_beta > 0 subtracts `beta * KL` from the reward (docs/algorithms.md §6).
    """

    kind: str = "group"
    baseline: str = "group_mean"
    scale: str = "group_std"
    ddof: int = 0
    eps: float = 1e-6
    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = False
    kl_beta: float = 0.0
    kl_estimator: str = "k1"

    @classmethod
    def from_config(cls, config, *, baseline: Optional[str] = None,
                    scale: Optional[str] = None) -> "Estimator":
        """The config's `advantage` and `kl` sections, `baseline`/`scale` swapped."""
        a, k = config.advantage, config.kl
        return cls(kind=a.estimator, baseline=baseline or a.baseline, scale=scale or a.scale,
                   ddof=a.ddof, eps=a.eps, gamma=a.gamma, lam=a.lam, whiten=a.whiten,
                   kl_beta=k.beta if k.placement == "reward" else 0.0,
                   kl_estimator=k.estimator)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """All that `policy_loss` reads: trust region, behavior correction, KL in the loss.

    trust_region: (name, value) pairs over `surrogates.DEFAULTS`.
    correction*: axis 4's `sg(pi_old / mu)` (level `none` turns it off).
    kl_beta > 0 adds `beta * kl_estimator` to every `rl` token's term.
    """

    type: str = "clip"
    trust_region: tuple = ()
    correction: str = "none"
    correction_mode: str = "truncate"
    correction_cap: float = 2.0
    correction_low: float = 0.5
    correction_high: float = 2.0
    kl_beta: float = 0.0
    kl_estimator: str = "k3"

    @classmethod
    def from_config(cls, config) -> "LossConfig":
        l, o, k = config.loss, config.offpolicy, config.kl
        return cls(type=l.type, trust_region=tuple((n, l[n]) for n in surrogates.DEFAULTS),
                   correction=o.level, correction_mode=o.mode, correction_cap=o.cap,
                   correction_low=o.low, correction_high=o.high,
                   kl_beta=k.beta if k.placement == "loss" else 0.0, kl_estimator=k.estimator)


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """How one source's rows enter the loss: a component and its weights.

    component: `rl` (advantages from `estimator` through the trust region),
      `ce` (cross-entropy on the row's completion tokens, times `weight`), or
      `ref_kl` (distillation toward the row's teacher log-probs, times `weight`).
    env_weight: `ce` weight on a multi-turn row's environment tokens (echo).
    """

    name: str = "main"
    component: str = "rl"
    estimator: Optional[Estimator] = None
    weight: float = 1.0
    env_weight: float = 0.0

    def __post_init__(self):
        _checks.check_choice(f"source {self.name!r} component", self.component, COMPONENTS)
        if self.component == "rl" and self.estimator is None:
            raise ValueError(f"source {self.name!r}: an rl component needs an Estimator")
        if self.weight < 0 or self.env_weight < 0:
            raise ValueError(f"source {self.name!r}: weights must be >= 0")


@dataclasses.dataclass(frozen=True)
class Objective:
    """A config resolved for the composition (hashable; no recipe names left)."""

    sources: tuple
    loss: LossConfig
    group_size: int
    norm: str
    max_tokens: int
    recompute_old_logp: bool = False
    max_staleness: int = 1
    mask_truncated: bool = False

    @classmethod
    def from_config(cls, config, *, sources: Optional[tuple] = None,
                    group_size: Optional[int] = None,
                    max_tokens: Optional[int] = None) -> "Objective":
        """`sources` default: one `rl` source with the recipe's own estimator."""
        if sources is None:
            echo = config.env.echo_weight if "env" in config else 0.0
            sources = (SourceSpec("main", "rl", Estimator.from_config(config), env_weight=echo),)
        o = config.offpolicy
        return cls(sources=tuple(sources), loss=LossConfig.from_config(config),
                   group_size=config.group_size if group_size is None else group_size,
                   norm=config.loss.norm,
                   max_tokens=config.max_tokens if max_tokens is None else max_tokens,
                   recompute_old_logp=o.recompute_old_logp, max_staleness=o.max_staleness,
                   mask_truncated=o.mask_truncated)

    @property
    def _estimators(self):
        return [s.estimator for s in self.sources if s.component == "rl"]

    @property
    def needs_ref_logp(self) -> bool:
        return self.loss.kl_beta > 0 or any(e.kl_beta > 0 for e in self._estimators)

    @property
    def needs_values(self) -> bool:
        return any(e.kind == "gae" for e in self._estimators)


class Logprobs(NamedTuple):
    """Model outputs on a rollout's grid, computed once at the start of its steps.

    old_logp_BxT: the trainer's pi_old (`recompute_old_logp`); None: pi_old := mu.
    ref_logp_BxT: the frozen reference (KL). teacher_logp_BxT: each `ref_kl`
    row's teacher. values_BxT: the critic's values (GAE).
    """

    old_logp_BxT: Optional[jax.Array] = None
    ref_logp_BxT: Optional[jax.Array] = None
    teacher_logp_BxT: Optional[jax.Array] = None
    values_BxT: Optional[jax.Array] = None


class Streams(NamedTuple):
    """Per-token streams of a whole rollout: what each component trains on.

    rl_mask_BxT: 1 on tokens of the `rl` component (after row filters).
    advantages_BxT: their advantages. ce_weights_BxT / ref_kl_weights_BxT: the
    other components' token weights (None when no row has one). returns_BxT:
    GAE value targets. metrics: advantage statistics and row counts.
    """

    tokens_BxT: jax.Array
    positions_BxT: jax.Array
    behavior_logp_BxT: jax.Array
    rl_mask_BxT: jax.Array
    advantages_BxT: jax.Array
    ce_weights_BxT: Optional[jax.Array]
    ref_kl_weights_BxT: Optional[jax.Array]
    old_logp_BxT: Optional[jax.Array]
    ref_logp_BxT: Optional[jax.Array]
    teacher_logp_BxT: Optional[jax.Array]
    values_BxT: Optional[jax.Array]
    returns_BxT: Optional[jax.Array]
    routing_BxTxLxK: Optional[jax.Array]
    metrics: dict


class RLStreams(NamedTuple):
    """One source's `rl` stream: advantages_BxT, returns_BxT (GAE, else None),
    mask_BxT (rows with non-finite rewards removed) and advantage metrics."""

    advantages_BxT: jax.Array
    returns_BxT: Optional[jax.Array]
    mask_BxT: jax.Array
    metrics: dict


def row_advantages(estimator: Estimator, rewards_B, *, group_size: int):
    """Axis 1 for outcome estimators: `AdvantageOutput` from row rewards."""
    if estimator.kind != "group":
        raise ValueError(f"advantage.estimator={estimator.kind!r} gives per-token advantages "
                         "from a critic; use rl_streams(..., values_BxT=...) instead")
    return adv_lib.group_advantages(
        rewards_B, group_size=group_size, baseline=estimator.baseline, scale=estimator.scale,
        ddof=estimator.ddof, eps=estimator.eps)


def rl_streams(
    estimator: Estimator,
    rewards_B: jax.Array,
    mask_BxT: jax.Array,
    *,
    group_size: int,
    old_logp_BxT: Optional[jax.Array] = None,
    ref_logp_BxT: Optional[jax.Array] = None,
    values_BxT: Optional[jax.Array] = None,
    token_rewards_BxT: Optional[jax.Array] = None,
) -> RLStreams:
    """Advantages of one source's group rows (docs/algorithms.md §2, §6).

    KL in the reward uses the sampling policy's log-probs `old_logp_BxT`
    against `ref_logp_BxT`. GAE needs `values_BxT`; the outcome reward sits on
    the row's last completion token unless `token_rewards_BxT` gives per-turn
    rewards (multi-turn rows; `rewards_B` is then their sum).
    """
    _checks.check_rank("rewards_B", rewards_B, 1)
    _checks.check_rank("mask_BxT", mask_BxT, 2)
    if rewards_B.shape[0] != mask_BxT.shape[0]:
        raise ValueError(f"rewards_B has {rewards_B.shape[0]} rows but mask_BxT "
                         f"has shape {mask_BxT.shape}")
    _checks.check_same_shape(mask_BxT=mask_BxT, old_logp_BxT=old_logp_BxT,
                             ref_logp_BxT=ref_logp_BxT, values_BxT=values_BxT)
    mask = (jnp.asarray(mask_BxT) > 0).astype(jnp.float32)
    rewards = jnp.asarray(rewards_B, jnp.float32)
    kl_in_reward = estimator.kl_beta > 0
    if kl_in_reward and (old_logp_BxT is None or ref_logp_BxT is None):
        raise ValueError("kl.placement='reward' needs old_logp_BxT and ref_logp_BxT")
    metrics = {}

    if estimator.kind == "gae":
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
                token_r, old_logp_BxT, ref_logp_BxT, mask, beta=estimator.kl_beta,
                estimator=estimator.kl_estimator)
        out = adv_lib.gae(token_r, values_BxT, mask, gamma=estimator.gamma, lam=estimator.lam)
        adv_BxT, returns = out.advantages_BxT, out.returns_BxT
        if estimator.whiten:
            adv_BxT = adv_lib.whiten(adv_BxT, mask)
        adv_BxT = jnp.where(finite_B[:, None], adv_BxT, 0.0)
        metrics["invalid_rows"] = jnp.sum(~finite_B).astype(jnp.int32)
    else:
        if kl_in_reward:
            rewards = kl_lib.kl_penalized_rewards(
                rewards, old_logp_BxT, ref_logp_BxT, mask, beta=estimator.kl_beta,
                estimator=estimator.kl_estimator)
        out = row_advantages(estimator, rewards, group_size=group_size)
        adv_BxT = adv_lib.broadcast_to_tokens(out.advantages_B, mask)
        returns = None
        num_groups = rewards.shape[0] // group_size
        metrics["zero_std_groups"] = out.zero_std_groups
        metrics["frac_zero_std_groups"] = out.zero_std_groups / max(num_groups, 1)
        metrics["invalid_groups"] = out.invalid_groups
        # Rows of a skipped group leave the loss entirely (and its denominator).
        finite_G = jnp.all(jnp.isfinite(rewards.reshape(num_groups, group_size)), 1)
        mask = mask * jnp.repeat(finite_G, group_size)[:, None]

    count = jnp.maximum(jnp.sum(mask), 1.0)
    metrics["adv_mean"] = jnp.sum(adv_BxT * mask) / count
    metrics["adv_abs_mean"] = jnp.sum(jnp.abs(adv_BxT) * mask) / count
    return RLStreams(adv_BxT, returns, mask, metrics)


def _per_row(sources, source_B, value_of, dtype=np.float32) -> np.ndarray:
    """A per-source quantity looked up for every row."""
    return np.asarray([value_of(s) for s in sources], dtype)[np.asarray(source_B)]


def token_streams(objective: Objective, rollout: Rollout, logprobs: Logprobs = Logprobs(),
                  *, version: Optional[int] = None) -> Streams:
    """Per-token streams of a whole rollout (docs/algorithms.md §10).

    Row filters first (inactive rows; rows sampled more than `max_staleness`
    versions before `version`, when given; truncated rows if asked), then each
    `rl` source's advantages over its own groups, continuation rows sharing
    their episode's outcome advantage, and the `ce` and `ref_kl` weights.
    """
    rollout.validate(objective.group_size, len(objective.sources))
    sources, n = objective.sources, objective.group_size
    b = rollout.shape[0]
    mask = rollout.loss_mask_BxT * np.asarray(rollout.active_B)[:, None]
    fresh = (np.ones(b, bool) if version is None else
             offpolicy.staleness_keep(rollout.version_B, version, objective.max_staleness))
    keep = fresh & offpolicy.truncation_keep(rollout.truncated_B, objective.mask_truncated)
    mask, _ = offpolicy.apply_row_filter(jnp.asarray(mask), keep)
    behavior = jnp.asarray(rollout.behavior_logp_BxT)
    component_B = np.asarray([s.component for s in sources])[np.asarray(rollout.source_B)]
    rl_mask = mask * jnp.asarray(component_B == "rl", jnp.float32)[:, None]
    adv = jnp.zeros(mask.shape, jnp.float32)
    returns = None
    metrics = {}
    episode_B = np.asarray(rollout.episode_B)
    group_row_B = episode_B == np.arange(b)
    token_rewards = (None if rollout.token_rewards_BxT is None
                     else jnp.asarray(rollout.token_rewards_BxT))
    rewards = jnp.asarray(rollout.rewards_B, jnp.float32)
    pi_old = logprobs.old_logp_BxT if logprobs.old_logp_BxT is not None else behavior
    pick = lambda x, rows: None if x is None else x[rows]  # noqa: E731
    for si, spec in enumerate(sources):
        rows = np.nonzero(group_row_B & (np.asarray(rollout.source_B) == si))[0]
        if spec.component != "rl" or rows.size == 0:
            continue
        rl = rl_streams(spec.estimator, rewards[rows], rl_mask[rows], group_size=n,
                        old_logp_BxT=pi_old[rows],
                        ref_logp_BxT=pick(logprobs.ref_logp_BxT, rows),
                        values_BxT=pick(logprobs.values_BxT, rows),
                        token_rewards_BxT=pick(token_rewards, rows))
        adv = adv.at[rows].set(rl.advantages_BxT)
        rl_mask = rl_mask.at[rows].set(rl.mask_BxT)
        if rl.returns_BxT is not None:
            returns = jnp.zeros(mask.shape, jnp.float32).at[rows].set(rl.returns_BxT)
        prefix = "" if len(sources) == 1 else f"{spec.name}/"
        metrics.update({prefix + k: v for k, v in rl.metrics.items()})
    continuation = np.nonzero(~group_row_B)[0]
    if continuation.size:
        # Rows closed by a multi-turn prefix break share their episode's
        # outcome advantage; a critic's GAE cannot bridge the break, so those
        # rows are dropped (counted).
        episode = np.maximum(episode_B[continuation], 0)
        row_adv_B = jnp.sum(adv, axis=1) / jnp.maximum(jnp.sum(rl_mask, axis=1), 1.0)
        gae_B = _per_row(sources, rollout.source_B[continuation], lambda s: (
            s.component == "rl" and s.estimator.kind == "gae"), bool)
        extra_mask = rl_mask[continuation] * jnp.asarray(~gae_B, jnp.float32)[:, None]
        if objective.needs_values:
            metrics["dropped_overflow_rows"] = int(np.sum(gae_B & (episode_B[continuation] >= 0)))
        rl_mask = rl_mask.at[continuation].set(extra_mask)
        adv = adv.at[continuation].set(row_adv_B[episode][:, None] * extra_mask)
    ce_w = ref_kl_w = None
    if (component_B == "ce").any():
        w_B = _per_row(sources, rollout.source_B, lambda s: s.weight * (s.component == "ce"))
        ce_w = mask * jnp.asarray(w_B)[:, None]
    env_w_B = _per_row(sources, rollout.source_B, lambda s: s.env_weight)
    if rollout.env_mask_BxT is not None and env_w_B.any():
        # echo: cross-entropy on the environment's tokens after the first reply.
        live_B = jnp.asarray(np.asarray(rollout.active_B) & keep, jnp.float32)
        env_w = (jnp.asarray(rollout.env_mask_BxT) * live_B[:, None]
                 * jnp.asarray(env_w_B)[:, None])
        ce_w = env_w if ce_w is None else ce_w + env_w
    if (component_B == "ref_kl").any():
        if logprobs.teacher_logp_BxT is None:
            raise ValueError("rows of a ref_kl source need Logprobs.teacher_logp_BxT")
        w_B = _per_row(sources, rollout.source_B,
                       lambda s: s.weight * (s.component == "ref_kl"))
        ref_kl_w = mask * jnp.asarray(w_B)[:, None]
    metrics.update({"dropped_rows": int(np.sum(~keep)), "stale_rows": int(np.sum(~fresh))})
    routing = rollout.routing_BxTxLxK
    return Streams(
        tokens_BxT=jnp.asarray(rollout.tokens_BxT),
        positions_BxT=jnp.asarray(rollout.positions_BxT),
        behavior_logp_BxT=behavior, rl_mask_BxT=rl_mask, advantages_BxT=adv,
        ce_weights_BxT=ce_w, ref_kl_weights_BxT=ref_kl_w, old_logp_BxT=logprobs.old_logp_BxT,
        ref_logp_BxT=logprobs.ref_logp_BxT,
        teacher_logp_BxT=logprobs.teacher_logp_BxT if ref_kl_w is not None else None,
        values_BxT=logprobs.values_BxT, returns_BxT=returns,
        routing_BxTxLxK=None if routing is None else jnp.asarray(routing), metrics=metrics)


def train_batch(objective: Objective, streams: Streams, rows) -> TrainBatch:
    """The optimizer-step batch of `rows` (whole groups), coefficients included.

    Axis 2 runs here, over these rows and per component, before the step
    splits them into micro-batches or devices: summing the pieces' losses is
    then exactly this batch's loss (docs/algorithms.md §3).
    """
    rows = np.asarray(rows)
    if rows.size % objective.group_size:
        raise ValueError(f"a minibatch of {rows.size} rows is not whole groups of "
                         f"group_size={objective.group_size}")
    norm = dict(mode=objective.norm, group_size=objective.group_size,
                max_tokens=objective.max_tokens)
    pick = lambda x: None if x is None else x[rows]  # noqa: E731
    mask = streams.rl_mask_BxT[rows]
    weighted = lambda w: None if w is None else normalizers.weighted_coefficients(  # noqa: E731
        w[rows], **norm)
    return TrainBatch(
        tokens=streams.tokens_BxT[rows], positions=streams.positions_BxT[rows], loss_mask=mask,
        behavior_logp=streams.behavior_logp_BxT[rows], advantages=streams.advantages_BxT[rows],
        coef=normalizers.coefficients(mask, **norm), old_logp=pick(streams.old_logp_BxT),
        ref_logp=pick(streams.ref_logp_BxT), teacher_logp=pick(streams.teacher_logp_BxT),
        ce_coef=weighted(streams.ce_weights_BxT), ref_kl_coef=weighted(streams.ref_kl_weights_BxT),
        routing=pick(streams.routing_BxTxLxK), returns=pick(streams.returns_BxT),
        old_values=pick(streams.values_BxT))


def policy_loss(loss: LossConfig, logp_BxT: jax.Array, batch: TrainBatch):
    """`sum c l` over the `rl`, `ce` and `ref_kl` components; returns (loss, metrics).

    rl:     trust-region terms (against `old_logp`, else the behavior log-probs),
            times the behavior correction `sg(pi_old / mu)`, plus `beta kl` when
            KL is in the loss, weighted by `batch.coef`.
    ce:     `-logp` weighted by `batch.ce_coef` (sft, echo).
    ref_kl: distillation; the per-token signal `sg(teacher - logp)` is the
            advantage, weighted by `batch.ref_kl_coef`. Its value is the k1
            estimate of KL(pi || teacher).

    For exact gradient accumulation the coefficients must come from the whole
    optimizer-step batch (`train_batch`); summing this loss over micro-batches
    then equals the full-batch loss.
    """
    if not isinstance(loss, LossConfig):
        raise ValueError(f"policy_loss takes a LossConfig (LossConfig.from_config(config)), "
                         f"got {type(loss).__name__}")
    _checks.check_rank("logp_BxT", logp_BxT, 2)
    if tuple(logp_BxT.shape) != tuple(batch.tokens.shape):
        raise ValueError(f"logp_BxT has shape {logp_BxT.shape} but the batch's "
                         f"tokens have {batch.tokens.shape}")
    batch.validate()
    mask = batch.loss_mask > 0
    logp = logp_BxT.astype(jnp.float32)
    old = batch.old_logp if batch.old_logp is not None else batch.behavior_logp

    sur = surrogates.surrogate_terms(loss.type, logp, old, batch.advantages, mask,
                                     **dict(loss.trust_region))
    terms = sur.terms_BxT
    metrics = dict(sur.metrics)

    if loss.correction != "none" and batch.old_logp is not None:
        bw = offpolicy.behavior_weights(batch.old_logp, batch.behavior_logp, mask,
                                        level=loss.correction, mode=loss.correction_mode,
                                        cap=loss.correction_cap, low=loss.correction_low,
                                        high=loss.correction_high)
        terms = terms * bw.weights_BxT
        metrics.update(bw.metrics)
    metrics.update(offpolicy.mismatch_metrics(logp, batch.behavior_logp, mask))

    if loss.kl_beta > 0:
        if batch.ref_logp is None:
            raise ValueError("kl.placement='loss' needs batch.ref_logp")
        ref = jnp.where(mask, batch.ref_logp, 0.0)
        kl_bt = jnp.where(mask, kl_lib.kl_estimate(loss.kl_estimator,
                                                   jnp.where(mask, logp, 0.0), ref), 0.0)
        terms = terms + loss.kl_beta * kl_bt
        metrics["kl"] = jnp.sum(jax.lax.stop_gradient(kl_bt) * batch.coef)
    rl_loss = jnp.sum(jnp.where(mask, batch.coef * terms, 0.0))
    total = rl_loss
    metrics["loss_rl"] = rl_loss

    if batch.ce_coef is not None:
        ce_on = batch.ce_coef != 0
        ce_loss = -jnp.sum(jnp.where(ce_on, batch.ce_coef * jnp.where(ce_on, logp, 0.0), 0.0))
        total = total + ce_loss
        metrics["loss_ce"] = ce_loss

    if batch.ref_kl_coef is not None:
        on = batch.ref_kl_coef != 0
        lp = jnp.where(on, logp, 0.0)
        gap = jax.lax.stop_gradient(lp - jnp.where(on, batch.teacher_logp, 0.0))
        # Value k1 = logp - teacher; gradient (logp - teacher) grad logp.
        term = gap * (1.0 + lp - jax.lax.stop_gradient(lp))
        kl_loss = jnp.sum(jnp.where(on, batch.ref_kl_coef * term, 0.0))
        total = total + kl_loss
        metrics["loss_ref_kl"] = kl_loss

    metrics["loss"] = total
    metrics["num_tokens"] = jnp.sum(mask).astype(jnp.float32)
    return total, metrics


@functools.lru_cache(maxsize=64)
def _weights_fn(loss: LossConfig):
    def neg_grad(logp, batch):
        return -jax.grad(lambda lp: policy_loss(loss, lp, batch)[0])(logp)
    return jax.jit(neg_grad)


def rollout_token_weights(objective: Objective, rollout: Rollout, logp_BxT,
                          logprobs: Logprobs = Logprobs(), *, rows=None,
                          version: Optional[int] = None) -> jax.Array:
    """`w = -d loss / d logp` of the optimizer step on `rows`, exactly as the trainer builds it.

    `logp_BxT` is the current policy's log-probs of the whole rollout; the
    result has one row per entry of `rows` (default: every row, one step).
    """
    streams = token_streams(objective, rollout, logprobs, version=version)
    rows = np.arange(rollout.shape[0]) if rows is None else np.asarray(rows)
    batch = train_batch(objective, streams, rows)
    return _weights_fn(objective.loss)(jnp.asarray(logp_BxT, jnp.float32)[rows], batch)


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

    One source, one optimizer step over every row. With `logp`/`old_logp`
    omitted it is evaluated on-policy (all log-probs equal, zero).
    Off-policy: `old_logp` defaults to `logp`, `ref_logp` to `old_logp`,
    `behavior_logp` to `old_logp` (so the behavior correction is 1 unless
    given). `values` feeds GAE (zeros when omitted).
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    mask = jnp.asarray(mask, jnp.float32)
    _checks.check_rank("rewards", rewards, 1)
    _checks.check_rank("mask", mask, 2)
    _checks.check_finite("rewards", rewards)
    if rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards has {rewards.shape[0]} rows but mask has shape {mask.shape}")
    zeros = jnp.zeros(mask.shape, jnp.float32)
    logp = zeros if logp is None else jnp.asarray(logp, jnp.float32)
    old_logp = logp if old_logp is None else jnp.asarray(old_logp, jnp.float32)
    ref_logp = old_logp if ref_logp is None else jnp.asarray(ref_logp, jnp.float32)
    behavior = old_logp if behavior_logp is None else jnp.asarray(behavior_logp,
                                                                  jnp.float32)
    _checks.check_same_shape(mask=mask, logp=logp, old_logp=old_logp,
                             ref_logp=ref_logp, behavior_logp=behavior)
    objective = Objective.from_config(config, group_size=group_size, max_tokens=max_tokens)
    if values is None and objective.needs_values:
        values = zeros
    rollout = Rollout.from_arrays(rewards, mask, behavior_logp_BxT=behavior)
    logprobs = Logprobs(old_logp_BxT=old_logp if objective.recompute_old_logp else None,
                        ref_logp_BxT=ref_logp, values_BxT=values)
    return rollout_token_weights(objective, rollout, logp, logprobs)


def compute_advantages(config, rewards, *, group_size: int) -> jax.Array:
    """Row advantages `[B]` of an outcome estimator (raises on NaN rewards)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    _checks.check_finite("rewards", rewards)
    return row_advantages(Estimator.from_config(config), rewards,
                          group_size=group_size).advantages_B
