"""Flax NNX decoder-only transformer for the Llama / Qwen2 / Qwen3 family, with optional MoE.

RMSNorm, rotary embeddings (default, linear, llama3, yarn), grouped-query
attention, SwiGLU MLP or a dropless top-k mixture of experts, tied or untied
embeddings, Qwen2 q/k/v biases and Qwen3 q/k norms. The layout of the weights
follows Hugging Face's rotate-half RoPE convention, so checkpoints load without
permutation (GGUF's llama permutation is undone in `loading.py`).

The blocks are one `Block` whose parameters are stacked on a leading layer
axis; the decoder runs them under one `jax.lax.scan` (one block compiled, not
L), with the remat policy on the scanned body. Every parameter carries logical
axis names (`layers`, `vocab`, `embed`, `heads`, `kv_heads`, `head_dim`,
`mlp`, `experts`) for the mesh rules in `rljax.parallel`; nothing here depends
on a mesh.

Batches are `[B, T]` token arrays with RoPE positions, a mask of real tokens
and optional segment ids. Query i sees key j iff j <= i (row order), key j is
a real token, and, with segment ids, both are in the same segment (several
sequences packed in a row, positions restarting per segment); see
`rljax.models.attention` for the implementations. With a `KVCache`, tokens are
written at their positions and attend to every valid cached slot up to their
own position.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from rljax.models import attention as attention_lib
from rljax.models.config import AUTO_REMAT_MIN_TOKENS, ModelConfig

LAYERS_AXIS = "layers"


def _param(rngs: nnx.Rngs, init, shape, axes, dtype) -> nnx.Param:
    """A parameter with logical axis names; never placed on a mesh here."""
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=tuple(axes), eager_sharding=False)


_normal = nnx.initializers.normal(0.02)
_zeros = nnx.initializers.zeros_init()
_ones = nnx.initializers.ones_init()


# ----------------------------------------------------------------------------
# Rotary embeddings.


def rope_inv_freq(config: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale, for every RoPE variant.

    Follows the Hugging Face definitions (`modeling_rope_utils`): `linear` divides
    positions by `factor`; `llama3` divides only the low frequencies by `factor`
    and interpolates the band between; `yarn` blends interpolated and
    extrapolated frequencies by a linear ramp over dimensions and scales cos/sin
    by `0.1 ln(factor) + 1`.
    """
    dim = config.head_dim
    base = float(config.rope_theta)
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling_dict()
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    attention_factor = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    elif rope_type == "yarn":
        factor = float(scaling["factor"])
        old_len = float(scaling.get("original_max_position_embeddings") or config.max_seq_len)

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def correction_dim(rotations):
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extrapolation_weight = 1 - ramp
        inv_freq = inv_freq / factor * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(config: ModelConfig, positions_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [B, T, 1, head_dim] in float32, rotate-half layout."""
    inv_freq, scale = rope_inv_freq(config)
    angles_BxTxF = positions_BxT.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
    angles_BxTxDh = jnp.concatenate([angles_BxTxF, angles_BxTxF], axis=-1)[:, :, None, :]
    return jnp.cos(angles_BxTxDh) * scale, jnp.sin(angles_BxTxDh) * scale


def apply_rope(x_BxTxHxDh: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x_BxTxHxDh.shape[-1] // 2
    x = x_BxTxHxDh.astype(jnp.float32)
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x_BxTxHxDh.dtype)


# ----------------------------------------------------------------------------
# KV cache.


@struct.dataclass
class KVCache:
    """Keys and values of every layer, [L, B, max_len, n_kv_heads, head_dim] each.

    Slot `s` of row `b` holds the token at position `s`. `lengths_B` is one past
    the largest position written so far per row; slots at or beyond it are
    invisible to attention.
    """

    k: jax.Array
    v: jax.Array
    lengths_B: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache for `batch` rows of up to `max_len` positions."""
    dtype = config.compute_jnp_dtype if dtype is None else dtype
    shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths_B=jnp.zeros((batch,), jnp.int32))


# ----------------------------------------------------------------------------
# Layers.


