"""A task over your own data: a local JSONL, JSON, parquet or CSV file.

    task = rljax.tasks.get_task("dataset", path="examples/gsm_synth/train.jsonl",
                                scorer="math", template="{prompt}\\nAnswer ...")

The file is read once, through HF ``datasets``, fully offline
(``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` are set before it is imported):
a hub name is rejected at once, naming ``path``. Every row is checked before
training starts; a bad row (missing field, empty prompt, unparseable answer)
is an error naming the file, the row and the field, or, with
``on_bad_row="skip"``, is counted (``stats()["data_skipped_rows"]``) and logged.

Held out by the partition every task uses: a row is on the eval side iff
``is_eval_prompt("dataset", prompt_text, eval_fraction)`` for its raw prompt
field, so the split survives a new template, seed or row order. Train order:
epoch ``e`` is a permutation of the train rows drawn from
``SeedSequence([seed, 0, e])``, so ``train_example(i)`` is a pure function of
the config and a resumed run sees exactly the rows it would have seen. The
eval split is the eval-side rows (distinct prompts) in an order drawn from
``SeedSequence([seed, 1])``; few-shot demonstrations are the first
``few_shot`` train rows of an order drawn from ``SeedSequence([seed, 2])`` and
are left out of the train stream.

Reward: the answer is cut out of the completion by ``extract`` (none |
answer_tag | boxed | last_number, ``rljax.tasks.extract``) and compared with
the row's gold answer by ``scorer`` (math | exact | regex | module:function,
``rljax.tasks.scoring``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import string
from typing import Any, NamedTuple

import numpy as np

from rljax.tasks import _datafile
from rljax.tasks import extract as extract_lib
from rljax.tasks import scoring
from rljax.tasks.base import Example, is_eval_prompt, Task

log = logging.getLogger("rljax.tasks")

PROMPT_FIELDS = ("prompt", "question", "problem")
BAD_ROW_CHOICES = ("error", "skip")
# Bad rows shown in the log (and in the error when every row is bad).
_SHOWN_PROBLEMS = 5


class _Data(NamedTuple):
    train: list[Example]
    held_out: list[Example]
    demos: list[Example]
    rows: int
    skipped: int
    sha256: str
    prompt_field: str


class BadRow(ValueError):
    """A row that cannot be used, with the file, row and field in the message."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetTask(Task):
    """Rows of a local file as prompts, scored against their answer field.

    Attributes:
      path: the local file (.jsonl, .json, .parquet, .csv; .gz for text ones).
      prompt_field: column holding the question; "" takes the first of
        prompt, question, problem that the file has.
      answer_field: column holding the gold answer (a string or a number).
      answer_after: if set (e.g. "####" for GSM8K files), the gold answer is
        the text after its last occurrence in the answer field.
      template: the user message, ``str.format`` over the row: ``{prompt}`` is
        the prompt field, any other ``{column}`` that column ("{{" for "{").
      system_prompt: a system message ("" none).
      few_shot: demonstrations put before the question as earlier
        user/assistant turns (train rows, left out of the train stream).
      few_shot_field: column holding a demonstration's reply ("" the answer
        field's text as it is, e.g. a whole worked solution).
      scorer: math | exact | regex | "package.module:function" (called as
        ``fn(extracted_answer, example)``).
      extract: none | answer_tag | boxed | last_number; what part of the
        completion the scorer sees (none: all of it; math-verify then finds
        the answer itself). Nothing extracted scores 0.0.
      on_bad_row: error (stop at the first bad row) | skip (count and log).
      score_timeout_s: bound on one math-verify call (its process is killed
        past it and the completion scores 0.0, counted as a timeout).
    """

    name = "dataset"

    path: str = ""
    prompt_field: str = ""
    answer_field: str = "answer"
    answer_after: str = ""
    template: str = "{prompt}"
    system_prompt: str = ""
    few_shot: int = 0
    few_shot_field: str = ""
    scorer: str = "math"
    extract: str = "none"
    on_bad_row: str = "error"
    score_timeout_s: float = scoring.DEFAULT_MATH_TIMEOUT_S

    def __post_init__(self):
        super().__post_init__()
        if self.on_bad_row not in BAD_ROW_CHOICES:
            raise ValueError(f"dataset: on_bad_row={self.on_bad_row!r}; valid: "
                             f"{', '.join(BAD_ROW_CHOICES)}")
        extract_lib.check_mode("dataset: extract", self.extract)
        user_fn = scoring.check_scorer("dataset: scorer", self.scorer)
        if not self.score_timeout_s > 0:
            raise ValueError(f"dataset: score_timeout_s={self.score_timeout_s} "
                             f"must be > 0")
        if isinstance(self.few_shot, bool) or not isinstance(
                self.few_shot, int) or self.few_shot < 0:
            raise ValueError(f"dataset: few_shot={self.few_shot!r} must be an "
                             f"int >= 0")
        object.__setattr__(self, "_user_fn", user_fn)
        object.__setattr__(self, "_stats", scoring.ScoreStats())
        object.__setattr__(self, "_data", self._load())

    # --- loading --------------------------------------------------------------

    def _load(self) -> _Data:
        columns, records = _datafile.read_rows(self.path)
        where = f"dataset {self.path}"
        prompt_field = self._resolve_prompt_field(columns, where)
        needed = {"answer_field": self.answer_field}
        if self.few_shot_field:
            needed["few_shot_field"] = self.few_shot_field
        for key, column in needed.items():
            if column not in columns:
                raise ValueError(f"{where}: {key}={column!r} is not a column; "
                                 f"columns: {', '.join(columns)}")
        self._check_template(columns, where)
        examples, problems, keys = [], [], []
        for i, record in enumerate(records):
            try:
                examples.append(self._example(i, record, prompt_field, where))
                keys.append(record[prompt_field])
            except BadRow as err:
                problems.append(str(err))
                if self.on_bad_row == "error":
                    raise
        examples, keys = self._check_golds(examples, keys, problems, where)
        if problems:
            log.warning("%s: skipped %d bad row(s) of %d; first: %s", where,
                        len(problems), len(records),
                        " | ".join(problems[:_SHOWN_PROBLEMS]))
        if not examples:
            raise ValueError(f"{where}: no usable rows (of {len(records)}); "
                             f"first problems: "
                             f"{' | '.join(problems[:_SHOWN_PROBLEMS]) or 'none'}")
        held_out, train = [], []
        for example, key in zip(examples, keys):
            side = is_eval_prompt(self.name, key, self.eval_fraction)
            (held_out if side else train).append(example)
        demos = []
        if self.few_shot:
            if self.few_shot >= len(train):
                raise ValueError(
                    f"{where}: few_shot={self.few_shot} needs more than that "
                    f"many train rows; it has {len(train)}")
            order = _permutation(len(train), self.seed, 2)
            picked = set(order[:self.few_shot].tolist())
            demos = [train[j] for j in order[:self.few_shot]]
            train = [ex for j, ex in enumerate(train) if j not in picked]
        if not train:
            raise ValueError(f"{where}: all {len(examples)} rows are on the "
                             f"held-out side (eval_fraction={self.eval_fraction})")
        return _Data(train=train, held_out=_distinct(held_out, self.seed),
                     demos=demos, rows=len(records), skipped=len(problems),
                     sha256=_datafile.sha256(self.path), prompt_field=prompt_field)

    def _resolve_prompt_field(self, columns: list[str], where: str) -> str:
        if self.prompt_field:
            if self.prompt_field not in columns:
                raise ValueError(f"{where}: prompt_field={self.prompt_field!r} "
                                 f"is not a column; columns: {', '.join(columns)}")
            return self.prompt_field
        for name in PROMPT_FIELDS:
            if name in columns:
                return name
        raise ValueError(f"{where}: no prompt column (looked for "
                         f"{', '.join(PROMPT_FIELDS)}); set prompt_field to one "
                         f"of the columns: {', '.join(columns)}")

    def _check_template(self, columns: list[str], where: str) -> None:
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(self.template)
                     if f is not None]
        except ValueError as err:
            raise ValueError(f"{where}: template={self.template!r} is not a "
                             f"format string ({err}); write '{{{{' for a literal "
                             f"brace") from None
        valid = ["prompt"] + columns
        for name in names:
            if name not in valid:
                raise ValueError(
                    f"{where}: template field {{{name}}} is not 'prompt' or a "
                    f"column (plain names only, no attributes or indexes); "
                    f"columns: {', '.join(columns)}")

    def _example(self, i: int, record: dict, prompt_field: str,
                 where: str) -> Example:
        def bad(field, problem):
            return BadRow(f"{where}: row {i}: field {field!r}: {problem}")

        question = record.get(prompt_field)
        if question is None:
            raise bad(prompt_field, "missing")
        if not isinstance(question, str):
            raise bad(prompt_field, f"must be a string, got "
                      f"{type(question).__name__}")
        if not question.strip():
            raise bad(prompt_field, "empty prompt")
        gold = self._gold(record, bad)
        values = {k: "" if v is None else v for k, v in record.items()}
        values["prompt"] = question
        meta: dict[str, Any] = {"row": i}
        if self.few_shot:
            reply = record.get(self.few_shot_field or self.answer_field)
            meta["reply"] = "" if reply is None else str(reply)
        return Example(prompt=self.template.format_map(values), answer=gold,
                       meta=meta)

    def _gold(self, record: dict, bad) -> Any:
        value = record.get(self.answer_field)
        if value is None:
            raise bad(self.answer_field, "missing")
        if self._user_fn is not None:
            return value  # The user's scorer decides what an answer is.
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise bad(self.answer_field, f"must be a string or a number, got "
                      f"{type(value).__name__}")
        text = str(value)
        if self.answer_after:
            cut = text.rfind(self.answer_after)
            if cut < 0:
                raise bad(self.answer_field, f"unparseable answer: no "
                          f"{self.answer_after!r} in it (answer_after)")
            text = text[cut + len(self.answer_after):]
        text = text.strip()
        if not text:
            raise bad(self.answer_field, "empty answer")
        if self.scorer == "regex":
            try:
                scoring.compile_regex(text)
            except ValueError as err:
                raise bad(self.answer_field, f"unparseable answer: {err}") from None
        return text

    def _check_golds(self, examples, keys, problems, where):
        """math: every gold must parse; one bounded call per chunk of rows."""
        if self.scorer != "math":
            return examples, keys
        verdicts = scoring.math_gold_problems([e.answer for e in examples],
                                              self.score_timeout_s)
        kept, kept_keys = [], []
        for example, key, problem in zip(examples, keys, verdicts):
            if problem is None:
                kept.append(example)
                kept_keys.append(key)
                continue
            message = (f"{where}: row {example.meta['row']}: field "
                       f"{self.answer_field!r}: unparseable answer "
                       f"{example.answer!r}: {problem}")
            if self.on_bad_row == "error":
                raise BadRow(message)
            problems.append(message)
        return kept, kept_keys

    # --- the task contract ------------------------------------------------------

    def _generate(self, rng: np.random.Generator) -> Example:
        """A uniformly random train row (the streams below use permutations)."""
        train = self._data.train
        return train[int(rng.integers(len(train)))]

    def train_example(self, index: int) -> Example:
        """Row ``order_e[index % n]`` of epoch ``e = index // n``."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or (
                index < 0):
            raise ValueError(f"dataset: index must be an int >= 0, got {index!r}")
        train = self._data.train
        epoch, offset = divmod(int(index), len(train))
        return train[_permutation(len(train), self.seed, 0, epoch)[offset]]

    def eval_split(self, n: int) -> list[Example]:
        held_out = self._data.held_out
        if n < 0:
            raise ValueError(f"dataset: eval split size must be >= 0, got {n}")
        if n > len(held_out):
            raise ValueError(
                f"dataset {self.path}: eval split of {n} asked for, but only "
                f"{len(held_out)} distinct prompts are on the held-out side "
                f"(eval_fraction={self.eval_fraction}); lower the eval size "
                f"or raise eval_fraction")
        return held_out[:n]

    def messages(self, example: Example) -> list[dict[str, str]]:
        out = []
        if self.system_prompt:
            out.append({"role": "system", "content": self.system_prompt})
        for demo in self._data.demos:
            out.append({"role": "user", "content": demo.prompt})
            out.append({"role": "assistant", "content": demo.meta["reply"]})
        out.append({"role": "user", "content": example.prompt})
        return out

    def _reward(self, completion: str, example: Example) -> float:
        answer = extract_lib.extract(completion, self.extract)
        if answer is None:
            return 0.0
        if self._user_fn is not None:
            return float(self._user_fn(answer, example))
        if self.scorer == "exact":
            return scoring.exact_score(answer, example.answer)
        if self.scorer == "regex":
            return scoring.regex_score(answer, example.answer)
        return scoring.math_score(
            answer, example.answer, whole_completion=self.extract == "none",
            timeout_s=self.score_timeout_s, stats=self._stats, task=self.name)

    def stats(self) -> dict[str, float]:
        return {"data_skipped_rows": self._data.skipped,
                "reward_timeouts": self._stats.timeouts,
                "reward_errors": self._stats.errors}

    def reward_rule(self) -> str:
        region = {"none": "the whole completion",
                  "answer_tag": "the last <answer>...</answer> (stripped)",
                  "boxed": "the last balanced \\boxed{...}",
                  "last_number": "the last number"}[self.extract]
        rule = {
            "math": "math-verify verify(parse(gold), parse(answer)) is true "
                    f"(bounded to {self.score_timeout_s:g} s, else 0.0)",
            "exact": "the stripped answer equals the stripped gold",
            "regex": "the stripped answer fully matches the gold as an RE2 "
                     "pattern",
        }.get(self.scorer, f"{self.scorer}(answer, example)")
        if self._user_fn is not None:
            return f"answer = {region}; reward = {rule}"
        return (f"answer = {region}; 1.0 iff {rule}, else 0.0 (nothing "
                f"extracted: 0.0)")

    def describe(self) -> str:
        d = self._data
        return (f"{super().describe()}\ndata: {self.path} sha256={d.sha256[:16]} "
                f"rows={d.rows} train={len(d.train)} held_out={len(d.held_out)} "
                f"few_shot={len(d.demos)} skipped={d.skipped} "
                f"prompt_field={d.prompt_field!r}")


@functools.lru_cache(maxsize=8)  # train_example asks for the same epoch often
def _permutation(n: int, seed: int, stream: int, epoch: int = 0) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), stream,
                                                        int(epoch)]))
    order = rng.permutation(n)
    order.setflags(write=False)  # Shared through the cache.
    return order


def _distinct(examples: list[Example], seed: int) -> list[Example]:
    """The held-out rows in a seeded order, one per distinct prompt."""
    out, seen = [], set()
    for j in _permutation(len(examples), seed, 1):
        example = examples[j]
        if example.prompt not in seen:
            seen.add(example.prompt)
            out.append(example)
    return out

