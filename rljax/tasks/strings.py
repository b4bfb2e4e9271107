"""String tasks: reverse a string of letters, sort a list of words."""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from rljax.tasks.base import Example, Task

# Common lowercase words, all distinct, so every sorted order is unambiguous.
WORDS = tuple("""
apple bread chair dog eagle fish grape house island juice kite lemon
mouse night ocean piano queen river snake table uncle violin water yellow
zebra anchor button candle desert engine forest garden hammer igloo jacket
kettle ladder magnet needle orange pencil rabbit saddle tunnel umbrella
valley window yogurt cloud stone bottle mirror planet rocket tiger wagon
cherry dragon finger guitar helmet insect jungle koala lizard monkey nest
olive pepper quilt robot spoon tomato unicorn velvet walnut basket coffee
""".split())


def strip_reward(completion: str, answer: str) -> float:
    """1.0 iff the completion equals ``answer`` after stripping whitespace."""
    return 1.0 if completion.strip() == answer else 0.0


def word_list_reward(completion: str, answer: str) -> float:
    """1.0 iff the comma-separated items, each stripped, equal ``answer``'s.

    "apple,fig , pear" matches "apple, fig, pear"; a missing, extra or
    reordered word, a different case or a trailing period does not.
    """
    def items(text):
        return [item.strip() for item in text.strip().split(",")]
    return 1.0 if items(completion) == items(answer) else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReverseTask(Task):
    """Reverse a string; reward 1.0 iff exact after stripping whitespace.

    Attributes:
      min_len, max_len: string length, uniform in this range.
      alphabet: characters the string is drawn from (with replacement).
    """

    name = "reverse"

    min_len: int = 5
    max_len: int = 8
    alphabet: str = string.ascii_lowercase

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"reverse: need 1 <= min_len <= max_len, got {self.min_len}, "
                f"{self.max_len}")
        if not self.alphabet or any(c.isspace() or c == '"'
                                    for c in self.alphabet):
            raise ValueError(
                f"reverse: alphabet must be non-empty without whitespace or "
                f"'\"', got {self.alphabet!r}")

    def _generate(self, rng: np.random.Generator) -> Example:
        length = int(rng.integers(self.min_len, self.max_len + 1))
        text = "".join(rng.choice(list(self.alphabet), size=length))
        return Example(
            prompt=(f'Reverse the string "{text}". Answer with just the '
                    f"reversed string."),
            answer=text[::-1],
            meta={"text": text})

    def _reward(self, completion: str, example: Example) -> float:
        return strip_reward(completion, example.answer)

    def reward_rule(self) -> str:
        return ("1.0 iff the completion with leading and trailing whitespace "
                "stripped equals the reversed string exactly, else 0.0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SortTask(Task):
    """Sort distinct words alphabetically; reward 1.0 iff the list is exact.

    Attributes:
      min_words, max_words: list length, uniform in this range.
      words: the vocabulary, sampled without replacement.
    """

    name = "sort"

    min_words: int = 3
    max_words: int = 5
    words: tuple[str, ...] = WORDS

    def __post_init__(self):
        super().__post_init__()
        if not 2 <= self.min_words <= self.max_words <= len(set(self.words)):
            raise ValueError(
                f"sort: need 2 <= min_words <= max_words <= "
                f"{len(set(self.words))} distinct words, got "
                f"{self.min_words}, {self.max_words}")
        if any("," in w or w != w.strip() or not w for w in self.words):
            raise ValueError("sort: words must be non-empty, without commas "
                             "or surrounding whitespace")

    def _generate(self, rng: np.random.Generator) -> Example:
        count = int(rng.integers(self.min_words, self.max_words + 1))
        vocabulary = sorted(set(self.words))
        chosen = [str(w) for w in rng.choice(vocabulary, size=count,
                                             replace=False)]
        return Example(
            prompt=(f"Sort these words in alphabetical order: "
                    f"{', '.join(chosen)}. Answer with just the sorted words, "
                    f"separated by commas."),
            answer=", ".join(sorted(chosen)),
            meta={"words": chosen})

    def _reward(self, completion: str, example: Example) -> float:
        return word_list_reward(completion, example.answer)

    def reward_rule(self) -> str:
        return ("1.0 iff the completion split at commas, each item stripped "
                "of whitespace, equals the alphabetically sorted word list "
                "exactly (case-sensitive), else 0.0")
