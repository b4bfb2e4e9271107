"""Tiny random Llama / Qwen2 / Qwen3 checkpoints saved by transformers load into the same logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rljax.models.loading import load_model


def _compare(directory, torch_model, *, padded=True, **load_kwargs):
    model = load_model(directory, **load_kwargs)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(2, 12))
    lengths = np.array([12, 7]) if padded else np.array([12, 12])
    mask = np.arange(12)[None, :] < lengths[:, None]
    with torch.no_grad():
        ref = torch_model(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64))).logits.numpy()
    got = np.asarray(jax.jit(lambda t, m: model(t, attn_mask_BxT=m).logits)(jnp.asarray(tokens), jnp.asarray(mask)))
    diff = max(np.abs(got[b, :lengths[b]] - ref[b, :lengths[b]]).max() for b in range(2))
    return model, diff


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_checkpoint_logits_match_transformers(arch, make_hf_checkpoint):
    directory, torch_model = make_hf_checkpoint(arch)
    model, diff = _compare(directory, torch_model)
    assert diff < 1e-5
    c = model.config
    assert (c.qkv_bias, c.qk_norm, c.tie_embeddings) == {
        "llama": (False, False, False), "qwen2": (True, False, True), "qwen3": (False, True, True)}[arch]


def test_llama3_rope_scaling_and_sharded_checkpoint(make_hf_checkpoint, tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8, "rope_theta": 500000.0}
    directory, torch_model = make_hf_checkpoint("llama", rope_parameters=scaling)
    sharded = tmp_path / "sharded"
    torch_model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    model, diff = _compare(sharded, torch_model)
    assert diff < 1e-5
    assert model.config.rope_scaling_dict()["rope_type"] == "llama3" and model.config.rope_theta == 500000.0


def test_param_dtype_is_applied(make_hf_checkpoint):
    directory, torch_model = make_hf_checkpoint("qwen2")
    model, diff = _compare(directory, torch_model, param_dtype="bfloat16")
    assert model.embed[...].dtype == jnp.bfloat16
    assert model.layers.attn.q_bias[...].dtype == jnp.bfloat16
    assert 1e-5 < diff < 0.1  # rounded weights: close, not equal


def test_tiny_qwen3_moe_logits_and_routing_match_transformers(make_hf_checkpoint):
    directory, torch_model = make_hf_checkpoint(
        "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[])
    with torch.no_grad():  # a router with spread-out choices, so top-k selection really matters
        for layer in torch_model.model.layers:
            layer.mlp.gate.weight.mul_(50.0)
    torch_model.save_pretrained(directory)
    model, diff = _compare(directory, torch_model, padded=False)
    assert model.config.n_experts == 4 and model.config.experts_per_token == 2 and model.config.qk_norm
    assert diff < 1e-4
