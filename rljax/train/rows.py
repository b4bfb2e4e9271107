"""From sampled completions to a padded `Rollout` (host side, numpy).

Row layout, right-padded to a length bucket:
  tokens   = prompt + completion (+ environment tokens + later turns), then pad
  loss_mask: 1 on completion tokens
  behavior_logp[t]: the sampler's log-prob of tokens[t] (completion tokens)
The trainer's `sequence_logprobs` puts `log p(tokens[t] | tokens[:t])` at t,
so both live on the same grid.
"""

import dataclasses
from typing import Sequence

import numpy as np

from rljax.batch import Rollout


def bucket_length(n: int, bucket: int) -> int:
    """`n` rounded up to a multiple of `bucket` (a fixed set of shapes)."""
    return max(bucket, -(-n // bucket) * bucket)


@dataclasses.dataclass
class Row:
    """One training row before padding: the tokens and what each one is.

    tokens: prompt, sampled turns and environment tokens, in order.
    sampled: 1 on the row's completion tokens (sampled, or a reference answer).
    logp: the sampler's log-prob of each sampled token (0 elsewhere).
    env: 1 on environment tokens after the first reply (echo's `ce` targets).
    rewards: per-token rewards (a turn's reward on its last sampled token).
    """

    tokens: list
    sampled: list
    logp: list
    env: list
    rewards: list
    truncated: bool
    version: int
    routing: np.ndarray | None = None  # [len(tokens), L, K] experts per input token

    @classmethod
    def from_completion(cls, c) -> "Row":
        p, n = len(c.prompt_ids), len(c.completion_ids)
        routing = None
        if c.routing is not None and c.prompt_routing is not None:
            # Experts are indexed by the input token of each forward pass.
            routing = np.zeros((p + n,) + c.routing.shape[1:], np.int32)
            routing[:p] = c.prompt_routing
            if n > 1:
                routing[p:p + n - 1] = c.routing[1:]
        return cls(tokens=list(c.prompt_ids) + list(c.completion_ids),
                   sampled=[0] * p + [1] * n, logp=[0.0] * p + list(c.logprobs),
                   env=[0] * (p + n), rewards=[0.0] * (p + n),
                   truncated=c.finish_reason == "length", version=c.version, routing=routing)

    @classmethod
    def filler(cls, pad_id: int, version: int) -> "Row":
        """A one-token row that trains nothing (pads continuation rows to whole groups)."""
        return cls(tokens=[pad_id], sampled=[0], logp=[0.0], env=[0], rewards=[0.0],
                   truncated=False, version=version)


def to_rollout(rows: Sequence[Row], *, bucket: int, pad_id: int, multiturn: bool,
               length: int | None = None, **per_row) -> Rollout:
    """Pads rows into a Rollout of width `length` (default: the bucketed max).

    `per_row` are the Rollout's per-row fields the rows do not carry
    (rewards_B, source_B, episode_B, active_B, texts, ...). Multi-turn rows
    keep their environment mask and per-turn rewards; single-turn rows have
    neither (the outcome reward then sits on the last completion token).
    """
    lens = [len(r.tokens) for r in rows]
    t = length or bucket_length(max(lens), bucket)
    if max(lens) > t:
        raise ValueError(f"a row of {max(lens)} tokens does not fit width {t}")
    b = len(rows)
    tokens = np.full((b, t), pad_id, np.int32)
    mask, blogp, env, rew = (np.zeros((b, t), np.float32) for _ in range(4))
    routing = None
    if all(r.routing is not None for r in rows):
        routing = np.zeros((b, t) + rows[0].routing.shape[1:], np.int32)
    for i, r in enumerate(rows):
        n = len(r.tokens)
        tokens[i, :n] = r.tokens
        mask[i, :n] = r.sampled
        blogp[i, :n] = r.logp
        env[i, :n] = r.env
        rew[i, :n] = r.rewards
        if routing is not None:
            routing[i, :n] = r.routing
    has_completion = mask.any(axis=1)
    return Rollout(
        tokens_BxT=tokens,
        positions_BxT=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        loss_mask_BxT=mask, behavior_logp_BxT=blogp,
        truncated_B=np.array([r.truncated for r in rows]),
        version_B=np.array([r.version for r in rows], np.int32),
        prompt_len_B=np.where(has_completion, np.argmax(mask > 0, axis=1),
                              np.asarray(lens)).astype(np.int32),
        routing_BxTxLxK=routing,
        env_mask_BxT=env if multiturn else None,
        token_rewards_BxT=rew if multiturn else None,
        **per_row)


def bad_rows(rollout: Rollout, vocab_size: int) -> np.ndarray:
    """bool [B]: rows with a non-finite behavior log-prob or an id outside [0, V)."""
    m = rollout.loss_mask_BxT > 0
    lp = rollout.behavior_logp_BxT
    # A log-prob is finite and <= 0; anything else is not a distribution.
    nonfinite = np.any(m & ~(np.isfinite(lp) & (lp <= 1e-4)), axis=1)
    tokens = rollout.tokens_BxT
    out_of_vocab = np.any((tokens < 0) | (tokens >= vocab_size), axis=1)
    return nonfinite | out_of_vocab
