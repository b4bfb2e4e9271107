"""Pure, jittable pieces of the sampler: token filtering, one sampling step, prefill, the decode loop.

Every sampling parameter is a per-row array (`temperature_B`, `top_p_B`,
`top_k_B`, `stop_ids_BxS`, `max_new_B`, `seeds_B`), so rows with different
settings, e.g. concurrent server requests, share one batch and one compiled
program; only the shapes (batch, prompt and completion buckets) are static.

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


class DecodeOutput(NamedTuple):
    """The decode loop's result for B rows and a completion bucket of C steps.

    tokens_BxC int32 (pad 0 after a row's end), logp_BxC float32 (0 after the
    end), n_tokens_B int32 tokens generated per row, stopped_B bool (ended on
    a stop token), top_ids_BxCxN / top_logp_BxCxN (N = n_top, may be 0),
    routing_BxCxLxK int32 or None (dense), steps: decode iterations run.
    """

    tokens_BxC: jax.Array
    logp_BxC: jax.Array
    n_tokens_B: jax.Array
    stopped_B: jax.Array
    top_ids_BxCxN: jax.Array
    top_logp_BxCxN: jax.Array
    routing_BxCxLxK: jax.Array | None
    steps: jax.Array


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


def decode(graphdef: nnx.GraphDef, state: nnx.State, logits_BxV: jax.Array, cache: KVCache,
           last_routing_BxLxK: jax.Array | None, prompt_len_B: jax.Array, seeds_B: jax.Array,
           row_ids_B: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array,
           stop_ids_BxS: jax.Array, max_new_B: jax.Array, *, max_new: int, n_top: int = 0) -> DecodeOutput:
    """Samples up to `max_new` tokens per row with a `lax.while_loop` that exits when every row is done.

    Step i samples completion token i from the current logits (the prefill's
    for i = 0), records it for rows still running, then runs the model on it at
    position prompt_len + i to get the next logits. A row is done after a stop
    token (`stop_ids_BxS`, padded with -1) or `max_new_B` tokens; rows with
    max_new_B = 0 (batch padding) are done from the start.
    """
    chex.assert_rank([logits_BxV, prompt_len_B, seeds_B, row_ids_B, temperature_B, top_k_B, top_p_B, stop_ids_BxS,
                      max_new_B], [2, 1, 1, 1, 1, 1, 1, 2, 1])
    B = logits_BxV.shape[0]
    chex.assert_shape([prompt_len_B, seeds_B, row_ids_B, temperature_B, top_k_B, top_p_B, max_new_B], (B,))
    model = nnx.merge(graphdef, state)
    C = max_new
    row_keys_B = jax.vmap(lambda s, r: jax.random.fold_in(jax.random.key(s), r))(seeds_B, row_ids_B)
    is_moe = last_routing_BxLxK is not None

    def cond(carry):
        i, done_B = carry[0], carry[3]
        return (i < C) & ~jnp.all(done_B)

    def body(carry):
        i, logits_BxV, cache, done_B, n_B, stopped_B, toks, logps, top_ids, top_logps, routing, cur_routing = carry
        keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys_B, i)
        s = sample_step(logits_BxV, keys_B, temperature_B, top_k_B, top_p_B, n_top)
        live_B = ~done_B
        toks = toks.at[:, i].set(jnp.where(live_B, s.tokens_B, 0))
        logps = logps.at[:, i].set(jnp.where(live_B, s.logp_B, 0.0))
        top_ids = top_ids.at[:, i].set(s.top_ids_BxN)
        top_logps = top_logps.at[:, i].set(s.top_logp_BxN)
        if is_moe:
            routing = routing.at[:, i].set(cur_routing)
        hit_stop_B = jnp.any(s.tokens_B[:, None] == stop_ids_BxS, axis=1) & live_B
        n_B = n_B + live_B.astype(jnp.int32)
        stopped_B = stopped_B | hit_stop_B
        done_B = done_B | hit_stop_B | (n_B >= max_new_B)

        def forward(cache):
            out = model(s.tokens_B[:, None], (prompt_len_B + i)[:, None], attn_mask_BxT=~done_B[:, None],
                        cache=cache)
            new_routing = out.routing[:, 0] if is_moe else cur_routing
            return out.logits[:, 0], out.cache, new_routing

        def skip(cache):
            return logits_BxV, cache, cur_routing

        # The last step needs no forward: nothing will be sampled from it.
        logits_BxV, cache, cur_routing = jax.lax.cond((i + 1 < C) & ~jnp.all(done_B), forward, skip, cache)
        return (i + 1, logits_BxV, cache, done_B, n_B, stopped_B, toks, logps, top_ids, top_logps, routing,
                cur_routing)

    L_K = last_routing_BxLxK.shape[1:] if is_moe else ()
    carry = (
        jnp.zeros((), jnp.int32), logits_BxV.astype(jnp.float32), cache, max_new_B <= 0,
        jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool),
        jnp.zeros((B, C), jnp.int32), jnp.zeros((B, C), jnp.float32),
        jnp.zeros((B, C, n_top), jnp.int32), jnp.zeros((B, C, n_top), jnp.float32),
        jnp.zeros((B, C) + L_K, jnp.int32) if is_moe else jnp.zeros((), jnp.int32),
        last_routing_BxLxK.astype(jnp.int32) if is_moe else jnp.zeros((), jnp.int32),
    )
    i, _, _, _, n_B, stopped_B, toks, logps, top_ids, top_logps, routing, _ = jax.lax.while_loop(cond, body, carry)
    return DecodeOutput(tokens_BxC=toks, logp_BxC=logps, n_tokens_B=n_B, stopped_B=stopped_B,
                        top_ids_BxCxN=top_ids, top_logp_BxCxN=top_logps,
                        routing_BxCxLxK=routing if is_moe else None, steps=i)


# Module-level jits: one compilation cache per (graphdef, shapes, statics), shared by
# every sampler holding an equal model, so tests and servers reuse programs.
prefill_jit = jax.jit(prefill, static_argnames=("graphdef", "cache_len"))
decode_jit = jax.jit(decode, static_argnames=("graphdef", "max_new", "n_top"))
