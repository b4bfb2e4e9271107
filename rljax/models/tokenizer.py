"""Tokenizers: a `tokenizers.Tokenizer` with special-token ids and a jinja2 chat template.

Built from GGUF metadata (byte-level BPE, llama.cpp's pre-tokenizer types) or a
Hugging Face directory (tokenizer.json, tokenizer_config.json); see
rljax.models.loading for where they come from.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

# Split patterns of llama.cpp's pre-tokenizer types, applied before the
# byte-level mapping (the merges were learned on pieces split this way).
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# StarCoder-style vocabularies (SmolLM2) split every digit on its own first.
_DIGIT_FIRST_PRE = ("smollm", "starcoder", "refact", "codeshell")


def byte_level_pre_tokenizer(pre: str):
    """The pre-tokenizer of llama.cpp's `tokenizer.ggml.pre` type `pre`, then the byte-level mapping."""
    pt = tokenizers.pre_tokenizers
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
             "deepseek-r1-qwen": _QWEN2_SPLIT}.get(pre)
    if split is not None:
        return pt.Sequence([pt.Split(tokenizers.Regex(split), behavior="isolated"),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    steps = [pt.Digits(individual_digits=True)] if pre in _DIGIT_FIRST_PRE else []
    # ByteLevel's built-in regex is GPT-2's, which llama.cpp's "gpt2"/"default" use.
    return pt.Sequence(steps + [pt.ByteLevel(add_prefix_space=False, use_regex=True)])


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """A `tokenizers.Tokenizer` with special-token ids and a jinja2 chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_id: int | None, pad_token_id: int | None = None,
                 chat_template: str | None = None, add_bos_token: bool = False):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = eos_token_id if pad_token_id is None else pad_token_id
        self.chat_template = chat_template
        # When the vocabulary wants a BOS but tokenizer.json has no post-processor for it.
        self.add_bos_token = add_bos_token

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds the vocabulary's BOS if it uses one."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and (
                not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """Render `messages` ([{"role", "content"}, ...]) with the model's jinja2 template.

        The environment matches Hugging Face's (trim_blocks, lstrip_blocks,
        loop controls, `raise_exception`, `tojson`), so their templates render
        the same text.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (none in the GGUF metadata or tokenizer_config.json)")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_exception
        template = env.from_string(self.chat_template)
        return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def save(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (Hugging Face layout)."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                  "pad_token": self._token(self.pad_token_id), "add_bos_token": self.add_bos_token}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> Tokenizer:
        """From a Hugging Face directory: tokenizer.json (+ tokenizer_config.json, chat_template.jinja)."""
        directory = pathlib.Path(directory)
        path = directory / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {directory}; load the weights alone with load_model()")
        backend = tokenizers.Tokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}

        def token_id(key):
            token = config.get(key)
            if isinstance(token, Mapping):
                token = token.get("content")
            return None if token is None else backend.token_to_id(token)

        template = config.get("chat_template")
        if (directory / "chat_template.jinja").exists():
            template = (directory / "chat_template.jinja").read_text()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   pad_token_id=token_id("pad_token"), chat_template=template,
                   add_bos_token=bool(config.get("add_bos_token", False)))
