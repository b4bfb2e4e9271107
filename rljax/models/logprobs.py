"""Per-token log-probabilities and entropies without materialising the [B, T, V] logits.

    logp[b, t] = z[b, t, y[b, t]] - logsumexp_v z[b, t, v],   z = (h @ W.T) / temperature
    entropy[b, t] = logsumexp_v z - sum_v softmax(z)_v z_v

The B*T tokens are processed in chunks of `chunk_size` by a `lax.map` whose
body is rematerialised (`jax.checkpoint`): the forward keeps only each chunk's
inputs, and the backward recomputes one chunk's [chunk_size, V] logits at a
time. Peak temporary memory is O(chunk_size * V) instead of O(B * T * V); see
experiments/bench/logprob_memory.py. The log-softmax is always in float32.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

DEFAULT_CHUNK_SIZE = 256


def _chunk_stats(h_CxD, unembed_VxD, targets_C, temperature, return_entropy):
    logits_CxV = jnp.einsum("cd,vd->cv", h_CxD, unembed_VxD, preferred_element_type=jnp.float32)
    logits_CxV = logits_CxV / temperature
    # Shift by the (constant) max first: the entropy's lse - E[z] then cancels
    # between small numbers instead of large ones.
    logits_CxV = logits_CxV - jax.lax.stop_gradient(jnp.max(logits_CxV, axis=-1, keepdims=True))
    lse_C = jax.nn.logsumexp(logits_CxV, axis=-1)
    logp_C = jnp.take_along_axis(logits_CxV, targets_C[:, None], axis=-1)[:, 0] - lse_C
    if not return_entropy:
        return logp_C, None
    probs_CxV = jnp.exp(logits_CxV - lse_C[:, None])
    return logp_C, jnp.sum(probs_CxV * (lse_C[:, None] - logits_CxV), axis=-1)


def token_logprobs(
    hidden_BxTxD: jax.Array,
    unembed_VxD: jax.Array,
    targets_BxT: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
):
    """log p(targets[b, t] | hidden[b, t]) under softmax(hidden @ unembed.T / temperature).

    Args:
      hidden_BxTxD: final (normed) hidden states, any float dtype.
      unembed_VxD: the unembedding matrix (`Decoder.unembed_weight()`).
      targets_BxT: int token ids scored at each position.
      temperature: divides the logits before the softmax (sampler's temperature).
      chunk_size: tokens per chunk; peak memory ~ a few chunk_size x V float32.
      return_entropy: also return the entropy of each position's distribution.

    Returns:
      logp_BxT float32, or (logp_BxT, entropy_BxT) when return_entropy.
    """
    chex.assert_rank([hidden_BxTxD, unembed_VxD, targets_BxT], [3, 2, 2])
    B, T, D = hidden_BxTxD.shape
    chex.assert_shape(targets_BxT, (B, T))
    chex.assert_axis_dimension(unembed_VxD, 1, D)
    N = B * T
    C = max(1, min(chunk_size, N))
    n_chunks = -(-N // C)
    pad = n_chunks * C - N
    h_NxD = jnp.pad(hidden_BxTxD.reshape(N, D), ((0, pad), (0, 0)))
    targets_N = jnp.pad(targets_BxT.reshape(N).astype(jnp.int32), (0, pad))
    unembed_VxD = unembed_VxD.astype(hidden_BxTxD.dtype)

    # Remat: the backward recomputes the chunk's logits instead of storing them.
    chunk = jax.checkpoint(functools.partial(_chunk_stats, return_entropy=return_entropy))

    def body(args):
        h_CxD, t_C = args
        logp_C, ent_C = chunk(h_CxD, unembed_VxD, t_C, temperature)
        return logp_C, (jnp.zeros_like(logp_C) if ent_C is None else ent_C)

    logp, ent = jax.lax.map(body, (h_NxD.reshape(n_chunks, C, D), targets_N.reshape(n_chunks, C)))
    logp_BxT = logp.reshape(-1)[:N].reshape(B, T)
    if not return_entropy:
        return logp_BxT
    return logp_BxT, ent.reshape(-1)[:N].reshape(B, T)


def token_logprobs_full(hidden_BxTxD, unembed_VxD, targets_BxT, *, temperature=1.0, return_entropy=False):
    """The same quantity with all [B, T, V] logits at once: the reference for tests and benchmarks."""
    B, T, D = hidden_BxTxD.shape
    logp, ent = _chunk_stats(hidden_BxTxD.reshape(B * T, D), unembed_VxD.astype(hidden_BxTxD.dtype),
                             targets_BxT.reshape(B * T).astype(jnp.int32), temperature, return_entropy)
    if not return_entropy:
        return logp.reshape(B, T)
    return logp.reshape(B, T), ent.reshape(B, T)


def sequence_logprobs(
    model,
    tokens_BxT: jax.Array,
    positions_BxT: jax.Array | None = None,
    *,
    attn_mask_BxT: jax.Array | None = None,
    segment_ids_BxT: jax.Array | None = None,
    routing_BxTxLxK: jax.Array | None = None,
    temperature: float | jax.Array = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_entropy: bool = False,
):
    """Log-prob of each token given the tokens before it, on the tokens' own [B, T] grid.

    Alignment: `logp[b, t] = log p(tokens[b, t] | tokens[b, :t])` for t >= 1,
    computed from the hidden state at t - 1; `logp[b, 0] = 0` (nothing
    predicts the first token). So a loss mask that is 1 on completion tokens
    selects exactly the completion's log-probs. Entropy, when requested, is
    aligned the same way: `entropy[b, t]` is the entropy of the distribution
    that `tokens[b, t]` was drawn from, 0 at t = 0.

    With packed rows (`segment_ids_BxT`), the first token of each later segment
    is scored from the last token of the segment before it: a meaningless
    number that the loss mask must exclude (it is a prompt token anyway).

    Args:
      model: a `Decoder` (anything with the same call and `unembed_weight()`).
      tokens_BxT, positions_BxT, attn_mask_BxT, segment_ids_BxT, routing_BxTxLxK: as `Decoder.__call__`.
      temperature, chunk_size, return_entropy: as `token_logprobs`.

    Returns:
      logp_BxT float32, or (logp_BxT, entropy_BxT) when return_entropy.
    """
    chex.assert_rank(tokens_BxT, 2)
    out = model(tokens_BxT, positions_BxT, attn_mask_BxT=attn_mask_BxT, segment_ids_BxT=segment_ids_BxT,
                routing_BxTxLxK=routing_BxTxLxK, return_hidden=True)
    result = token_logprobs(out.hidden[:, :-1], model.unembed_weight(), tokens_BxT[:, 1:],
                            temperature=temperature, chunk_size=chunk_size, return_entropy=return_entropy)
    first = jnp.zeros((tokens_BxT.shape[0], 1), jnp.float32)
    if not return_entropy:
        return jnp.concatenate([first, result], axis=1)
    return tuple(jnp.concatenate([first, x], axis=1) for x in result)
