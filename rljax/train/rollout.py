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
class RolloutArrays:
    tokens: np.ndarray          # int32 [B, T]
    positions: np.ndarray       # int32 [B, T]
    loss_mask: np.ndarray       # float32 [B, T]
    behavior_logp: np.ndarray   # float32 [B, T]
    completion_len: np.ndarray  # int32 [B]
    truncated: np.ndarray       # bool [B]: hit the limit without a stop token
    version: np.ndarray         # int32 [B]
    routing: np.ndarray | None  # int32 [B, T, L, K] (MoE replay) or None


def assemble(completions: Sequence, *, bucket: int, pad_id: int,
             length: int | None = None) -> RolloutArrays:
    """Pads completions into arrays of width `length` (default: bucketed max)."""
    lens = [len(c.prompt_ids) + len(c.completion_ids) for c in completions]
    t = length or bucket_length(max(lens), bucket)
    if max(lens) > t:
        raise ValueError(f"a row of {max(lens)} tokens does not fit width {t}")
    b = len(completions)
    tokens = np.full((b, t), pad_id, np.int32)
    mask = np.zeros((b, t), np.float32)
    blogp = np.zeros((b, t), np.float32)
    routing = None
    first = completions[0]
    if first.routing is not None and first.prompt_routing is not None:
        routing = np.zeros((b, t) + first.routing.shape[1:], np.int32)
    for i, c in enumerate(completions):
        p, n = len(c.prompt_ids), len(c.completion_ids)
        tokens[i, :p] = c.prompt_ids
        tokens[i, p:p + n] = c.completion_ids
        mask[i, p:p + n] = 1.0
        blogp[i, p:p + n] = c.logprobs
        if routing is not None:
            # Experts are indexed by the input token of each forward pass.
            routing[i, :p] = c.prompt_routing
            if n > 1:
                routing[i, p:p + n - 1] = c.routing[1:]
    return RolloutArrays(
        tokens=tokens,
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
        loss_mask=mask,
        behavior_logp=blogp,
        completion_len=np.array([len(c.completion_ids) for c in completions], np.int32),
        truncated=np.array([c.finish_reason == "length" for c in completions]),
        version=np.array([c.version for c in completions], np.int32),
        routing=routing,
    )


def bad_rows(arrays: RolloutArrays, vocab_size: int) -> np.ndarray:
    """bool [B]: rows with a non-finite behavior log-prob or an id outside [0, V)."""
    m = arrays.loss_mask > 0
    lp = arrays.behavior_logp
    # A log-prob is finite and <= 0; anything else is not a distribution.
    nonfinite = np.any(m & ~(np.isfinite(lp) & (lp <= 1e-4)), axis=1)
    out_of_vocab = np.any((arrays.tokens < 0) | (arrays.tokens >= vocab_size), axis=1)
    return nonfinite | out_of_vocab
