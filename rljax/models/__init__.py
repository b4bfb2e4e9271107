"""Flax NNX decoder (Llama / Qwen family, MoE; layers under one scan), attention kernels (rljax.models.attention),
chunked token log-probs, value head, weight and tokenizer loading."""

from rljax.models.config import ModelConfig, get_preset, preset_names
from rljax.models.loading import config_from_hf, default_gguf_path, load_model, load_pretrained, load_tokenizer
from rljax.models.logprobs import sequence_logprobs, token_logprobs, token_logprobs_full
from rljax.models.tokenizer import Tokenizer
from rljax.models.transformer import Decoder, DecoderOutput, KVCache, init_cache
from rljax.models.value import ValueModel

__all__ = [
    "Decoder",
    "DecoderOutput",
    "KVCache",
    "ModelConfig",
    "Tokenizer",
    "ValueModel",
    "config_from_hf",
    "default_gguf_path",
    "get_preset",
    "init_cache",
    "load_model",
    "load_pretrained",
    "load_tokenizer",
    "preset_names",
    "sequence_logprobs",
    "token_logprobs",
    "token_logprobs_full",
]
