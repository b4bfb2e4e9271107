"""rljax tokenizers as Hugging Face tokenizer directories, and a fingerprint to compare two of them.

`save_hf_tokenizer(tokenizer, directory)` writes `tokenizer.json`,
`tokenizer_config.json` (special tokens, the chat template) and
`special_tokens_map.json`, such that

    hf = transformers.AutoTokenizer.from_pretrained(directory)
    hf.encode(text, add_special_tokens=False) == tokenizer.encode(text)
    hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        == tokenizer.apply_chat_template(messages, add_generation_prompt=True)

(decode too, with and without skip_special_tokens). Harnesses that tokenize
on their side (verifiers, anything on `/inference/v1/generate`) then see
exactly the ids the trainer and the server use. Two kinds are supported:

- `rljax.models.Tokenizer` (GGUF or Hugging Face vocabularies): its
  `tokenizers` backend as is; a vocabulary that wants a BOS but has no
  post-processor for it gets one, so `encode(text)` adds it as rljax's
  `encode(text, add_special_tokens=True)` does.
- `rljax.tasks.toy.CharTokenizer`: a word-level vocabulary over single
  characters (`<pad>`, `<bos>`, `<eos>` special), fused on decode, and a
  template that concatenates contents and closes assistant turns with EOS.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any

import tokenizers

# CharTokenizer.apply_chat_template as a template: contents in order, an
# assistant turn closed by the EOS; add_generation_prompt changes nothing.
CHAR_CHAT_TEMPLATE = ("{%- for message in messages -%}{{ message['content'] }}"
                      "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}{%- endfor -%}")


def _char_backend(tokenizer) -> tokenizers.Tokenizer:
    specials = [tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({c: i + len(specials) for i, c in enumerate(tokenizer.chars)})
    # No unknown token: like CharTokenizer, a character outside the vocabulary is an error.
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="\x00<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials])
    return backend


def _backend(tokenizer) -> tuple[tokenizers.Tokenizer, str | None, bool]:
    """(backend, chat template, add_bos_token) of a supported tokenizer."""
    if hasattr(tokenizer, "backend"):  # rljax.models.Tokenizer
        backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())  # a copy we may change
        add_bos = bool(tokenizer.add_bos_token and tokenizer.bos_token_id is not None)
        if add_bos and backend.post_processor is None:
            bos = tokenizer.bos_token
            backend.post_processor = tokenizers.processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)])
        return backend, tokenizer.chat_template, add_bos
    if hasattr(tokenizer, "chars"):  # rljax.tasks.toy.CharTokenizer
        return _char_backend(tokenizer), CHAR_CHAT_TEMPLATE, False
    raise TypeError(f"cannot export a {type(tokenizer).__name__}: expected rljax.models.Tokenizer or "
                    "rljax.tasks.toy.CharTokenizer")


def _token(backend: tokenizers.Tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else backend.id_to_token(int(token_id))


def hf_tokenizer_files(tokenizer, *, model_max_length: int | None = None) -> dict[str, str]:
    """{file name: text} of the Hugging Face tokenizer directory for `tokenizer`."""
    backend, template, add_bos = _backend(tokenizer)
    specials = {"bos_token": _token(backend, tokenizer.bos_token_id),
                "eos_token": _token(backend, tokenizer.eos_token_id),
                "pad_token": _token(backend, getattr(tokenizer, "pad_token_id", None))}
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip, "normalized": t.normalized,
                      "single_word": t.single_word, "special": t.special}
             for i, t in sorted(backend.get_added_tokens_decoder().items())}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "unk_token": None,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        # rljax decodes without the "clean-up" pass that deletes spaces before punctuation.
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
    }
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    if template:
        config["chat_template"] = template
    return {"tokenizer.json": backend.to_str(),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
            "special_tokens_map.json": json.dumps({k: v for k, v in specials.items() if v is not None}, indent=2,
                                                  ensure_ascii=False)}


def save_hf_tokenizer(tokenizer, directory: str | os.PathLike, *, model_max_length: int | None = None
                      ) -> pathlib.Path:
    """Writes `tokenizer` as a Hugging Face tokenizer directory (created if needed); returns it."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in hf_tokenizer_files(tokenizer, model_max_length=model_max_length).items():
        (directory / name).write_text(text, encoding="utf-8")
    return directory


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the exported files: equal exactly when vocabulary, merges, specials and template are."""
    files = hf_tokenizer_files(tokenizer)
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode("utf-8")).hexdigest()


def tokenizer_summary(tokenizer) -> dict[str, Any]:
    """What /v1/models reports about the served tokenizer (and RemoteSampler.check_compatible compares)."""
    out = {"vocab_size": int(tokenizer.vocab_size), "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id, "pad_token_id": getattr(tokenizer, "pad_token_id", None)}
    try:
        out["fingerprint"] = tokenizer_fingerprint(tokenizer)
    except TypeError:  # a tokenizer kind we cannot export: compare the ids only
        out["fingerprint"] = None
    return out
