"""From sampled completions to padded `[B, T]` arrays (host side, numpy).

Row layout, right-padded to a length bucket:
  tokens   = prompt + completion, then pad
  loss_mask: 1 on completion tokens
  behavior_logp[t]: the sampler's log-prob of tokens[t] (completion tokens)
The trainer's `sequence_logprobs` puts `log p(tokens[t] | tokens[:t])` at t,
so both live on the same grid.
"""

import dataclasses
from typing import Sequence

import numpy as np


def bucket_length(n: int, bucket: int) -> int:
    """`n` rounded up to a multiple of `bucket` (a fixed set of shapes)."""
    return max(bucket, -(-n // bucket) * bucket)


@dataclasses.dataclass
class Row:
    """One training row before padding: the tokens and what each one is.

    tokens: prompt, sampled turns and environment tokens, in order.
    sampled: 1 on tokens the policy sampled (they train with `rl`).
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


@dataclasses.dataclass
class RolloutArrays:
    tokens: np.ndarray          # int32 [B, T]
    positions: np.ndarray       # int32 [B, T]
    loss_mask: np.ndarray       # float32 [B, T]: sampled tokens
    behavior_logp: np.ndarray   # float32 [B, T]
    completion_len: np.ndarray  # int32 [B]: sampled tokens per row
    truncated: np.ndarray       # bool [B]: hit the limit without a stop token
    version: np.ndarray         # int32 [B]
    routing: np.ndarray | None  # int32 [B, T, L, K] (MoE replay) or None
    env_mask: np.ndarray = None       # float32 [B, T]: env tokens after the first reply
    token_rewards: np.ndarray = None  # float32 [B, T]: per-turn rewards (multi-turn)


def assemble(completions: Sequence, *, bucket: int, pad_id: int,
             length: int | None = None) -> RolloutArrays:
    """Pads single-turn completions into arrays (see assemble_rows)."""
    return assemble_rows([Row.from_completion(c) for c in completions], bucket=bucket,
                         pad_id=pad_id, length=length)


def assemble_rows(rows: Sequence[Row], *, bucket: int, pad_id: int,
                  length: int | None = None) -> RolloutArrays:
    """Pads rows into arrays of width `length` (default: bucketed max)."""
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
    return RolloutArrays(
        tokens=tokens,
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        loss_mask=mask,
        behavior_logp=blogp,
        completion_len=mask.sum(axis=1).astype(np.int32),
        truncated=np.array([r.truncated for r in rows]),
        version=np.array([r.version for r in rows], np.int32),
        routing=routing,
        env_mask=env,
        token_rewards=rew,
    )


def bad_rows(arrays: RolloutArrays, vocab_size: int) -> np.ndarray:
    """bool [B]: rows with a non-finite behavior log-prob or an id outside [0, V)."""
    m = arrays.loss_mask > 0
    lp = arrays.behavior_logp
    # A log-prob is finite and <= 0; anything else is not a distribution.
    nonfinite = np.any(m & ~(np.isfinite(lp) & (lp <= 1e-4)), axis=1)
    out_of_vocab = np.any((arrays.tokens < 0) | (arrays.tokens >= vocab_size), axis=1)
    return nonfinite | out_of_vocab
