"""Chunked token log-probs equal the full-logits ones in values and gradients, and use far less memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.models.config import get_preset
from rljax.models.logprobs import sequence_logprobs, token_logprobs, token_logprobs_full
from rljax.models.transformer import Decoder

B, T, D, V = 3, 13, 16, 50


def _inputs(seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k1, (B, T, D)), jax.random.normal(k2, (V, D)),
            jax.random.randint(k3, (B, T), 0, V))


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("chunk_size", [1, 7, 39, 1000])  # 39 = B*T divides; 7 pads; 1000 > B*T
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_values(chunk_size, temperature, jit):
    h, w, y = _inputs()
    chunked = functools.partial(token_logprobs, chunk_size=chunk_size, temperature=temperature, return_entropy=True)
    full = functools.partial(token_logprobs_full, temperature=temperature, return_entropy=True)
    if jit:
        chunked, full = jax.jit(chunked), jax.jit(full)
    logp, ent = chunked(h, w, y)
    ref_logp, ref_ent = full(h, w, y)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=1e-5)
    # Independent golden: log_softmax of the explicit logits.
    logits = np.einsum("btd,vd->btv", np.asarray(h, np.float64), np.asarray(w, np.float64)) / temperature
    logits -= logits.max(-1, keepdims=True)
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(logp, np.take_along_axis(log_softmax, np.asarray(y)[..., None], -1)[..., 0],
                               atol=1e-5)
    np.testing.assert_allclose(ent, -(np.exp(log_softmax) * log_softmax).sum(-1), atol=1e-5)


@pytest.mark.parametrize("chunk_size", [4, 39])
def test_chunked_equals_full_gradients(chunk_size):
    h, w, y = _inputs(1)
    weights = jax.random.normal(jax.random.key(2), (B, T))

    def loss(fn, h, w):
        logp, ent = fn(h, w, y, temperature=0.9, return_entropy=True)
        return jnp.sum(weights * logp) + 0.3 * jnp.sum(ent)

    grad = jax.jit(jax.grad(functools.partial(loss, functools.partial(token_logprobs, chunk_size=chunk_size)),
                            argnums=(0, 1)))(h, w)
    ref = jax.jit(jax.grad(functools.partial(loss, token_logprobs_full), argnums=(0, 1)))(h, w)
    for g, r in zip(grad, ref):
        assert float(jnp.abs(r).max()) > 1e-2  # a real gradient, not zeros on both sides
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)


def test_sequence_logprobs_alignment():
    model = Decoder(get_preset("tiny"), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, 256)
    seq = functools.partial(sequence_logprobs, temperature=1.3, chunk_size=5, return_entropy=True)
    logp, ent = nnx.jit(seq)(model, tokens)
    log_softmax = jax.nn.log_softmax(nnx.jit(lambda m, t: m(t).logits)(model, tokens) / 1.3, axis=-1)
    # logp[b, t] = log p(tokens[b, t] | tokens[b, :t]) comes from position t - 1; position 0 is 0.
    expected = jnp.take_along_axis(log_softmax[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(logp[:, 1:], expected, atol=1e-5)
    np.testing.assert_array_equal(logp[:, 0], 0.0)
    np.testing.assert_allclose(ent[:, 1:], -jnp.sum(jnp.exp(log_softmax) * log_softmax, -1)[:, :-1], atol=1e-5)
    np.testing.assert_array_equal(ent[:, 0], 0.0)


def test_chunked_memory_is_much_lower():
    """XLA's compiled temp memory of forward+backward, at a size that compiles in a second."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "experiments" / "bench" / "logprob_memory.py"
    spec = importlib.util.spec_from_file_location("logprob_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = dict(batch=4, seq=1024, d_model=64, vocab=8192)
    full = bench.temp_bytes("full", **shape)
    chunked = bench.temp_bytes("chunked", **shape, chunk_size=128)
    # Full logits in float32 alone are 4*1024*8192*4 bytes = 128 MiB.
    assert full >= 4 * 1024 * 8192 * 4
    assert full / chunked >= 8, (full, chunked)


def test_bad_shapes_fail_at_the_boundary():
    h, w, y = _inputs()
    with pytest.raises(AssertionError):
        token_logprobs(h, w[:, :-1], y)
    with pytest.raises(AssertionError):
        token_logprobs(h, w, y[:, :-1])
