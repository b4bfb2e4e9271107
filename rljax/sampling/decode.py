"""Pure, jittable pieces of the sampler: token filtering, one sampling step, prefill.

Every sampling parameter is a per-row array (`temperature_B`, `top_p_B`,
`top_k_B`, `stop_ids_BxS`, `max_new_B`, `seeds_B`), so rows with different
settings, e.g. concurrent server requests, share one batch and one compiled
program; only the shapes are static. The decode loop over slots is in
`rljax.sampling.slots`.

The distribution a token is drawn from is

    q = softmax(filter(logits / temperature))

where `filter` keeps the top-k logits, then the smallest prefix of those (by
probability) whose renormalised mass reaches top-p, and sets the rest to
-inf. The recorded log-prob is `log q[token]`: the behavior policy's true
probability. Greedy rows (temperature 0) take the argmax and record
`log softmax(logits)[token]` (no temperature, no truncation).

Randomness: row r uses `fold_in(key(seed_r), row_id_r)` and step i folds in i,
so a row's tokens depend on its seed and row id only, not on its neighbours.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from rljax.models.transformer import KVCache, init_cache


class StepSample(NamedTuple):
    """One sampling step. tokens_B int32; logp_B float32; top_ids_BxN int32 and
    top_logp_BxN float32 are the N most likely tokens of q (N may be 0)."""

    tokens_B: jax.Array
    logp_B: jax.Array
    top_ids_BxN: jax.Array
    top_logp_BxN: jax.Array


def filter_logits(logits_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Logits outside each row's top-k, then top-p set replaced by -inf.

    top-k first, then top-p on the top-k renormalised probabilities (vLLM's
    order). The kept set is every token whose logit is at least the smallest
    kept sorted logit, so ties at the boundary are all kept; the most likely
    token is always kept. top_k 0 and top_p 1 mean off.
    """
    chex.assert_rank([logits_BxV, top_k_B, top_p_B], [2, 1, 1])
    B, V = logits_BxV.shape
    sorted_BxV = -jnp.sort(-logits_BxV, axis=-1)  # descending
    ranks_1xV = jnp.arange(V, dtype=jnp.int32)[None, :]
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V).astype(jnp.int32)
    in_k_BxV = ranks_1xV < k_B[:, None]
    probs_BxV = jax.nn.softmax(jnp.where(in_k_BxV, sorted_BxV, -jnp.inf), axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    keep_BxV = in_k_BxV & (mass_before_BxV < top_p_B[:, None])
    n_keep_B = jnp.maximum(jnp.sum(keep_BxV, axis=-1), 1)
    threshold_B = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(logits_BxV >= threshold_B[:, None], logits_BxV, -jnp.inf)


def sample_step(logits_BxV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
                top_p_B: jax.Array, n_top: int = 0) -> StepSample:
    """Draws one token per row from softmax(filter(logits / temperature)); see the module docstring."""
    chex.assert_rank([logits_BxV, temperature_B, top_k_B, top_p_B], [2, 1, 1, 1])
    logits_BxV = logits_BxV.astype(jnp.float32)
    greedy_B = temperature_B <= 0
    scaled_BxV = logits_BxV / jnp.where(greedy_B, 1.0, temperature_B).astype(jnp.float32)[:, None]
    # The sort over the vocabulary is skipped when no sampled row truncates.
    needs_filter = jnp.any(~greedy_B & ((top_k_B > 0) | (top_p_B < 1.0)))
    filtered_BxV = jax.lax.cond(needs_filter, filter_logits, lambda x, *_: x, scaled_BxV, top_k_B, top_p_B)
    logq_BxV = jax.nn.log_softmax(jnp.where(greedy_B[:, None], scaled_BxV, filtered_BxV), axis=-1)
    drawn_B = jax.vmap(jax.random.categorical)(keys_B, logq_BxV)
    tokens_B = jnp.where(greedy_B, jnp.argmax(logits_BxV, axis=-1), drawn_B).astype(jnp.int32)
    logp_B = jnp.take_along_axis(logq_BxV, tokens_B[:, None], axis=-1)[:, 0]
    if n_top:
        top_logp_BxN, top_ids_BxN = jax.lax.top_k(logq_BxV, n_top)
    else:
        top_logp_BxN = jnp.zeros((logits_BxV.shape[0], 0), jnp.float32)
        top_ids_BxN = jnp.zeros((logits_BxV.shape[0], 0), jnp.int32)
    return StepSample(tokens_B, logp_B, top_ids_BxN.astype(jnp.int32), top_logp_BxN)


def _unembed(model, hidden_BxD: jax.Array) -> jax.Array:
    """Logits of a few hidden states, as the Decoder computes them (float32 accumulation)."""
    w_VxD = model.unembed_weight().astype(hidden_BxD.dtype)
    return jnp.einsum("bd,vd->bv", hidden_BxD, w_VxD, preferred_element_type=jnp.float32)


def prefill(graphdef: nnx.GraphDef, state: nnx.State, prompt_BxP: jax.Array, prompt_len_B: jax.Array,
            cache_len: int) -> tuple[jax.Array, KVCache, jax.Array | None, jax.Array | None]:
    """One forward pass over right-padded prompts into a fresh KV cache of `cache_len` slots.

    Returns the float32 logits [B, V] after each row's last prompt token (only
    those are unembedded: [B, P, V] would dominate memory for real vocabularies),
    the cache, and for MoE models the routing [B, P, L, K] of the prompt tokens
    and [B, L, K] of each row's last one (else None, None).
    """
    chex.assert_rank([prompt_BxP, prompt_len_B], [2, 1])
    model = nnx.merge(graphdef, state)
    B, P = prompt_BxP.shape
    positions_BxP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None, :], (B, P))
    mask_BxP = positions_BxP < prompt_len_B[:, None]
    cache = init_cache(model.config, B, cache_len)
    out = model(prompt_BxP, positions_BxP, attn_mask_BxT=mask_BxP, cache=cache, return_hidden=True)
    last_BxD = jnp.take_along_axis(out.hidden, (prompt_len_B - 1)[:, None, None], axis=1)[:, 0]
    last_routing_BxLxK = None
    if out.routing is not None:
        last_routing_BxLxK = jnp.take_along_axis(out.routing, (prompt_len_B - 1)[:, None, None, None], axis=1)[:, 0]
    return _unembed(model, last_BxD), out.cache, out.routing, last_routing_BxLxK
