"""The task contract: examples, seeded streams, held-out splits, rewards.

A task is a pure function of its config: ``train_example(i)`` and
``eval_split(n)`` depend only on the constructor arguments, so a resumed run
that stores an integer data position sees exactly the examples it would have
seen, and every evaluation of a given config scores the same prompts.

Held-out by construction. Two independent mechanisms keep eval prompts out of
training:

1. Separate random streams: example ``i`` of the train stream is drawn from
      ``SeedSequence([seed, 0, i])`` and of the eval stream from
      ``SeedSequence([seed, 1, i])``.
2. A partition of the prompt space: ``is_eval_prompt(name, prompt)`` hashes the
      prompt text (blake2b, not Python's salted ``hash``) into ``[0, 1)``; the
      prompt belongs to the eval side iff the value is below ``eval_fraction``.
      The train stream redraws (from the same per-index generator, so it stays
      deterministic) until it lands on a train-side prompt; the eval stream keeps
      only eval-side prompts. Since the partition ignores the seed, no training
      run with *any* seed sees an eval prompt of any seed, and the guarantee holds
      for every ``n`` without storing an exclusion set. The eval side for a
   fraction ``f`` contains the eval side for any smaller fraction, so
   evaluating with an ``eval_fraction`` no larger than the training run's
   stays held out; a larger one would not.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import importlib
from typing import Any, Callable, ClassVar, Iterator

import numpy as np

RewardFn = Callable[[str, "Example"], float]

_TRAIN_STREAM = 0
_EVAL_STREAM = 1
# Bounds the redraws of one example; reaching it means the config leaves
# (almost) no prompts on one side of the partition, which is a config error.
_MAX_DRAWS = 10_000


@dataclasses.dataclass(frozen=True)
class Example:
    """One problem.

    Attributes:
        prompt: the user message, exactly as the model should see it.
        answer: the ground truth the reward compares against (JSON-able).
        meta: JSON-able extras (e.g. a known solution); never read by the model.
    """

    prompt: str
    answer: Any = dataclasses.field(hash=False)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)


def stream_rng(seed: int, stream: int, index: int) -> np.random.Generator:
    """The generator for one example: a pure function of (seed, stream, index)."""
    for label, value in (("seed", seed), ("index", index)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{label} must be an int, got {value!r}")
        if value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}")
    entropy = [int(seed), stream, int(index)]
    return np.random.default_rng(np.random.SeedSequence(entropy))


def prompt_hash_unit(name: str, prompt: str) -> float:
    """Maps (task name, prompt) to a stable number in [0, 1)."""
    digest = hashlib.blake2b(f"{name}\x00{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def is_eval_prompt(name: str, prompt: str, eval_fraction: float) -> bool:
    """True iff the prompt lies on the held-out side of the task's partition."""
    return prompt_hash_unit(name, prompt) < eval_fraction


