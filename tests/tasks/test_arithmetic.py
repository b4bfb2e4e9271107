"""Arithmetic: exact values and the lenient and strict answer rules."""

import re

import pytest

from rljax import tasks
from rljax.tasks import arithmetic

# 23 + 48 = 71.
SUM = tasks.Example(prompt="Compute 23 + 48. Answer with just the number.",
                    answer=71)
# 23 - 48 = -25.
DIFF = tasks.Example(prompt="Compute 23 - 48. Answer with just the number.",
                     answer=-25)


@pytest.mark.parametrize("completion, lenient, strict", [
    ("71", 1.0, 1.0),
    ("  71\n", 1.0, 1.0),
    ("71.", 1.0, 1.0),
    ("**71**", 1.0, 1.0),
    ("$71$", 1.0, 1.0),
    ("\\boxed{71}", 1.0, 1.0),
    ("71.0", 1.0, 1.0),  # The same number, exactly.
    ("The answer is 71.", 1.0, 0.0),
    ("23 + 48 = 71", 1.0, 0.0),
    ("\\boxed{71}. Check: 70 + 1", 1.0, 0.0),  # The box wins over later text.
    ("\\boxed{70}. Or maybe 71", 0.0, 0.0),
    ("70", 0.0, 0.0),
    ("71.5", 0.0, 0.0),
    ("710", 0.0, 0.0),
    ("23 + 48", 0.0, 0.0),  # Last number is 48.
    ("71 72", 0.0, 0.0),
    ("seventy-one", 0.0, 0.0),
    ("", 0.0, 0.0),
    ("9" * 5000, 0.0, 0.0),  # Too long to be ours; must not raise.
])
def test_sum_rewards(completion, lenient, strict):
    assert arithmetic.reward(completion, SUM) == lenient
    assert arithmetic.reward(completion, SUM, strict=True) == strict


@pytest.mark.parametrize("completion, lenient, strict", [
    ("-25", 1.0, 1.0),
    ("\u221225", 1.0, 1.0),  # Unicode minus sign.
    ("\\boxed{-25}", 1.0, 1.0),
    ("23 - 48 = -25", 1.0, 0.0),
    ("25", 0.0, 0.0),
    ("- 25", 0.0, 0.0),  # A detached minus is not part of the number.
])
def test_negative_rewards(completion, lenient, strict):
    assert arithmetic.reward(completion, DIFF) == lenient
    assert arithmetic.reward(completion, DIFF, strict=True) == strict


def test_thousands_separators():
    # 37 * 41 * 3 = 4551.
    example = tasks.Example(prompt="p", answer=4551)
    assert arithmetic.reward("4,551", example) == 1.0
    assert arithmetic.reward("4,551", example, strict=True) == 1.0
    assert arithmetic.reward("4,55", example) == 0.0


def test_task_uses_its_strict_flag():
    lenient = tasks.get_task("arithmetic")
    strict = tasks.get_task("arithmetic", strict=True)
    assert lenient.reward("The answer is 71", SUM) == 1.0
    assert strict.reward("The answer is 71", SUM) == 0.0
    assert "last number" in lenient.describe()
    assert "just the exact integer" in strict.describe()


def _independent_value(expression):
    # Our own generated text (checked against a digits-and-operators pattern),
    # so Python's evaluator is a safe independent oracle here.
    assert re.fullmatch(r"[0-9]+( [-+*] [0-9]+)*", expression)
    return eval(expression)  # pylint: disable=eval-used


@pytest.mark.parametrize("kwargs", [
    {},
    {"num_operands": 3, "operators": "+-*", "max_value": 12},
    {"num_operands": 3, "operators": "-", "min_value": 0, "max_value": 9,
     "allow_negative": False},
])
def test_generated_problems(kwargs):
    task = tasks.get_task("arithmetic", seed=1, **kwargs)
    config = task.config()
    seen_ops = set()
    for i in range(500):
        example = task.train_example(i)
        expression = example.meta["expression"]
        assert example.prompt == (
            f"Compute {expression}. Answer with just the number.")
        assert type(example.answer) is int
        assert example.answer == _independent_value(expression)
        operands = [int(x) for x in re.findall(r"[0-9]+", expression)]
        assert len(operands) == config["num_operands"]
        assert all(config["min_value"] <= x <= config["max_value"]
                   for x in operands)
        seen_ops |= set(re.findall(r" ([-+*]) ", expression))
        if not config["allow_negative"]:
            assert example.answer >= 0
    assert seen_ops == set(config["operators"])


def test_default_difficulty_mixes_signs():
    answers = [tasks.get_task("arithmetic").train_example(i).answer
               for i in range(300)]
    assert min(answers) < 0 < max(answers) and max(answers) <= 198


@pytest.mark.parametrize("kwargs, pattern", [
    ({"num_operands": 1}, "num_operands"),
    ({"min_value": 5, "max_value": 4}, "min_value"),
    ({"operators": "+/"}, "operators"),
    ({"operators": ""}, "operators"),
])
def test_bad_config(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        tasks.get_task("arithmetic", **kwargs)


def test_unsatisfiable_nonnegative_config_fails_clearly():
    # 5 - 5 - 5 is always -5.
    task = tasks.get_task("arithmetic", num_operands=3, operators="-",
                          min_value=5, max_value=5, allow_negative=False)
    with pytest.raises(ValueError, match="allow_negative"):
        task.train_example(0)


def test_format_weight_mixes_lenient_and_strict():
    from rljax.tasks import get_task
    task = get_task("arithmetic", format_weight=0.5)
    ex = task.train_example(0)
    value = ex.answer
    # Bare number: both rules pass -> 0.5 + 0.5; buried in text: lenient only.
    assert task.reward(f"{value}", ex) == 1.0
    assert task.reward(f"The sum is {value}", ex) == 0.5
    assert task.reward(f"{value + 1}", ex) == 0.0
    with pytest.raises(ValueError, match="format_weight"):
        get_task("arithmetic", format_weight=0.5, strict=True)
    with pytest.raises(ValueError, match="format_weight"):
        get_task("arithmetic", format_weight=1.5)
