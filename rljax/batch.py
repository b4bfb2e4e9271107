"""The two data contracts of a step: `Rollout` (what a producer hands the
trainer) and `TrainBatch` (what one jitted optimizer step consumes).

    producer (sampler, reference data, an environment harness) -> Rollout
    objective.token_streams(Rollout, log-probs)                -> Streams
    objective.train_batch(Streams, minibatch rows)             -> TrainBatch

Every `_BxT` field is right-padded to the same `[B, T]`. Neither type carries
an algorithm name: which loss component a row trains with is data (the row's
`source_B`, an index into the objective's source table), and the normalizer
coefficients of each component arrive in the TrainBatch computed over the
whole optimizer-step batch (docs/algorithms.md §3, "Coefficients are data").
"""

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One step's rows, scored, from any producer. Host arrays (numpy).

    Rows come in groups of `group_size` consecutive rows that share a prompt
    (the group's outcome advantages are computed together). Rows after the
    groups may *continue* an episode: a multi-turn row closed by a prefix
    break takes the advantage of the group row it belongs to (`episode_B`);
    they are padded to whole pseudo-groups with inactive filler rows, so that
    `B % group_size == 0` and minibatches can hold whole groups.

    tokens_BxT: int32 prompt, completion and environment tokens.
    positions_BxT: int32 position ids.
    loss_mask_BxT: float32, 1 on the row's completion tokens (sampled by the
      policy, or the reference answer of a `ce` source).
    behavior_logp_BxT: float32 log-prob the sampler recorded for each token
      (0 where nothing was sampled).
    rewards_B: float32 episode return (the scalar outcome reward).
    source_B: int32 index into the objective's sources: what the row trains with.
    episode_B: int32 the row whose outcome advantage this row takes: itself for
      a group row, its group row for a continuation, -1 for filler.
    active_B: bool, False for rows that must not train (filler, garbage from
      the sampler, groups dropped by dynamic sampling).
    truncated_B: bool, hit the token limit without a stop token.
    version_B: int32 policy version that sampled the row (staleness).
    prompt_len_B: int32 index of the row's first completion token.
    env_mask_BxT: float32, 1 on environment tokens after the first reply
      (multi-turn rows; the `echo` targets). None: single-turn.
    token_rewards_BxT: float32 per-turn rewards on each turn's last sampled
      token (multi-turn GAE). None: the outcome reward on the last token.
    routing_BxTxLxK: int32 MoE experts to replay, or None.
    teacher_prompts: per row, the token ids of a prompt only a teacher sees
      (an `opsd` hint), or None; the teacher scores `teacher_prompt +
      tokens[prompt_len:]`. None when no row has one.
    texts: the completions' text, for inspection.
    data_pos: source name -> the next example index after this rollout.
    stats: the producer's counters (sampling rounds, skipped prompts, times).
    """

    tokens_BxT: np.ndarray
    positions_BxT: np.ndarray
    loss_mask_BxT: np.ndarray
    behavior_logp_BxT: np.ndarray
    rewards_B: np.ndarray
    source_B: np.ndarray
    episode_B: np.ndarray
    active_B: np.ndarray
    truncated_B: np.ndarray
    version_B: np.ndarray
    prompt_len_B: np.ndarray
    env_mask_BxT: Optional[np.ndarray] = None
    token_rewards_BxT: Optional[np.ndarray] = None
    routing_BxTxLxK: Optional[np.ndarray] = None
    teacher_prompts: Optional[tuple] = None
    texts: tuple = ()
    data_pos: dict = dataclasses.field(default_factory=dict)
    stats: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_arrays(cls, rewards_B, loss_mask_BxT, *, behavior_logp_BxT=None,
                    source_B=None, **fields) -> "Rollout":
        """A rollout of plain groups (no continuation rows), defaults filled in.

        What an inspection call or a hand-written test needs: every row active,
        its own episode, from source 0, sampled at version 0, never truncated.
        Array arguments may be jax arrays (or tracers, under an outer jit).
        """
        b, t = np.shape(loss_mask_BxT)
        zeros = np.zeros((b, t), np.float32)
        defaults = dict(
            tokens_BxT=np.zeros((b, t), np.int32), positions_BxT=np.zeros((b, t), np.int32),
            behavior_logp_BxT=zeros if behavior_logp_BxT is None else behavior_logp_BxT,
            source_B=np.zeros(b, np.int32) if source_B is None else np.asarray(source_B),
            episode_B=np.arange(b, dtype=np.int32), active_B=np.ones(b, bool),
            truncated_B=np.zeros(b, bool), version_B=np.zeros(b, np.int32),
            prompt_len_B=np.zeros(b, np.int32))
        return cls(rewards_B=rewards_B, loss_mask_BxT=loss_mask_BxT, **(defaults | fields))

    @property
    def shape(self) -> tuple:
        return tuple(np.shape(self.tokens_BxT))

    @property
    def completion_len_B(self) -> np.ndarray:
        return np.asarray(self.loss_mask_BxT).sum(axis=1).astype(np.int32)

    def replace(self, **fields) -> "Rollout":
        return dataclasses.replace(self, **fields)

    def validate(self, group_size: Optional[int] = None,
                 num_sources: Optional[int] = None) -> "Rollout":
        """Checks every field against `tokens_BxT`; ValueError naming the field."""
        if len(self.shape) != 2:
            raise ValueError(f"Rollout.tokens_BxT must be [B, T], got {self.shape}")
        b = self.shape[0]
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or f.name in ("texts", "data_pos", "stats", "teacher_prompts"):
                continue
            want = (self.shape if f.name.endswith("_BxT") else
                    self.shape if f.name.endswith("_BxTxLxK") else (b,))
            got = tuple(np.shape(v))[:len(want)]
            if got != want or (f.name.endswith("_B") and np.ndim(v) != 1):
                raise ValueError(f"Rollout.{f.name} has shape {np.shape(v)}, expected "
                                 f"{want}{' + (layers, k)' if 'LxK' in f.name else ''}")
        if self.teacher_prompts is not None and len(self.teacher_prompts) != b:
            raise ValueError(f"Rollout.teacher_prompts has {len(self.teacher_prompts)} "
                             f"entries for {b} rows")
        if group_size is not None and b % group_size:
            raise ValueError(f"a rollout of {b} rows is not whole groups of "
                             f"group_size={group_size}")
        source = np.asarray(self.source_B)
        if num_sources is not None and source.size and (
                source.min() < 0 or source.max() >= num_sources):
            raise ValueError(f"Rollout.source_B has values outside [0, {num_sources})")
        episode = np.asarray(self.episode_B)
        if episode.size and (episode.min() < -1 or episode.max() >= b):
            raise ValueError(f"Rollout.episode_B has values outside [-1, {b})")
        return self


@flax.struct.dataclass
class TrainBatch:
    """One optimizer step's rows.

    tokens: int32 token ids (prompt, completion, environment tokens).
    positions: int32 position ids.
    loss_mask: 1 on completion tokens that train with the `rl` component.
    behavior_logp: float32 log-probs the sampler recorded for each token.
    advantages: float32 per-token advantages (row advantages broadcast).
    coef: float32 axis-2 coefficients of the `rl` component.
    old_logp: trainer log-probs at the start of the batch (None: use mu).
    ref_logp: frozen reference model's log-probs (KL).
    teacher_logp: a teacher's log-probs for the `ref_kl` component (opd, opsd).
    ce_coef: weight times coefficient of the `ce` component (sft, echo).
    ref_kl_coef: weight times coefficient of the `ref_kl` component.
    routing: int32 [B, T, layers, k] MoE expert indices to replay.
    returns: GAE value targets for PPO's critic.
    old_values: the critic's values before the update (value clipping).
    """

    tokens: jax.Array
    positions: jax.Array
    loss_mask: jax.Array
    behavior_logp: jax.Array
    advantages: jax.Array
    coef: jax.Array
    old_logp: Optional[jax.Array] = None
    ref_logp: Optional[jax.Array] = None
    teacher_logp: Optional[jax.Array] = None
    ce_coef: Optional[jax.Array] = None
    ref_kl_coef: Optional[jax.Array] = None
    routing: Optional[jax.Array] = None
    returns: Optional[jax.Array] = None
    old_values: Optional[jax.Array] = None

    @property
    def shape(self):
        return tuple(self.tokens.shape)

    def validate(self) -> "TrainBatch":
        """Checks every field against `tokens` and returns self.

        Raises ValueError naming the field, its shape and the expected shape;
        also rejects non-finite advantages or coefficients (a NaN there would
        silently poison the whole step).
        """
        if np.ndim(self.tokens) != 2:
            raise ValueError(f"tokens must be [B, T], got {np.shape(self.tokens)}")
        bt = tuple(np.shape(self.tokens))
        for name in ("positions", "loss_mask", "behavior_logp", "advantages",
                     "coef", "old_logp", "ref_logp", "teacher_logp", "ce_coef",
                     "ref_kl_coef", "returns", "old_values"):
            v = getattr(self, name)
            if v is not None and tuple(np.shape(v)) != bt:
                raise ValueError(f"TrainBatch.{name} has shape {np.shape(v)}, "
                                 f"expected {bt} like tokens")
        if self.routing is not None and tuple(np.shape(self.routing))[:2] != bt:
            raise ValueError(f"TrainBatch.routing has shape {np.shape(self.routing)}, "
                             f"expected {bt} + (layers, k)")
        if self.ref_kl_coef is not None and self.teacher_logp is None:
            raise ValueError("TrainBatch.ref_kl_coef needs TrainBatch.teacher_logp")
        for name in ("advantages", "coef", "ce_coef", "ref_kl_coef"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, jax.core.Tracer):
                if not np.all(np.isfinite(np.asarray(v))):
                    raise ValueError(f"TrainBatch.{name} has non-finite values")
        return self

    def split(self, k: int) -> "TrainBatch":
        """Rows split into k micro-batches: every leaf gets a leading [k] axis."""
        b = self.tokens.shape[0]
        if k < 1 or b % k:
            raise ValueError(f"cannot split {b} rows into {k} micro-batches")
        return jax.tree.map(lambda x: x.reshape((k, b // k) + x.shape[1:]), self)

    def rows(self, index: Any) -> "TrainBatch":
        """The rows at `index` (a slice or an index array) of every field."""
        return jax.tree.map(lambda x: x[index], self)
