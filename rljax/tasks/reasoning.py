"""Any reasoning-gym data set as a task, by name, with its own arguments.

    task = rljax.tasks.get_task("reasoning_gym", dataset="chain_sum",
                                dataset_args={"min_terms": 2, "max_terms": 3})

reasoning-gym's generators are procedural (no download) and seeded: entry
``idx`` of a data set built with seed ``s`` is a pure function of ``(s, idx)``.
The train and eval streams draw indices from the usual per-example generators
and the usual prompt-hash partition keeps them apart (``rljax.tasks.base``).

Scoring: ``score_answer(extract_answer(completion), entry)``, the data set's
own rule, except that by default only a full score counts (1.0, else 0.0):
its default ``score_answer`` gives partial credit to any answer that merely
contains the right one (``142`` for ``42`` scores 0.67), which RL would learn
to exploit. The answer is extracted by rljax's linear ``answer_tag``
(identical to reasoning-gym's ``extract_answer``, whose regex is quadratic),
and ``score_answer`` runs in the bounded scoring process
(``rljax.tasks.bounded``), so a data set whose scorer parses with sympy costs
at most ``score_timeout_s`` per completion.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Optional

import numpy as np

from rljax.tasks import extract as extract_lib
from rljax.tasks import scoring
from rljax.tasks.base import Example, Task

_RESERVED_ARGS = ("seed", "size")


def _import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as err:
        raise ValueError("the reasoning_gym task needs the 'reasoning-gym' "
                         "package: pip install 'rljax[data]' (or pip install "
                         "reasoning-gym)") from err
    return reasoning_gym


def dataset_names() -> list[str]:
    """The data set names reasoning-gym registers, sorted."""
    return sorted(_import_reasoning_gym().factory.DATASETS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReasoningGymTask(Task):
    """A reasoning-gym data set; reward from its own ``score_answer``.

    Attributes:
      dataset: the reasoning-gym name (``chain_sum``, ``gsm_symbolic``, ...).
      dataset_args: the data set's own config fields (e.g. ``min_terms``);
        ``seed`` and ``size`` come from this task.
      size: indices are drawn from ``[0, size)``: the problem space per seed.
      prompt_style: a key of reasoning-gym's ``SYSTEM_PROMPTS`` (default,
        simple, direct, DeepSeekZero, chain_of_draft) used as the system
        prompt, which asks for ``<answer>`` tags; "" for none.
      extract: how the answer is cut out of the completion (answer_tag, the
        reasoning-gym rule; or boxed, last_number, none).
      partial_credit: pass the data set's fractional scores through instead
        of counting only a full score.
      score_timeout_s: bound on one ``score_answer`` call (0.0 past it).
    """

    name = "reasoning_gym"

    dataset: str = "chain_sum"
    dataset_args: dict = dataclasses.field(default_factory=dict, hash=False)
    size: int = 100_000
    prompt_style: str = "default"
    extract: str = "answer_tag"
    partial_credit: bool = False
    score_timeout_s: float = scoring.DEFAULT_MATH_TIMEOUT_S

    def __post_init__(self):
        super().__post_init__()
        rg = _import_reasoning_gym()
        if self.dataset not in rg.factory.DATASETS:
            raise ValueError(f"reasoning_gym: dataset={self.dataset!r} is not a "
                             f"reasoning-gym data set; valid: "
                             f"{', '.join(dataset_names())}")
        if not isinstance(self.dataset_args, dict):
            raise ValueError(f"reasoning_gym: dataset_args must be a dict, got "
                             f"{self.dataset_args!r}")
        reserved = sorted(set(self.dataset_args) & set(_RESERVED_ARGS))
        if reserved:
            raise ValueError(f"reasoning_gym: dataset_args may not set "
                             f"{', '.join(reserved)}: use the task's own seed "
                             f"and size")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or (
                self.size < 1):
            raise ValueError(f"reasoning_gym: size={self.size!r} must be an "
                             f"int >= 1")
        styles = rg.utils.SYSTEM_PROMPTS
        if self.prompt_style and self.prompt_style not in styles:
            raise ValueError(f"reasoning_gym: prompt_style={self.prompt_style!r}; "
                             f"valid: '' (none), {', '.join(styles)}")
        extract_lib.check_mode("reasoning_gym: extract", self.extract)
        if not self.score_timeout_s > 0:
            raise ValueError(f"reasoning_gym: score_timeout_s="
                             f"{self.score_timeout_s} must be > 0")
        object.__setattr__(self, "_generator", self._build(rg))
        object.__setattr__(self, "_stats", scoring.ScoreStats())
        object.__setattr__(self, "_spec", pickle.dumps(
            (self.dataset, dict(self.dataset_args), self.seed, self.size)))

    def _build(self, rg):
        _, config_cls = rg.factory.DATASETS[self.dataset]
        try:
            return rg.create_dataset(self.dataset, seed=self.seed,
                                     size=self.size, **self.dataset_args)
        except (TypeError, ValueError, AssertionError) as err:
            fields = [f.name for f in dataclasses.fields(config_cls)
                      if f.name not in _RESERVED_ARGS]
            raise ValueError(
                f"reasoning_gym: dataset_args={self.dataset_args!r} rejected "
                f"by {self.dataset!r} ({type(err).__name__}: {err}); its "
                f"fields: {', '.join(fields)}") from None

    @property
    def system_prompt(self) -> Optional[str]:  # type: ignore[override]
        if not self.prompt_style:
            return None
        return _import_reasoning_gym().utils.SYSTEM_PROMPTS[self.prompt_style]

    def _generate(self, rng: np.random.Generator) -> Example:
        index = int(rng.integers(self.size))
        entry = self._generator[index]
        return Example(prompt=entry["question"], answer=entry["answer"],
                       meta={"index": index, "entry": entry})

    def _reward(self, completion: str, example: Example) -> float:
        answer = extract_lib.extract(completion, self.extract)
        if answer is None:
            return 0.0
        score = scoring.bounded_call(
            "rg_score", (self._spec, answer, example.meta["entry"]),
            timeout_s=self.score_timeout_s, needs=("reasoning_gym",),
            stats=self._stats, task=self.name)
        if score is None:
            return 0.0
        if self.partial_credit:
            return float(min(max(score, 0.0), 1.0))
        return 1.0 if score >= 1.0 else 0.0

    def stats(self) -> dict[str, float]:
        return {"reward_timeouts": self._stats.timeouts,
                "reward_errors": self._stats.errors}

    def reward_rule(self) -> str:
        credit = ("its score, clipped to [0, 1]" if self.partial_credit else
                  "1.0 iff its score is 1.0 (full credit only), else 0.0")
        return (f"answer = extract {self.extract!r} of the completion (None: "
                f"0.0); reward = reasoning-gym {self.dataset!r} "
                f"score_answer(answer, entry): {credit}; bounded to "
                f"{self.score_timeout_s:g} s")

    def config(self) -> dict[str, Any]:
        out = super().config()
        out["dataset_args"] = dict(self.dataset_args)
        return out
