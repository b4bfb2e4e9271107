"""Integer arithmetic with a "just the number" instruction.

Prompt: ``Compute 23 + 48. Answer with just the number.`` The expression uses
Python precedence (``*`` before ``+``/``-``), so its value is the one any
calculator gives. The defaults (two operands up to 99, ``+`` and ``-``) are
sized so that SmolLM2-135M-Instruct solves some problems but not all.
"""

from __future__ import annotations

import dataclasses
import numpy as np

from rljax.tasks import _parse
from rljax.tasks.base import Example, Task

_OPERATORS = "+-*"
_MAX_REDRAWS = 1000


def expression_value(expression: str) -> int:
    """Exact integer value of one of our generated expressions."""
    tree = _parse.parse_expression(expression)
    if tree is None:
        raise ValueError(f"not a whitelisted expression: {expression!r}")
    value = _parse.evaluate(tree)
    # + - * on integers stay integers; anything else is a generator bug.
    assert value is not None and value.denominator == 1, expression
    return int(value)


def parse_answer(completion: str, strict: bool = False):
    """The number a completion answers with, or None (see ``reward``)."""
    if strict:
        return _parse.parse_number_strict(completion)
    return _parse.parse_number_last(completion)


def reward(completion: str, example: Example, *, strict: bool = False) -> float:
    """1.0 iff the completion's number equals ``example.answer`` exactly.

    Lenient (default): the last number inside the last ``\\boxed{}``, else the
    last number anywhere in the completion. Strict: the completion must be
    just the number, optionally with whitespace, markdown or quote decoration,
    a trailing period, or inside ``\\boxed{}``. Numbers may carry thousands
    commas; "71.0" equals 71, "71.5" does not. Otherwise 0.0.
    """
    value = parse_answer(completion, strict=strict)
    return 1.0 if value is not None and value == example.answer else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask(Task):
    """Integer expressions; reward 1.0 iff the answer is the exact value.

    Attributes:
      num_operands: operands per expression (>= 2).
      min_value, max_value: operands are uniform integers in this range.
      operators: the operators to draw from, a subset of "+-*".
      allow_negative: if False, redraw expressions whose value is negative.
      strict: answer-parsing rule for the reward (see ``reward``).
      format_weight: with ``strict=False``, the share of the reward that also
        needs the strict format: a correct answer buried in text scores
        ``1 - format_weight``, the bare number 1.0. Accuracy (reward 1.0)
        then means strict accuracy, while a correct-but-verbose answer
        still carries signal. 0.0 (default) is the plain lenient rule.
    """

    name = "arithmetic"

    num_operands: int = 2
    min_value: int = 0
    max_value: int = 99
    operators: str = "+-"
    allow_negative: bool = True
    strict: bool = False
    format_weight: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.num_operands < 2:
            raise ValueError(
                f"arithmetic: num_operands must be >= 2, got {self.num_operands}")
        if not 0 <= self.min_value <= self.max_value:
            raise ValueError(
                f"arithmetic: need 0 <= min_value <= max_value, got "
                f"{self.min_value}, {self.max_value}")
        if not 0.0 <= self.format_weight <= 1.0 or (self.strict and self.format_weight):
            raise ValueError(
                f"arithmetic: format_weight must be in [0, 1] and needs strict=False, "
                f"got {self.format_weight} with strict={self.strict}")
        if not self.operators or set(self.operators) - set(_OPERATORS):
            raise ValueError(
                f"arithmetic: operators must be a non-empty subset of "
                f"{_OPERATORS!r}, got {self.operators!r}")

    def _generate(self, rng: np.random.Generator) -> Example:
        for _ in range(_MAX_REDRAWS):
            operands = rng.integers(
                self.min_value, self.max_value + 1, size=self.num_operands)
            ops = rng.choice(list(self.operators), size=self.num_operands - 1)
            parts = [str(operands[0])]
            for op, operand in zip(ops, operands[1:]):
                parts += [str(op), str(operand)]
            expression = " ".join(parts)
            value = expression_value(expression)
            if self.allow_negative or value >= 0:
                return Example(
                    prompt=f"Compute {expression}. Answer with just the number.",
                    answer=value,
                    meta={"expression": expression})
        # E.g. operators="-" with min_value == max_value > 0 and 3 operands.
        raise ValueError(
            f"arithmetic: no non-negative expression in {_MAX_REDRAWS} draws; "
            f"this config needs allow_negative=True")

    def _reward(self, completion: str, example: Example) -> float:
        if self.format_weight:
            lenient = reward(completion, example, strict=False)
            strict = reward(completion, example, strict=True)
            return (1.0 - self.format_weight) * lenient + self.format_weight * strict
        return reward(completion, example, strict=self.strict)

    def reward_rule(self) -> str:
        if self.format_weight:
            return (f"{1 - self.format_weight:g} iff the last number (lenient rule) "
                    f"is the exact value, plus {self.format_weight:g} iff the "
                    "completion is just that number (strict rule)")
        if self.strict:
            return ("1.0 iff the completion is just the exact integer value "
                    "(whitespace, markdown/quote decoration, a trailing "
                    "period or \\boxed{} allowed), else 0.0")
        return ("1.0 iff the last number in the last \\boxed{} (or, without "
                "one, the last number in the completion) equals the exact "
                "integer value, else 0.0")
