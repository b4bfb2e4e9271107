"""Attention kernels: blockwise == xla (values, gradients), masks, bf16, numerical gradients, selection, kernels' arguments."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from rljax.models import attention as attention_lib
from rljax.models.attention import attention

jax.config.update("jax_numpy_rank_promotion", "raise")

B, T = 2, 37  # T is no multiple of the blocks below: padding of queries and keys is exercised


def _qkv(heads, kv_heads, seed=0, length=T, head_dim=8):
    rng = np.random.default_rng(seed)  # numpy: no compiled RNG programs per shape
    return tuple(jnp.asarray(rng.normal(size=(B, length, n, head_dim)), jnp.float32)
                 for n in (heads, kv_heads, kv_heads))


def _masks(case, length=T):
    """(segment ids, valid keys) [B, length]: every case passes arrays, so one compiled program serves all."""
    idx = np.arange(length)
    seg = np.zeros((B, length), np.int32)
    valid = np.ones((B, length), bool)
    if case == "padded":  # row 0 full, row 1 right-padded after 23 tokens
        valid[1] = idx < 23
    elif case == "packed":
        # Row 0 packs segments of 11 and 26 tokens, row 1 of 20 and 9, then 8 padding tokens in a segment of their own.
        seg[0] = np.where(idx < 11, 0, 1)
        seg[1] = np.where(idx < 20, 0, np.where(idx < 29, 1, 2))
        valid[1] = idx < 29
    return {"q_segment_ids_BxT": jnp.asarray(seg), "kv_segment_ids_BxS": jnp.asarray(seg),
            "kv_valid_BxS": jnp.asarray(valid)}


CASES = [("causal", 4, 4), ("padded", 4, 4), ("gqa", 6, 2), ("packed", 6, 2)]
BLOCKS = dict(block_q=8, block_kv=4)


def _loss_and_grads(impl, q, k, v, masks):
    def loss(q, k, v):
        out = attention(q, k, v, implementation=impl, **BLOCKS, **masks)
        # A non-linear read-out, so every output element gets its own cotangent.
        return jnp.sum(jnp.sin(out.astype(jnp.float32)) * jnp.arange(out.shape[-1])[None, None, None]), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, grads


_STEPS = {impl: jax.jit(lambda q, k, v, masks, impl=impl: _loss_and_grads(impl, q, k, v, masks))
          for impl in ("xla", "blockwise")}


@pytest.mark.parametrize("case,heads,kv_heads", CASES, ids=[c[0] for c in CASES])
def test_blockwise_equals_xla_in_values_and_gradients(case, heads, kv_heads):
    q, k, v = _qkv(heads, kv_heads)
    masks = _masks(case)
    ref, ref_grads = _STEPS["xla"](q, k, v, masks)
    out, grads = _STEPS["blockwise"](q, k, v, masks)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    for name, g, g_ref in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, g_ref, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")
    if case in ("padded", "packed"):  # the masks really act (else this would test plain causal attention)
        assert not np.allclose(_STEPS["xla"](q, k, v, _masks("causal"))[0], ref, atol=1e-3)


def test_blockwise_and_xla_are_different_programs():
    q, k, v = _qkv(4, 2)
    jaxprs = {impl: str(jax.make_jaxpr(lambda q, impl=impl: attention(q, k, v, implementation=impl, **BLOCKS))(q))
              for impl in ("xla", "blockwise")}
    # Blockwise runs loops over blocks under a custom VJP; xla is one einsum over [B, H, T, S].
    assert "custom_vjp" in jaxprs["blockwise"] and "while" in jaxprs["blockwise"]
    assert "custom_vjp" not in jaxprs["xla"] and "while" not in jaxprs["xla"]


def test_segments_and_padding_follow_the_rule():
    """Golden: with v = one-hot of the key index, output row i is the attention distribution over keys."""
    length, heads = 12, 2
    # Zero queries and keys: equal scores, so uniform weights over the visible keys.
    q, k = jnp.zeros((1, length, heads, length)), jnp.zeros((1, length, 1, length))
    v = jnp.eye(length)[None, :, None, :]  # value of key j = e_j (head_dim = S)
    seg = jnp.asarray(np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]], np.int32))
    valid = jnp.asarray(np.array([[True] * 9 + [False] * 3]))
    for impl in ("xla", "blockwise"):
        out = jax.jit(lambda q, k, v, impl=impl: attention(
            q, k, v, q_segment_ids_BxT=seg, kv_segment_ids_BxS=seg, kv_valid_BxS=valid, implementation=impl,
            block_q=4, block_kv=4))(q, k, v)
        out = np.asarray(out)[0, :, 0]
        # Query 4 (segment 1, keys 3..4 visible): 1/2 on keys 3 and 4.
        np.testing.assert_allclose(out[4], [0, 0, 0, .5, .5, 0, 0, 0, 0, 0, 0, 0], atol=1e-6)
        # Query 8 (segment 2, keys 7..8 real): 1/2 each; padding keys 9..11 are never seen.
        np.testing.assert_allclose(out[8], [0] * 7 + [.5, .5, 0, 0, 0], atol=1e-6)
        # Query 10 is padding but still sees the real keys of its segment before it.
        np.testing.assert_allclose(out[10], [0] * 7 + [.5, .5, 0, 0, 0], atol=1e-6)
        np.testing.assert_allclose(out[0], np.eye(length)[0], atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_rows_that_see_nothing_are_zero_with_zero_gradient(impl):
    q, k, v = _qkv(4, 2)
    valid = jnp.asarray(np.broadcast_to(np.arange(T) >= 5, (B, T)))  # keys 0..4 are padding: queries 0..4 see none

    def loss(q, k, v):
        out = attention(q, k, v, kv_valid_BxS=valid, implementation=impl, **BLOCKS)
        return jnp.sum(out ** 2), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    np.testing.assert_array_equal(out[:, :5], 0.0)
    np.testing.assert_array_equal(grads[0][:, :5], 0.0)  # those queries get no gradient
    np.testing.assert_array_equal(grads[1][:, :5], 0.0)  # nor do the padding keys and values
    np.testing.assert_array_equal(grads[2][:, :5], 0.0)
    assert float(jnp.abs(grads[0][:, 5:]).max()) > 0


def test_blockwise_bfloat16_is_as_accurate_as_xla_bfloat16():
    """Stated tolerance, against float32: blockwise in bfloat16 errs at most 2x as much as xla in bfloat16
    (+1e-2), outputs by < 0.05 absolute and gradients by < 5% of their largest entry."""
    q, k, v = _qkv(6, 2, seed=3)
    masks = _masks("packed")
    exact, exact_grads = _STEPS["xla"](q, k, v, masks)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    errors, grad_errors = {}, {}
    for impl in ("xla", "blockwise"):
        out, grads = _STEPS[impl](*bf, masks)
        assert out.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
        errors[impl] = float(jnp.abs(out.astype(jnp.float32) - exact).max())
        grad_errors[impl] = max(float(jnp.abs(g.astype(jnp.float32) - r).max() / jnp.abs(r).max())
                                for g, r in zip(grads, exact_grads))
    assert 0 < errors["blockwise"] <= 2 * errors["xla"] + 1e-2 and errors["blockwise"] < 0.05, errors
    assert grad_errors["blockwise"] <= 2 * grad_errors["xla"] + 1e-2 and grad_errors["blockwise"] < 0.05, grad_errors


def test_blockwise_numerical_gradients():
    q, k, v = _qkv(4, 2, length=9, head_dim=4, seed=5)
    seg = jnp.asarray(np.array([[0] * 4 + [1] * 5, [0] * 9], np.int32))
    valid = jnp.asarray(np.array([[True] * 9, [True] * 6 + [False] * 3]))

    @jax.jit
    def f(q, k, v):
        return attention(q, k, v, q_segment_ids_BxT=seg, kv_segment_ids_BxS=seg, kv_valid_BxS=valid,
                         implementation="blockwise", block_q=4, block_kv=2)

    # Reverse mode only: the custom VJP defines no JVP.
    check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-3)


def test_cache_positions_match_index_order():
    """Causality by explicit positions (a KV cache) equals row order when the positions are the row indices."""
    q, k, v = _qkv(6, 2)
    pos = jnp.asarray(np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)))
    by_index = _STEPS["blockwise"](q, k, v, _masks("causal"))[0]

    @jax.jit
    def by_positions(q, k, v, q_pos):
        return attention(q, k, v, q_positions_BxT=q_pos, kv_positions_BxS=pos, implementation="blockwise", **BLOCKS)

    np.testing.assert_allclose(by_positions(q, k, v, pos), by_index, atol=1e-6)
    # Queries at later positions than their rows see more keys.
    assert not np.allclose(by_positions(q, k, v, pos + 3), by_index, atol=1e-3)


# ----------------------------------------------------------------------------
# Choosing an implementation.


def test_auto_choice_per_backend_and_errors():
    choose = attention_lib.choose
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert choose("auto", q_len=4096, dtype=f32, head_dim=64, backend="tpu") == "splash"
    assert choose("auto", q_len=4096, dtype=bf16, head_dim=64, backend="nvidia") == "cudnn"
    # cuDNN has no float32 flash attention and no segment ids: blockwise for long rows, xla for short.
    assert choose("auto", q_len=4096, dtype=f32, head_dim=64, backend="nvidia") == "blockwise"
    assert choose("auto", q_len=4096, dtype=bf16, head_dim=64, segments=True, backend="nvidia") == "blockwise"
    assert choose("auto", q_len=256, dtype=bf16, head_dim=256, backend="nvidia") == "xla"
    assert choose("auto", q_len=attention_lib.AUTO_BLOCKWISE_MIN_LEN, dtype=f32, head_dim=64, backend="cpu") == \
        "blockwise"
    assert choose("auto", q_len=attention_lib.AUTO_BLOCKWISE_MIN_LEN - 1, dtype=f32, head_dim=64,
                  backend="cpu") == "xla"
    # Over a KV cache the kernels cannot be used.
    assert choose("auto", q_len=2048, dtype=bf16, head_dim=64, positions=True, backend="tpu") == "blockwise"
    assert choose("blockwise", q_len=8, dtype=f32, head_dim=64, backend="cpu") == "blockwise"
    with pytest.raises(ValueError, match=r"ModelConfig.attention='cudnn' needs an NVIDIA GPU .*backend is 'cpu'"):
        choose("cudnn", q_len=8, dtype=bf16, head_dim=64, backend="cpu", field="ModelConfig.attention")
    with pytest.raises(ValueError, match=r"attention='cudnn' needs compute_dtype bfloat16 or float16"):
        choose("cudnn", q_len=8, dtype=f32, head_dim=64, backend="nvidia", field="attention")
    with pytest.raises(ValueError, match=r"'cudnn' takes no segment ids"):
        choose("cudnn", q_len=8, dtype=bf16, head_dim=64, segments=True, backend="nvidia")
    with pytest.raises(ValueError, match=r"implementation='splash' needs a TPU"):
        choose("splash", q_len=8, dtype=bf16, head_dim=64, backend="nvidia")
    with pytest.raises(ValueError, match=r"implementation='flash'; valid: auto, xla, blockwise, cudnn, splash"):
        choose("flash", q_len=8, dtype=f32, head_dim=64, backend="cpu")
    # This machine: explicit kernels fail at trace time, naming the field.
    q, k, v = _qkv(4, 2)
    with pytest.raises(ValueError, match=r"implementation='splash' needs a TPU"):
        attention(q, k, v, implementation="splash")


def test_each_distinct_choice_is_logged_once(caplog):
    attention_lib._logged.clear()
    with caplog.at_level(logging.INFO, logger="rljax.models"):
        for _ in range(3):
            attention_lib.choose("auto", q_len=2048, dtype=jnp.float32, head_dim=64, backend="cpu")
        attention_lib.choose("auto", q_len=16, dtype=jnp.float32, head_dim=64, backend="cpu")
        attention_lib.choose("auto", q_len=32, dtype=jnp.float32, head_dim=64, backend="cpu")  # same choice
    messages = [r.getMessage() for r in caplog.records if r.name == "rljax.models"]
    assert messages == ["attention implementation: blockwise (auto on cpu, >= 1024 queries)",
                        "attention implementation: xla (auto on cpu, < 1024 queries)"]


# ----------------------------------------------------------------------------
# Accelerator kernels, run where they can be: cuDNN's arguments through JAX's
# own reference of the same API, splash in the Pallas interpreter.


def test_cudnn_arguments_give_the_rule_through_the_reference_sdpa():
    q, k, v = _qkv(6, 2)  # grouped-query heads, passed without repeating K/V
    masks = _masks("padded")
    ref = _STEPS["xla"](q, k, v, masks)[0]
    got = jax.jit(lambda q, k, v: attention_lib.cudnn_attention(
        q, k, v, kv_valid_BxS=masks["kv_valid_BxS"], sdpa_implementation="xla"))(q, k, v)
    np.testing.assert_allclose(got, ref, atol=1e-5)
    assert not np.allclose(_STEPS["xla"](q, k, v, _masks("causal"))[0], ref, atol=1e-3)


def test_splash_kernel_in_the_interpreter_matches_xla():
    length = 100  # padded to one 128 block inside
    q, k, v = _qkv(2, 1, length=length, head_dim=64, seed=7)
    idx = np.arange(length)
    seg = jnp.asarray(np.stack([np.where(idx < 40, 0, 1), np.zeros(length)]).astype(np.int32))
    valid = jnp.asarray(np.stack([np.ones(length, bool), idx < 70]))
    masks = dict(q_segment_ids_BxT=seg, kv_segment_ids_BxS=seg, kv_valid_BxS=valid)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)

    splash = jax.jit(lambda q, k, v: attention_lib.splash_attention(q, k, v, interpret=True, **masks))
    xla = jax.jit(lambda q, k, v: attention(q, k, v, implementation="xla", **masks))
    np.testing.assert_allclose(splash(q, k, v), xla(q, k, v), atol=1e-5)
    grads = jax.jit(jax.grad(loss(splash), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.grad(loss(xla), argnums=(0, 1, 2))(q, k, v)
    for g, g_ref in zip(grads, ref):
        np.testing.assert_allclose(g, g_ref, atol=1e-4, rtol=1e-4)
