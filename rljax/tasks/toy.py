"""A toy task and a character tokenizer for tiny models trained from scratch.

The prompt is a short string of letters followed by "=", e.g. ``"cab="``;
the model should answer ``"cab"`` (``toy_copy``) or ``"bac"``
(``toy_reverse``). The reward is the fraction of positions right, so a random
policy already gets signal and a tiny transformer learns within minutes on a
CPU. ``task.tokenizer()`` gives a ``CharTokenizer`` over exactly the task's
characters, so the whole toy pipeline needs no pretrained tokenizer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from rljax.tasks.base import Example, Task

_SPECIALS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    """One token per character, after three special tokens.

    Ids: 0 = pad, 1 = bos, 2 = eos, then ``chars`` in order. Enough of the
    Hugging Face tokenizer surface (``encode``, ``decode``,
    ``apply_chat_template``, the special-token ids) for the trainer.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    pad_token, bos_token, eos_token = _SPECIALS

    def __init__(self, chars: str):
        if not chars or len(set(chars)) != len(chars):
            raise ValueError(
                f"CharTokenizer: chars must be non-empty and distinct, got "
                f"{chars!r}")
        self.chars = chars
        self._id_of = {c: i + len(_SPECIALS) for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(_SPECIALS) + len(self.chars)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Ids of ``text``; raises ValueError naming any unknown character.

        The special tokens' own strings ("<eos>", ...) encode to their ids, as
        in Hugging Face tokenizers, so a rendered conversation re-encodes to
        the tokens that were sampled.
        """
        ids = []
        for piece in re.split("(" + "|".join(map(re.escape, _SPECIALS)) + ")", text):
            if piece in _SPECIALS:
                ids.append(_SPECIALS.index(piece))
                continue
            unknown = sorted(set(piece) - set(self._id_of))
            if unknown:
                raise ValueError(
                    f"CharTokenizer: characters {unknown!r} are not in the "
                    f"vocabulary {self.chars!r}")
            ids += [self._id_of[c] for c in piece]
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped (or shown as <eos>...)."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"CharTokenizer: id {i} outside [0, {self.vocab_size})")
            if i < len(_SPECIALS):
                if not skip_special_tokens:
                    out.append(_SPECIALS[i])
            else:
                out.append(self.chars[i - len(_SPECIALS)])
        return "".join(out)

    def batch_decode(self, batch: Sequence[Sequence[int]],
                     skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def apply_chat_template(self, messages: Sequence[dict],
                            add_generation_prompt: bool = True,
                            tokenize: bool = False):
        """The messages' contents concatenated; an assistant turn ends in "<eos>".

        ``add_generation_prompt`` is accepted for compatibility and changes
        nothing: toy prompts end with their own "=" cue. Closing assistant
        turns with the EOS the model sampled keeps a re-rendered conversation
        an exact token extension of what was generated (multi-turn rows).
        With ``tokenize`` the ids are returned instead of the text.
        """
        del add_generation_prompt
        text = "".join(m["content"] + (_SPECIALS[2] if m.get("role") == "assistant" else "")
                       for m in messages)
        return self.encode(text) if tokenize else text


def position_reward(completion: str, answer: str) -> float:
    """Fraction of positions right: matches / max(len(answer), len(output)).

    Whitespace around the completion is stripped first. Dividing by the
    longer length makes extra characters cost as much as wrong ones, so only
    the exact answer scores 1.0; an empty answer region scores 0.0.
    """
    output = completion.strip()
    denominator = max(len(answer), len(output))
    if denominator == 0:
        return 0.0
    return sum(a == b for a, b in zip(output, answer)) / denominator


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyCopyTask(Task):
    """Copy (or reverse) a short string; dense reward per position.

    Attributes:
      alphabet: characters of the strings (drawn with replacement).
      min_len, max_len: string length, uniform in this range.
      separator: appended to the prompt to cue the answer.
      reverse: answer with the reversed string instead of a copy.
    """

    name = "toy_copy"

    alphabet: str = "abcde"
    min_len: int = 3
    max_len: int = 5
    separator: str = "="
    reverse: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"{self.name}: need 1 <= min_len <= max_len, got "
                f"{self.min_len}, {self.max_len}")
        if (len(self.separator) != 1 or self.separator in self.alphabet
                or not self.alphabet or len(set(self.alphabet)) != len(
                    self.alphabet) or any(c.isspace() for c in self.alphabet)):
            raise ValueError(
                f"{self.name}: need distinct non-space alphabet characters "
                f"and a one-character separator outside them, got "
                f"{self.alphabet!r}, {self.separator!r}")

    def tokenizer(self) -> CharTokenizer:
        """A tokenizer over exactly this task's characters."""
        return CharTokenizer(self.alphabet + self.separator)

    def _generate(self, rng: np.random.Generator) -> Example:
        length = int(rng.integers(self.min_len, self.max_len + 1))
        text = "".join(rng.choice(list(self.alphabet), size=length))
        return Example(
            prompt=text + self.separator,
            answer=text[::-1] if self.reverse else text,
            meta={"text": text})

    def _reward(self, completion: str, example: Example) -> float:
        return position_reward(completion, example.answer)

    def reward_rule(self) -> str:
        target = "reversed string" if self.reverse else "string"
        return (f"fraction of positions where the stripped completion matches "
                f"the {target}, divided by the longer of the two lengths "
                f"(1.0 only for the exact answer)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToyReverseTask(ToyCopyTask):
    """``ToyCopyTask`` answering with the reversed string."""

    name = "toy_reverse"

    reverse: bool = True
