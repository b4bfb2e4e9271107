"""Fixtures for the model tests: tiny configs and tiny Hugging Face checkpoints saved by transformers."""

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
