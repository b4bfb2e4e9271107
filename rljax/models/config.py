"""Model configuration: one frozen dataclass for the Llama / Qwen2 / Qwen3 family, and presets.

A config is hashable (it is a static argument under `jax.jit`), so the optional
`rope_scaling` dict is stored as a sorted tuple of items; read it back with
`config.rope_scaling_dict()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from rljax.models import attention as attention_lib

REMAT_POLICIES = ("auto", "none", "full", "dots_saveable")
# remat="auto" rematerialises ("full") a forward over at least this many
# tokens (B * T) and saves everything below it: short RL batches keep their
# speed, long ones their memory (smollm2-135m at T = 16k: 28 GiB of
# temporaries without remat, 2.3 GiB with; experiments/bench/long_context.py).
AUTO_REMAT_MIN_TOKENS = 4096
ATTENTION_IMPLEMENTATIONS = attention_lib.IMPLEMENTATIONS
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _dtype_name(dtype: Any) -> str:
    name = jnp.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; valid: {sorted(_DTYPES)}")
    return name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer.

    Attributes:
        vocab_size: rows of the embedding (and columns of the unembedding).
        d_model: residual stream width D.
        n_layers: number of decoder blocks L.
        n_heads: query heads H.
        n_kv_heads: key/value heads (grouped-query attention; H % n_kv_heads == 0).
        head_dim: per-head width (Qwen3 decouples it from d_model / n_heads).
        mlp_dim: SwiGLU hidden width of the dense MLP.
        rope_theta: RoPE base frequency.
        rope_scaling: None or a dict in Hugging Face form, e.g.
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}.
        rms_eps: RMSNorm epsilon.
        tie_embeddings: unembed with the transposed input embedding.
        qkv_bias: Qwen2-style biases on the q/k/v projections.
        qk_norm: Qwen3-style per-head RMSNorm on queries and keys (before RoPE).
        n_experts: 0 for a dense MLP, else the number of experts E of every MLP.
        experts_per_token: top-k of the router.
        moe_mlp_dim: hidden width of each expert (defaults to mlp_dim).
        param_dtype: storage dtype of parameters ("float32" or "bfloat16").
        compute_dtype: activation / matmul dtype ("bfloat16" on accelerators).
            Norms, softmaxes and the final log-softmax always run in float32.
        remat: rematerialisation of each decoder block, applied to the body of
            the scan over layers: "none", "full" (save only each block's
            input), "dots_saveable" (save matmul outputs) or "auto" ("full"
            for a forward over at least AUTO_REMAT_MIN_TOKENS tokens, else
            "none").
        max_seq_len: longest position the model is meant to see (KV cache size).
        attention: "auto", "xla", "blockwise", "cudnn" or "splash"; see
            rljax.models.attention (auto: splash on TPU, cuDNN on NVIDIA GPUs,
            blockwise for long sequences elsewhere, xla for short ones).
        attention_block_q, attention_block_kv: query / key tile sizes of the
            blockwise and splash kernels.
        scan_layers: run the blocks under one `lax.scan` over the stacked layer
            axis (compiles once per model, and remat takes effect); False
            unrolls a Python loop over the same stacked parameters.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: Any = None
    rms_eps: float = 1e-6
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    n_experts: int = 0
    experts_per_token: int = 2
    moe_mlp_dim: int | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "auto"
    max_seq_len: int = 2048
    attention: str = "auto"
    attention_block_q: int = 512
    attention_block_kv: int = 512
    scan_layers: bool = True

    def __post_init__(self):
        # Normalise so that equal configs hash equally (jit static argument).
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype))
        object.__setattr__(self, "compute_dtype", _dtype_name(self.compute_dtype))
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim",
                     "attention_block_q", "attention_block_kv"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                    f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat={self.remat!r}; valid: {REMAT_POLICIES}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"ModelConfig.attention={self.attention!r}; valid: {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        if self.n_experts < 0 or (self.n_experts and not 0 < self.experts_per_token <= self.n_experts):
            raise ValueError(
                    f"ModelConfig.experts_per_token={self.experts_per_token} must be in [1, n_experts={self.n_experts}]")
        rope_type = self.rope_scaling_dict().get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"ModelConfig.rope_scaling rope_type={rope_type!r}; valid: {ROPE_TYPES}")

    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling) if self.rope_scaling else {}

    @property
    def param_jnp_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def compute_jnp_dtype(self):
        return _DTYPES[self.compute_dtype]

    @property
    def expert_mlp_dim(self) -> int:
        return self.moe_mlp_dim or self.mlp_dim

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def replace(self, **overrides) -> ModelConfig:
        return dataclasses.replace(self, **overrides)


_PRESETS: dict[str, ModelConfig] = {
        # Test sizes: compile in a second on CPU.
        "tiny": ModelConfig(
                vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
                max_seq_len=256),
        "tiny-moe": ModelConfig(
                vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
                n_experts=4, experts_per_token=2, moe_mlp_dim=64, max_seq_len=256),
        # HuggingFaceTB/SmolLM2-135M(-Instruct).
        "smollm2-135m": ModelConfig(
                vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                mlp_dim=1536, rope_theta=100_000.0, rms_eps=1e-5, tie_embeddings=True, max_seq_len=8192),
        # Qwen/Qwen2.5-0.5B(-Instruct).
        "qwen2.5-0.5b": ModelConfig(
                vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                mlp_dim=4864, rope_theta=1_000_000.0, rms_eps=1e-6, tie_embeddings=True, qkv_bias=True,
                max_seq_len=32768),
        # Qwen/Qwen3-0.6B.
        "qwen3-0.6b": ModelConfig(
                vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                mlp_dim=3072, rope_theta=1_000_000.0, rms_eps=1e-6, tie_embeddings=True, qk_norm=True,
                max_seq_len=40960),
}


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def get_preset(name: str, **overrides) -> ModelConfig:
    """The named config, with optional field overrides (e.g. `param_dtype="bfloat16"`)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {', '.join(_PRESETS)}")
    return _PRESETS[name].replace(**overrides) if overrides else _PRESETS[name]
