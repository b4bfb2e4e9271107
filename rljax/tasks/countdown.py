"""Countdown: reach a target with the given numbers and + - * /.

Every target is reachable by construction: the generator combines all of the
drawn numbers into a random expression tree and uses its value as the target;
that expression is kept in ``example.meta["solution"]``.

Answers are checked, never executed: the expression is parsed with ``ast``
against a whitelist (integer literals, binary + - * /, parentheses) after a
character whitelist, and evaluated exactly with ``fractions.Fraction``.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from typing import Optional

import numpy as np

from rljax.tasks import _parse
from rljax.tasks import extract
from rljax.tasks.base import Example, Task

_OPERATORS = "+-*/"
_MAX_REDRAWS = 10_000
# Candidates are the last pieces of the answer region's split at "=". A real
# answer has two or three ("(3 + 5) * 3 = 24"); the bound keeps a chain of
# 100k guesses from costing 100k parses (and from being checked one by one).
MAX_PIECES = 8
_EXPR_START = "0123456789("
_EXPR_END = "0123456789)"
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul,
          "/": operator.truediv}


def candidate_expressions(completion: str) -> list[str]:
    """The substrings of a completion that are scored as its answer.

    The answer region is the content of the last ``<answer>...</answer>``, else
    of the last ``\\boxed{...}``, else the last non-empty line. It is split at
    "=" (so "(3 + 5) * 3 = 24" offers "(3 + 5) * 3" and "24"; at most
    ``MAX_PIECES`` pieces, split from the right, so the first one keeps any
    earlier "="), and each piece is trimmed to run from its first digit or "("
    to its last digit or ")", which drops labels like "Answer:" and markdown
    around the expression.
    """
    text = _parse.normalize_operators(completion)
    # A linear scan (extract.last_tagged), not a lazy regex: the regex would
    # rescan to the end from every "<answer>" that has no closing tag.
    tag = extract.last_tagged(text, "<answer>", "</answer>")
    boxes = _parse.BOXED_RE.findall(text)
    if tag is not None:
        region = tag
    elif boxes:
        region = boxes[-1]
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        region = lines[-1] if lines else ""
    pieces = []
    for piece in region.rsplit("=", MAX_PIECES - 1):
        start = next((i for i, c in enumerate(piece) if c in _EXPR_START), None)
        end = next((i for i in range(len(piece) - 1, -1, -1)
                    if piece[i] in _EXPR_END), None)
        if start is not None and end is not None and start <= end:
            pieces.append(piece[start:end + 1])
    return pieces


def check_expression(expression: str, numbers, target: int,
                     use_all: bool = False) -> Optional[bool]:
    """None if malformed, else whether it is a correct solution.

    Correct: every literal is one of ``numbers`` and used no more often than
    it occurs there (exactly as often, with ``use_all``), and the exact value
    equals ``target``. Division by zero counts as well-formed but wrong.
    """
    tree = _parse.parse_expression(expression)
    if tree is None:
        return None
    used = collections.Counter(_parse.literals(tree))
    given = collections.Counter(int(n) for n in numbers)
    if use_all:
        counts_ok = used == given
    else:
        counts_ok = all(used[n] <= given[n] for n in used)
    if not counts_ok:
        return False
    return _parse.evaluate(tree) == target


def reward(completion: str, example: Example, *, use_all: bool = False,
           format_reward: float = 0.0) -> float:
    """1.0 if some candidate expression solves the example, else partial/0.

    Candidates are those of ``candidate_expressions``. 1.0 iff one of them
    passes ``check_expression`` for ``example.answer["numbers"]`` and
    ``["target"]``; otherwise ``format_reward`` if one of them is a
    well-formed expression with at least one operator; otherwise 0.0.
    """
    numbers = example.answer["numbers"]
    target = example.answer["target"]
    well_formed = False
    for expression in candidate_expressions(completion):
        verdict = check_expression(expression, numbers, target, use_all)
        if verdict:
            return 1.0
        if verdict is not None and any(c in expression for c in _OPERATORS):
            well_formed = True
    return float(format_reward) if well_formed else 0.0


def _random_expression(rng: np.random.Generator, numbers, operators: str):
    """Combines all numbers into one random tree; returns (text, value)."""
    items = [(str(n), _parse.Fraction(int(n))) for n in numbers]
    while len(items) > 1:
        i, j = rng.choice(len(items), size=2, replace=False)
        (a_text, a), (b_text, b) = items[i], items[j]
        op = str(rng.choice(list(operators)))
        if op == "/" and b == 0:
            op = "*"  # E.g. x / (3 - 3) has no value; keep the tree valid.
        value = _APPLY[op](a, b)
        items = [x for k, x in enumerate(items) if k not in (i, j)]
        items.append((f"({a_text} {op} {b_text})", value))
    text, value = items[0]
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]  # The outer pair always wraps the whole tree.
    return text, value


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountdownTask(Task):
    """Reach the target; reward 1.0 iff the answer expression is correct.

    Attributes:
      min_numbers, max_numbers: how many numbers a problem gives.
      min_number, max_number: the numbers are uniform integers in this range
        (drawn with replacement, so a number may repeat; repeats may be used
        as often as they occur).
      operators: operators the *generator* uses to build targets; answers may
        always use all of + - * /.
      max_target: targets are integers in [1, max_target].
      use_all: if True each number must be used exactly once; by default at
        most once.
      format_reward: reward for a well-formed but wrong expression.
    """

    name = "countdown"

    min_numbers: int = 3
    max_numbers: int = 4
    min_number: int = 1
    max_number: int = 20
    operators: str = "+-*"
    max_target: int = 100
    use_all: bool = False
    format_reward: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if not 2 <= self.min_numbers <= self.max_numbers:
            raise ValueError(
                f"countdown: need 2 <= min_numbers <= max_numbers, got "
                f"{self.min_numbers}, {self.max_numbers}")
        if not 1 <= self.min_number <= self.max_number:
            raise ValueError(
                f"countdown: need 1 <= min_number <= max_number, got "
                f"{self.min_number}, {self.max_number}")
        if not self.operators or set(self.operators) - set(_OPERATORS):
            raise ValueError(
                f"countdown: operators must be a non-empty subset of "
                f"{_OPERATORS!r}, got {self.operators!r}")
        if self.max_target < 1:
            raise ValueError(
                f"countdown: max_target must be >= 1, got {self.max_target}")
        if not 0.0 <= self.format_reward < 1.0:
            raise ValueError(
                f"countdown: format_reward must be in [0, 1), got "
                f"{self.format_reward}")

    def _generate(self, rng: np.random.Generator) -> Example:
        for _ in range(_MAX_REDRAWS):
            count = int(rng.integers(self.min_numbers, self.max_numbers + 1))
            numbers = [int(n) for n in rng.integers(
                self.min_number, self.max_number + 1, size=count)]
            solution, value = _random_expression(rng, numbers, self.operators)
            # Under "at most once" a target equal to a given number is solved
            # by writing that number alone, so such problems are redrawn.
            trivial = not self.use_all and value in numbers
            if value.denominator == 1 and 1 <= value <= self.max_target and (
                    not trivial):
                return self._example(numbers, int(value), solution)
        raise ValueError(
            f"countdown: no target in [1, {self.max_target}] in "
            f"{_MAX_REDRAWS} draws; widen max_target or the number range")

    def _example(self, numbers: list[int], target: int,
                 solution: str) -> Example:
        how_often = "exactly once" if self.use_all else "at most once"
        listed = ", ".join(str(n) for n in numbers)
        prompt = (
            f"Using the numbers {listed}, write an arithmetic expression that "
            f"equals {target}. You may use +, -, *, / and parentheses, and "
            f"each number {how_often}. Answer with just the expression.")
        return Example(
            prompt=prompt,
            answer={"numbers": numbers, "target": target},
            meta={"solution": solution})

    def _reward(self, completion: str, example: Example) -> float:
        return reward(completion, example, use_all=self.use_all,
                      format_reward=self.format_reward)

    def reward_rule(self) -> str:
        how_often = "exactly once" if self.use_all else "at most once"
        return (
            "candidates: the last <answer>...</answer>, else the last "
            "\\boxed{}, else the last non-empty line, split at '=' (the last "
            f"{MAX_PIECES} pieces) and trimmed "
            "to digits/parentheses; 1.0 iff a candidate parses under the "
            "whitelist (integer literals, binary + - * /, parentheses), uses "
            f"each given number {how_often} and nothing else, and equals the "
            f"target exactly (Fraction arithmetic); else {self.format_reward} "
            "if a candidate is a well-formed expression with an operator; "
            "else 0.0")
