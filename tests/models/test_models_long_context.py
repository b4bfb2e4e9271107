"""Long contexts in the decoder: packed rows, the scan over layers, remat and blockwise attention in compiled memory."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models.config import get_preset
from rljax.models.logprobs import sequence_logprobs
from rljax.models.transformer import Decoder, init_cache

jax.config.update("jax_numpy_rank_promotion", "raise")

# Cheaper CPU compiles; buffer assignment (what memory_analysis reports) is unchanged by them.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _pure(config, seed=0):
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(seed)))
    return graphdef, state


@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_packed_row_equals_each_sequence_alone(attention):
    config = get_preset("tiny", attention=attention, attention_block_q=4, attention_block_kv=8)
    graphdef, state = _pure(config, seed=1)

    @jax.jit
    def run(state, tokens, positions, mask, segments):
        model = nnx.merge(graphdef, state)
        out = model(tokens, positions, attn_mask_BxT=mask, segment_ids_BxT=segments)
        logp = sequence_logprobs(model, tokens, positions, attn_mask_BxT=mask, segment_ids_BxT=segments)
        return out.logits, logp

    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, 9), rng.integers(0, 256, 6)
    # Row 0 packs a (positions 0..8), b (positions 0..5), then 3 padding tokens in segment 2.
    # Row 1 is the same tokens with every token in segment 0 (no packing): b then attends to a.
    tokens = np.stack([np.concatenate([a, b, [7, 7, 7]])] * 2)
    positions = np.stack([np.concatenate([np.arange(9), np.arange(6), np.arange(3)])] * 2)
    segments = np.array([[0] * 9 + [1] * 6 + [2] * 3, [0] * 18])
    mask = np.array([[True] * 15 + [False] * 3] * 2)
    packed, packed_logp = run(state, tokens, positions, mask, segments)
    # The same program, one sequence per row: a and b alone, right-padded.
    alone_tokens = np.zeros((2, 18), np.int64)
    alone_tokens[0, :9], alone_tokens[1, :6] = a, b
    alone_mask = np.arange(18)[None] < np.array([[9], [6]])
    alone, alone_logp = run(state, alone_tokens, np.broadcast_to(np.arange(18), (2, 18)), alone_mask,
                            np.zeros((2, 18), np.int64))
    for row, (start, n) in enumerate(((0, 9), (9, 6))):
        np.testing.assert_allclose(packed[0, start:start + n], alone[row, :n], atol=1e-5)
        # Log-probs too, except the first token of a segment (scored from the previous segment's end).
        np.testing.assert_allclose(packed_logp[0, start + 1:start + n], alone_logp[row, 1:n], atol=1e-5)
    # Without the segment ids (row 1) b attends to a: the ids really act.
    assert not np.allclose(packed[1, 9:15], packed[0, 9:15], atol=1e-3)
    assert np.isfinite(np.asarray(packed)).all()  # padding rows too


def test_scanned_and_unrolled_layers_agree():
    scanned = get_preset("tiny-moe")  # attention, MoE and routing
    unrolled = scanned.replace(scan_layers=False)
    assert scanned.scan_layers != unrolled.scan_layers
    graphdef, state = _pure(scanned, seed=2)
    graphdef_u = nnx.graphdef(Decoder(unrolled, rngs=nnx.Rngs(2)))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 7)))
    a = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
    b = jax.jit(lambda s, t: nnx.merge(graphdef_u, s)(t))(state, tokens)
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-5)
    np.testing.assert_array_equal(a.routing, b.routing)
    # Layer views slice the stacked parameters.
    model = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(model.layer(1).mlp_norm.weight[...], model.layers.mlp_norm.weight[...][1])
    with pytest.raises(ValueError, match="layer index 2 is outside"):
        model.layer(2)


def _dot_count(config, T=16):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    text = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits).lower(
        state, jax.ShapeDtypeStruct((1, T), jnp.int32)).as_text()
    return len(re.findall(r"stablehlo\.dot_general", text))


def test_one_block_is_compiled_whatever_the_depth():
    base = get_preset("tiny", attention="xla")
    scanned = {n: _dot_count(base.replace(n_layers=n)) for n in (2, 6)}
    unrolled = {n: _dot_count(base.replace(n_layers=n, scan_layers=False)) for n in (2, 6)}
    assert scanned[2] == scanned[6]
    assert unrolled[6] > unrolled[2] >= scanned[2]


def _grad_temporaries(config, T, B=1):
    """Compiled temporary bytes of the gradient of summed log-probs (compile only, nothing runs)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))

    def loss(state, tokens):
        return jnp.sum(sequence_logprobs(nnx.merge(graphdef, state), tokens))

    lowered = jax.jit(jax.grad(loss)).lower(state, jax.ShapeDtypeStruct((B, T), jnp.int32))
    return lowered.compile(FAST_COMPILE).memory_analysis().temp_size_in_bytes


def test_blockwise_attention_and_remat_shrink_compiled_memory():
    deep = get_preset("tiny", n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64,
                      vocab_size=64)
    T = 2048
    mem = {(attn, remat): _grad_temporaries(deep.replace(attention=attn, remat=remat), T)
           for attn, remat in (("xla", "none"), ("blockwise", "none"), ("blockwise", "full"))}
    # xla keeps every layer's [H, T, T] probabilities for the backward; blockwise only O(T) per layer.
    assert mem["xla", "none"] >= 4 * mem["blockwise", "none"], mem
    # remat on the scanned body keeps only each block's input.
    assert mem["blockwise", "none"] >= 2 * mem["blockwise", "full"], mem


def test_attention_field_errors():
    with pytest.raises(ValueError, match=r"ModelConfig.attention='flash'; valid: auto, xla, blockwise, cudnn, splash"):
        get_preset("tiny", attention="flash")
    with pytest.raises(ValueError, match=r"ModelConfig.attention_block_q must be positive"):
        get_preset("tiny", attention_block_q=0)
    tokens = jnp.zeros((1, 8), jnp.int32)
    # cuDNN on a CPU: a clear error when the program is traced.
    model = Decoder(get_preset("tiny", attention="cudnn", compute_dtype="bfloat16"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"ModelConfig.attention='cudnn' needs an NVIDIA GPU"):
        jax.eval_shape(lambda t: model(t).logits, tokens)
    tiny = Decoder(get_preset("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="segment_ids_BxT cannot be combined with a cache"):
        tiny(tokens, segment_ids_BxT=tokens, cache=init_cache(tiny.config, 1, 8))
