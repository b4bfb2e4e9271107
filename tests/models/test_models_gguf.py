"""Tiny GGUF files written like llama.cpp's converter load into the checkpoint's logits."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rljax.models.loading import load_pretrained

Q = gguf.GGMLQuantizationType


def _logits(model, tokens):
    return np.asarray(jax.jit(lambda t: model(t).logits)(jnp.asarray(tokens)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_matches_transformers(arch, make_hf_checkpoint, write_gguf):
    _, torch_model = make_hf_checkpoint(arch)
    model, tokenizer = load_pretrained(write_gguf(torch_model, arch))
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 10))
    with torch.no_grad():
        ref = torch_model(torch.tensor(tokens)).logits.numpy()
    # Exact weights: only float32 rounding differs. For llama this checks the Q/K un-permutation.
    assert np.abs(_logits(model, tokens) - ref).max() < 1e-5
    text = "byte-level: héllo!"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode(text)) == len(text.encode())  # no merges: one token per byte


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantised_gguf_dequantises_like_the_gguf_library(qtype, make_hf_checkpoint, write_gguf):
    _, torch_model = make_hf_checkpoint("llama")
    model, _ = load_pretrained(write_gguf(torch_model, "llama", qtype))
    w = torch_model.state_dict()["model.layers.1.mlp.up_proj.weight"].numpy()
    expected = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
    np.testing.assert_array_equal(np.asarray(model.layers.mlp.up[...][1]), expected.T)
    tokens = np.random.default_rng(1).integers(0, 256, size=(1, 8))
    with torch.no_grad():
        ref = torch_model(torch.tensor(tokens)).logits.numpy()
    diff = np.abs(_logits(model, tokens) - ref).max()
    assert 0 < diff < 0.2, diff  # rounded weights: close to the float model, not equal


def test_bfloat16_param_dtype(make_hf_checkpoint, write_gguf):
    _, torch_model = make_hf_checkpoint("qwen3")
    model, _ = load_pretrained(write_gguf(torch_model, "qwen3"), param_dtype="bfloat16")
    assert model.layers.attn.q_norm.weight[...].dtype == jnp.bfloat16