class RMSNorm(nnx.Module):
    """x / rms(x) * w, computed in float32 and cast back (as Llama / Qwen do)."""

    def __init__(self, dim: int, eps: float, axis_name: str, dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = _param(rngs, _ones, (dim,), (axis_name,), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (w * normed.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


class _Context(NamedTuple):
    """What every layer's attention shares: masks, positions and the chosen implementation."""

    positions_BxT: jax.Array
    attn_mask_BxT: jax.Array
    segment_ids_BxT: jax.Array | None
    lengths_B: jax.Array | None  # with a cache: valid slots after this call's writes
    implementation: str          # the request handed to attention_lib.attention
    block_q: int
    block_kv: int


class _LayerCache(NamedTuple):
    """The whole stacked cache and the index of the layer being run (written in place)."""

    k_LxBxSxKxD: jax.Array
    v_LxBxSxKxD: jax.Array
    layer: jax.Array


class Attention(nnx.Module):
    """Grouped-query attention with optional q/k/v biases and q/k norms."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c = config
        pdt = c.param_jnp_dtype
        self.config = c
        self.q = _param(rngs, _normal, (c.d_model, c.n_heads, c.head_dim), ("embed", "heads", "head_dim"), pdt)
        self.k = _param(rngs, _normal, (c.d_model, c.n_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), pdt)
        self.v = _param(rngs, _normal, (c.d_model, c.n_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), pdt)
        self.o = _param(rngs, _normal, (c.n_heads, c.head_dim, c.d_model), ("heads", "head_dim", "embed"), pdt)
        if c.qkv_bias:
            self.q_bias = _param(rngs, _zeros, (c.n_heads, c.head_dim), ("heads", "head_dim"), pdt)
            self.k_bias = _param(rngs, _zeros, (c.n_kv_heads, c.head_dim), ("kv_heads", "head_dim"), pdt)
            self.v_bias = _param(rngs, _zeros, (c.n_kv_heads, c.head_dim), ("kv_heads", "head_dim"), pdt)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_eps, "head_dim", pdt, rngs)
            self.k_norm = RMSNorm(c.head_dim, c.rms_eps, "head_dim", pdt, rngs)

    def _project(self, x, kernel, bias_name):
        cdt = self.config.compute_jnp_dtype
        y = jnp.einsum("btd,dhk->bthk", x, kernel[...].astype(cdt))
        if self.config.qkv_bias:
            y = y + getattr(self, bias_name)[...].astype(cdt)[None, None]
        return y

    def __call__(self, x_BxTxD, cos, sin, ctx: _Context, cache: _LayerCache | None):
        c = self.config
        cdt = c.compute_jnp_dtype
        q = self._project(x_BxTxD, self.q, "q_bias")
        k = self._project(x_BxTxD, self.k, "k_bias")
        v = self._project(x_BxTxD, self.v, "v_bias")
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        blocks = dict(implementation=ctx.implementation, block_q=ctx.block_q, block_kv=ctx.block_kv,
                      field="ModelConfig.attention")

        if cache is None:
            out = attention_lib.attention(q, k, v, q_segment_ids_BxT=ctx.segment_ids_BxT,
                                          kv_segment_ids_BxS=ctx.segment_ids_BxT, kv_valid_BxS=ctx.attn_mask_BxT,
                                          **blocks)
            new_cache = None
        else:
            k_all, v_all, layer = cache
            B, T = ctx.positions_BxT.shape
            S = k_all.shape[2]
            # Padding tokens are not written (index S is dropped), so a pad whose
            # position collides with a real token cannot overwrite it.
            write_BxT = jnp.where(ctx.attn_mask_BxT, ctx.positions_BxT, S)
            rows_BxT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
            k_all = k_all.at[layer, rows_BxT, write_BxT].set(k.astype(k_all.dtype), mode="drop")
            v_all = v_all.at[layer, rows_BxT, write_BxT].set(v.astype(v_all.dtype), mode="drop")
            slots_BxS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (B, S))
            out = attention_lib.attention(q, k_all[layer].astype(cdt), v_all[layer].astype(cdt),
                                          kv_valid_BxS=slots_BxS < ctx.lengths_B[:, None],
                                          q_positions_BxT=ctx.positions_BxT, kv_positions_BxS=slots_BxS, **blocks)
            new_cache = _LayerCache(k_all, v_all, layer)
        return jnp.einsum("bthd,hde->bte", out, self.o[...].astype(cdt)), new_cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, pdt = config, config.param_jnp_dtype
        self.config = c
        self.gate = _param(rngs, _normal, (c.d_model, c.mlp_dim), ("embed", "mlp"), pdt)
        self.up = _param(rngs, _normal, (c.d_model, c.mlp_dim), ("embed", "mlp"), pdt)
        self.down = _param(rngs, _normal, (c.mlp_dim, c.d_model), ("mlp", "embed"), pdt)

    def __call__(self, x_BxTxD):
        cdt = self.config.compute_jnp_dtype
        h = jax.nn.silu(x_BxTxD @ self.gate[...].astype(cdt)) * (x_BxTxD @ self.up[...].astype(cdt))
        return h @ self.down[...].astype(cdt)


class MoE(nnx.Module):
    """Dropless top-k mixture of SwiGLU experts.

    gates = softmax(router(x)) restricted to the top-k experts and renormalised
    to sum to one (Mixtral; Qwen3-MoE with norm_topk_prob). Every token reaches
    its k experts (no capacity, no dropping): assignments are sorted by expert
    and run as grouped matmuls (`jax.lax.ragged_dot`).

    With `replay_BxTxK`, those experts are used instead of the router's top-k
    (rollout routing replay); the gates are still the current router's
    probabilities of the replayed experts, renormalised, so the router trains.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        c, pdt = config, config.param_jnp_dtype
        E, F = c.n_experts, c.expert_mlp_dim
        self.config = c
        self.router = _param(rngs, _normal, (c.d_model, E), ("embed", "experts"), pdt)
        self.gate = _param(rngs, _normal, (E, c.d_model, F), ("experts", "embed", "mlp"), pdt)
        self.up = _param(rngs, _normal, (E, c.d_model, F), ("experts", "embed", "mlp"), pdt)
        self.down = _param(rngs, _normal, (E, F, c.d_model), ("experts", "mlp", "embed"), pdt)

    def __call__(self, x_BxTxD, replay_BxTxK=None):
        c = self.config
        cdt = c.compute_jnp_dtype
        B, T, D = x_BxTxD.shape
        K, E = c.experts_per_token, c.n_experts
        # Routing in float32: near-ties decide discrete choices.
        router_logits = jnp.einsum("btd,de->bte", x_BxTxD.astype(jnp.float32), self.router[...].astype(jnp.float32))
        probs_BxTxE = jax.nn.softmax(router_logits, axis=-1)
        if replay_BxTxK is None:
            _, experts_BxTxK = jax.lax.top_k(probs_BxTxE, K)
            experts_BxTxK = experts_BxTxK.astype(jnp.int32)
        else:
            experts_BxTxK = replay_BxTxK.astype(jnp.int32)
        gates_BxTxK = jnp.take_along_axis(probs_BxTxE, experts_BxTxK, axis=-1)
        gates_BxTxK = gates_BxTxK / jnp.sum(gates_BxTxK, axis=-1, keepdims=True)

        experts_A = experts_BxTxK.reshape(-1)  # A = B*T*K assignments
        order_A = jnp.argsort(experts_A, stable=True)
        tokens_NxD = x_BxTxD.reshape(B * T, D)
        xs_AxD = tokens_NxD[order_A // K]
        group_sizes_E = jnp.bincount(experts_A, length=E).astype(jnp.int32)
        gate_h = jax.lax.ragged_dot(xs_AxD, self.gate[...].astype(cdt), group_sizes_E)
        up_h = jax.lax.ragged_dot(xs_AxD, self.up[...].astype(cdt), group_sizes_E)
        ys_AxD = jax.lax.ragged_dot(jax.nn.silu(gate_h) * up_h, self.down[...].astype(cdt), group_sizes_E)
        ys_AxD = jnp.zeros_like(ys_AxD).at[order_A].set(ys_AxD)  # back to token-major order
        ys_BxTxKxD = ys_AxD.reshape(B, T, K, D)
        out = jnp.sum(ys_BxTxKxD * gates_BxTxK.astype(cdt)[..., None], axis=2)
        return out, experts_BxTxK


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        pdt = config.param_jnp_dtype
        self.attn_norm = RMSNorm(config.d_model, config.rms_eps, "embed", pdt, rngs)
        self.attn = Attention(config, rngs)
        self.mlp_norm = RMSNorm(config.d_model, config.rms_eps, "embed", pdt, rngs)
        self.mlp = MoE(config, rngs) if config.is_moe else MLP(config, rngs)

    def __call__(self, x, cos, sin, ctx: _Context, cache: _LayerCache | None, replay_BxTxK):
        h, cache = self.attn(self.attn_norm(x), cos, sin, ctx, cache)
        x = x + h
        if isinstance(self.mlp, MoE):
            h, experts_BxTxK = self.mlp(self.mlp_norm(x), replay_BxTxK)
        else:
            h, experts_BxTxK = self.mlp(self.mlp_norm(x)), None
        return x + h, cache, experts_BxTxK


def _stacked_blocks(config: ModelConfig, rngs: nnx.Rngs) -> Block:
    """One Block whose every parameter has a leading [n_layers] axis named "layers" (own init per layer)."""

    @nnx.split_rngs(splits=config.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=config.n_layers,
              transform_metadata={nnx.PARTITION_NAME: LAYERS_AXIS})
    def make(rngs):
        return Block(config, rngs)

    return make(rngs)


def _layer_state(stacked_state, index) -> Any:
    """Layer `index` of a stacked Block's state, with the "layers" axis dropped from the metadata too."""
    one = jax.tree.map(lambda x: x[index], stacked_state)
    return nnx.spmd.remove_axis(one, 0, {nnx.PARTITION_NAME: LAYERS_AXIS})


def _remat_policy(name: str):
    return {"full": None, "dots_saveable": jax.checkpoint_policies.dots_saveable}[name]


# ----------------------------------------------------------------------------
# The decoder.


class DecoderOutput(NamedTuple):
    """logits: float32 [B, T, V] or None (return_hidden); hidden: final normed
    [B, T, D] in the compute dtype; cache: the updated KVCache or None; routing:
    int32 [B, T, L, K] chosen experts or None for a dense model."""

    logits: jax.Array | None
    hidden: jax.Array
    cache: KVCache | None
    routing: jax.Array | None


class Decoder(nnx.Module):
    """Decoder-only transformer. `Decoder(config, rngs=nnx.Rngs(0))` (rngs None means Rngs(0))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs | None = None):
        self.config = config
        rngs = nnx.Rngs(0) if rngs is None else rngs
        pdt = config.param_jnp_dtype
        self.embed = _param(rngs, _normal, (config.vocab_size, config.d_model), ("vocab", "embed"), pdt)
        self.layers = _stacked_blocks(config, rngs)
        self.final_norm = RMSNorm(config.d_model, config.rms_eps, "embed", pdt, rngs)
        if not config.tie_embeddings:
            # Stored [V, D] like the embedding, so unembed_weight() has one layout.
            self.lm_head = _param(rngs, _normal, (config.vocab_size, config.d_model), ("vocab", "embed"), pdt)

    def unembed_weight(self) -> jax.Array:
        """The unembedding matrix [V, D]: logits = hidden @ W.T."""
        return self.embed[...] if self.config.tie_embeddings else self.lm_head[...]

    def layer(self, index: int) -> Block:
        """Block `index` on its own (a copy of its slice of the stacked parameters)."""
        if not 0 <= index < self.config.n_layers:
            raise ValueError(f"layer index {index} is outside [0, n_layers={self.config.n_layers})")
        graphdef, state = nnx.split(self.layers)
        return nnx.merge(graphdef, _layer_state(state, index))

    def __call__(
            self,
            tokens_BxT: jax.Array,
            positions_BxT: jax.Array | None = None,
            *,
            attn_mask_BxT: jax.Array | None = None,
            segment_ids_BxT: jax.Array | None = None,
            cache: KVCache | None = None,
            routing_BxTxLxK: jax.Array | None = None,
            return_hidden: bool = False,
    ) -> DecoderOutput:
        """Forward pass over a batch of rows.

        Args:
            tokens_BxT: int token ids.
            positions_BxT: RoPE position of each token; default `arange(T)` per row
                (with packed segments, positions restart at each segment).
            attn_mask_BxT: True on real tokens; padding keys are never attended to
                and, with a cache, padding tokens are not written.
            segment_ids_BxT: int id of the packed sequence each token belongs to;
                a token attends only within its segment. Not with a cache.
            cache: a KVCache to write into and attend over (prefill with T > 1, then
                decode with T = 1 at positions == cache.lengths_B).
            routing_BxTxLxK: MoE experts to replay instead of the router's choice.
            return_hidden: skip the unembedding (logits=None); for chunked log-probs.
        """
        c = self.config
        chex.assert_rank(tokens_BxT, 2)
        B, T = tokens_BxT.shape
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
        if attn_mask_BxT is None:
            attn_mask_BxT = jnp.ones((B, T), bool)
        chex.assert_shape([positions_BxT, attn_mask_BxT], (B, T))
        attn_mask_BxT = attn_mask_BxT.astype(bool)
        if segment_ids_BxT is not None:
            chex.assert_shape(segment_ids_BxT, (B, T))
            if cache is not None:
                raise ValueError("segment_ids_BxT cannot be combined with a cache (packed rows are for training)")
        if routing_BxTxLxK is not None:
            if not c.is_moe:
                raise ValueError("routing_BxTxLxK was given but the model has no experts (n_experts=0)")
            chex.assert_shape(routing_BxTxLxK, (B, T, c.n_layers, c.experts_per_token))

        cdt = c.compute_jnp_dtype
        x = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(cdt)
        cos, sin = rope_cos_sin(c, positions_BxT)

        lengths_B = None
        implementation = c.attention
        if cache is not None:
            chex.assert_shape([cache.k, cache.v], (c.n_layers, B, cache.max_len, c.n_kv_heads, c.head_dim))
            written_B = jnp.max(jnp.where(attn_mask_BxT, positions_BxT + 1, 0), axis=1)
            lengths_B = jnp.maximum(cache.lengths_B, written_B).astype(jnp.int32)
            # Decoding is the one-query path ([B, H, S] scores). A prefill attends
            # over cache slots by position, which only xla / blockwise express.
            implementation = "xla" if T == 1 else ("auto" if implementation in ("cudnn", "splash") else implementation)
        ctx = _Context(positions_BxT, attn_mask_BxT, segment_ids_BxT, lengths_B, implementation,
                       c.attention_block_q, c.attention_block_kv)

        graphdef, stacked = nnx.split(self.layers)

        def body(carry, xs):
            x, k_all, v_all = carry
            index, params, replay_BxTxK = xs
            block = nnx.merge(graphdef, nnx.spmd.remove_axis(params, 0, {nnx.PARTITION_NAME: LAYERS_AXIS}))
            layer_cache = None if k_all is None else _LayerCache(k_all, v_all, index)
            x, layer_cache, experts_BxTxK = block(x, cos, sin, ctx, layer_cache, replay_BxTxK)
            if layer_cache is not None:
                k_all, v_all = layer_cache.k_LxBxSxKxD, layer_cache.v_LxBxSxKxD
            return (x, k_all, v_all), experts_BxTxK

        remat = c.remat
        if remat == "auto":
            remat = "full" if cache is None and B * T >= AUTO_REMAT_MIN_TOKENS else "none"
        if remat != "none":
            # Under scan, XLA keeps the remat (an unrolled loop would CSE it away).
            body = jax.checkpoint(body, policy=_remat_policy(remat), prevent_cse=not c.scan_layers)
        carry = (x, None, None) if cache is None else (x, cache.k, cache.v)
        replay_LxBxTxK = None if routing_BxTxLxK is None else jnp.moveaxis(routing_BxTxLxK, 2, 0)
        xs = (jnp.arange(c.n_layers, dtype=jnp.int32), stacked, replay_LxBxTxK)
        if c.scan_layers:
            (x, k_all, v_all), experts_LxBxTxK = jax.lax.scan(body, carry, xs)
        else:
            experts = []
            for index in range(c.n_layers):
                carry, e = body(carry, jax.tree.map(lambda a: a[index], xs))
                experts.append(e)
            (x, k_all, v_all) = carry
            experts_LxBxTxK = jnp.stack(experts) if c.is_moe else None

        hidden_BxTxD = self.final_norm(x)
        new_cache = None if cache is None else KVCache(k=k_all, v=v_all, lengths_B=lengths_B)
        routing_out = None if experts_LxBxTxK is None else jnp.moveaxis(experts_LxBxTxK, 0, 2)
        logits = None
        if not return_hidden:
            logits = jnp.einsum("btd,vd->btv", hidden_BxTxD, self.unembed_weight().astype(cdt),
                                preferred_element_type=jnp.float32)
        return DecoderOutput(logits=logits, hidden=hidden_BxTxD, cache=new_cache, routing=routing_out)
