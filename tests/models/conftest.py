"""Fixtures for the model tests: tiny configs and tiny Hugging Face checkpoints saved by transformers."""

import numpy as np
import pytest

from rljax.models.config import get_preset

TINY_HF = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def _hf_classes(arch):
    import transformers
    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[arch]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads a real checkpoint (about a minute); runs by default")


@pytest.fixture
def tiny_config():
    return get_preset("tiny")


@pytest.fixture
def make_hf_checkpoint(tmp_path):
    """make_hf_checkpoint(arch, **config_overrides) -> (directory, torch model in eval mode).

    Norm weights and biases are perturbed away from their 1 / 0 initial values
    so that a loader that skipped them would fail the comparison.
    """
    import torch

    def make(arch, subdir=None, **overrides):
        config_cls, model_cls = _hf_classes(arch)
        torch.manual_seed(0)
        kwargs = dict(TINY_HF, tie_word_embeddings=arch != "llama")
        kwargs.update(overrides)
        model = model_cls(config_cls(**kwargs)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or "bias" in name:
                    p.add_(torch.randn_like(p) * 0.1)
        directory = tmp_path / (subdir or arch)
        model.save_pretrained(directory)
        return directory, model

    return make


def _llama_cpp_permute(w, n_heads):
    """llama.cpp's converter: each head's rows (2, head_dim/2) -> (head_dim/2, 2), interleaving RoPE pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture
def write_gguf(tmp_path):
    """write_gguf(torch_model, arch, qtype=F32, name=...) -> path of a GGUF holding the model's weights.

    Written with gguf.GGUFWriter the way llama.cpp's converter lays it out
    (names, metadata, Q/K permutation for llama); 2-D weights use `qtype`, norms
    stay F32. The tokenizer is a byte-level vocabulary of the 256 byte symbols.
    """
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    def write(torch_model, arch, qtype=None, name="model.gguf"):
        qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
        cfg = torch_model.config
        path = tmp_path / name
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_block_count(cfg.num_hidden_layers)
        writer.add_context_length(cfg.max_position_embeddings)
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count(cfg.num_attention_heads)
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(sorted(ByteLevel.alphabet()))
        writer.add_token_types([1] * 256)
        writer.add_token_merges([])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        renames = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
                   "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                   "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
        tied = cfg.tie_word_embeddings
        for hf_name, tensor in torch_model.state_dict().items():
            if tied and hf_name == "lm_head.weight":
                continue
            w = tensor.detach().numpy().astype(np.float32)
            gguf_name = hf_name.replace("model.layers.", "blk.")
            for old, new in renames.items():
                gguf_name = gguf_name.replace(old, new)
            if arch == "llama" and ".attn_q." in gguf_name:
                w = _llama_cpp_permute(w, cfg.num_attention_heads)
            elif arch == "llama" and ".attn_k." in gguf_name:
                w = _llama_cpp_permute(w, cfg.num_key_value_heads)
            if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
                writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, w)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    return write