def load_reward_fn(spec: str) -> RewardFn:
    """Imports a reward ``"package.module:function"`` (or ``:Class.attr``).

    The callable must take ``(completion_text, example)`` and return a float.

    Raises:
        ValueError: naming ``spec`` when it is malformed, the module cannot be
            imported, the attribute is missing, or it is not callable.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(
            f"reward function {spec!r} must look like 'package.module:function'")
    module_name, attr_path = spec.split(":")
    if not module_name or not attr_path:
        raise ValueError(
            f"reward function {spec!r} must look like 'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"reward function {spec!r}: cannot import module {module_name!r} "
            f"({err})") from err
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise ValueError(
                f"reward function {spec!r}: module {module_name!r} has no attribute "
                f"{attr_path!r}") from err
    if not callable(obj):
        raise ValueError(f"reward function {spec!r} is not callable: {obj!r}")
    return obj


def _short_repr(value: Any) -> str:
    """repr, except that long sequences (a word list) show only their size."""
    if isinstance(value, (tuple, list)) and len(value) > 8:
        return f"<{len(value)} items>"
    return repr(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task(abc.ABC):
    """Base class: a seeded, infinite train stream and a held-out eval split.

    Subclasses are frozen dataclasses whose fields are their config; they
    implement ``_generate(rng)`` (one random example) and ``_reward``.

    Attributes:
        seed: selects both streams; same seed, same examples.
        eval_fraction: share of the prompt space reserved for evaluation.
        reward_fn: optional ``"module:function"`` (or callable) that replaces the
            task's own reward, e.g. to score arithmetic prompts another way.
    """

    name: ClassVar[str] = "task"
    system_prompt: ClassVar[str | None] = None

    seed: int = 0
    eval_fraction: float = 0.1
    reward_fn: str | Callable[..., float] | None = None

    def __post_init__(self):
        stream_rng(self.seed, 0, 0)  # Validates the seed early.
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(
                f"{self.name}: eval_fraction must be in (0, 1), got "
                f"{self.eval_fraction}")
        if isinstance(self.reward_fn, str):
            load_reward_fn(self.reward_fn)  # Fails at construction, not mid-run.
        elif self.reward_fn is not None and not callable(self.reward_fn):
            raise ValueError(
                f"{self.name}: reward_fn must be 'module:function' or a callable, "
                f"got {self.reward_fn!r}")

    # --- implemented by subclasses -------------------------------------------

    @abc.abstractmethod
    def _generate(self, rng: np.random.Generator) -> Example:
        """Draws one example; must use only ``rng`` for randomness."""

    @abc.abstractmethod
    def _reward(self, completion: str, example: Example) -> float:
        """The task's own exact reward in [0, 1]."""

    @abc.abstractmethod
    def reward_rule(self) -> str:
        """The exact reward rule for this config, in words."""

    # --- the contract --------------------------------------------------------

    def train_example(self, index: int) -> Example:
        """Example ``index`` of the infinite train stream (never an eval prompt)."""
        rng = stream_rng(self.seed, _TRAIN_STREAM, index)
        for _ in range(_MAX_DRAWS):
            example = self._generate(rng)
            if not is_eval_prompt(self.name, example.prompt, self.eval_fraction):
                return example
        raise RuntimeError(
            f"{self.name}: no train-side prompt in {_MAX_DRAWS} draws; lower "
            f"eval_fraction ({self.eval_fraction}) or enlarge the problem space")

    def iter_train(self, start: int = 0) -> Iterator[Example]:
        """Train examples ``start, start + 1, ...``: resume from a data position."""
        index = start
        while True:
            yield self.train_example(index)
            index += 1

    def eval_split(self, n: int) -> list[Example]:
        """The first ``n`` distinct eval-side prompts of the eval stream.

        Prefix-stable: ``eval_split(k) == eval_split(n)[:k]`` for ``k <= n``.
        """
        if n < 0:
            raise ValueError(f"{self.name}: eval split size must be >= 0, got {n}")
        examples, seen = [], set()
        # Budget proportional to the expected draws per kept example.
        budget = int(_MAX_DRAWS + 4 * (n + 1) / self.eval_fraction)
        index = 0
        while len(examples) < n:
            if index >= budget:
                raise ValueError(
                    f"{self.name}: found only {len(examples)} distinct eval prompts "
                    f"in {budget} draws, fewer than the {n} asked for; the problem "
                    f"space is too small for this split (raise eval_fraction or the "
                    f"problem size)")
            example = self._generate(stream_rng(self.seed, _EVAL_STREAM, index))
            index += 1
            if (is_eval_prompt(self.name, example.prompt, self.eval_fraction)
                    and example.prompt not in seen):
                seen.add(example.prompt)
                examples.append(example)
        return examples

    def reward(self, completion: str, example: Example) -> float:
        """Scores a completion; the task's rule unless ``reward_fn`` overrides."""
        if self.reward_fn is None:
            return self._reward(completion, example)
        fn = (load_reward_fn(self.reward_fn) if isinstance(self.reward_fn, str)
                    else self.reward_fn)
        return float(fn(completion, example))

    def stats(self) -> dict[str, float]:
        """Counters for the run's metrics (e.g. skipped data rows, scoring
        timeouts); cumulative since the task was built. None by default."""
        return {}

    def messages(self, example: Example) -> list[dict[str, str]]:
        """Chat messages for ``tokenizer.apply_chat_template``."""
        out = []
        if self.system_prompt is not None:
            out.append({"role": "system", "content": self.system_prompt})
        out.append({"role": "user", "content": example.prompt})
        return out

    def config(self) -> dict[str, Any]:
        """The constructor arguments: enough to rebuild the task exactly."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def describe(self) -> str:
        """Name, config and the exact reward rule, for logs and run directories."""
        args = ", ".join(f"{k}={_short_repr(v)}" for k, v in self.config().items())
        if self.reward_fn is None:
            rule = self.reward_rule()
        else:
            rule = f"reward_fn {self.reward_fn!r} replaces the task reward"
        return f"{self.name}({args})\nreward: {rule}"
