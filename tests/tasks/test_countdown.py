"""Countdown: reachable targets, exact checking, and no code execution."""

import builtins
import collections

import hypothesis
from hypothesis import strategies as st
import pytest

from rljax import tasks
from rljax.tasks import countdown

# 3 * 7 + 2 * 5 = 21 + 10 = 31; 1 is spare unless every number must be used.
EXAMPLE = tasks.Example(prompt="p",
                        answer={"numbers": [2, 3, 5, 7, 1], "target": 31})


@pytest.mark.parametrize("completion, at_most_once, exactly_once", [
    ("3*7 + 2*5", 1.0, 0.0),
    ("3 * 7 + 2 * 5 * 1", 1.0, 1.0),
    ("(3 * 7) + (2 * 5) = 31", 1.0, 0.0),
    ("Answer: 3*7+2*5", 1.0, 0.0),
    ("**3*7+2*5**", 1.0, 0.0),
    ("Let me think.\n21 + 10 = 31\n3*7+2*5", 1.0, 0.0),
    ("<answer>3*7+2*5</answer> and then 1+1", 1.0, 0.0),
    ("\\boxed{3 \\times 7 + 2 \\times 5}", 1.0, 0.0),
    ("3\u00d77+2\u00d75", 1.0, 0.0),  # Unicode multiplication sign.
    ("(7 - 5 + 1) * 2 * 3 = 18", 0.0, 0.0),  # Valid numbers, wrong value.
    ("3*7+2*5+0", 0.0, 0.0),  # 0 is not given.
    ("3*7+10", 0.0, 0.0),  # 10 is not given.
    ("7*3+5*2+3-3", 0.0, 0.0),  # 3 is given once.
    ("31", 0.0, 0.0),  # Not a given number.
    ("3*7+2*5\nsome text after", 0.0, 0.0),  # Only the last line counts.
    ("2**5-1", 0.0, 0.0),  # No powers.
    ("(3*7)//1+2*5", 0.0, 0.0),  # No floor division.
    ("-1+2*5+3*7+1", 0.0, 0.0),  # No unary minus.
    ("3.0*7+2*5", 0.0, 0.0),  # No floats.
    ("7/(3-3)+2*5", 0.0, 0.0),  # Division by zero is wrong, not an error.
    ("", 0.0, 0.0),
])
def test_rewards(completion, at_most_once, exactly_once):
    assert countdown.reward(completion, EXAMPLE) == at_most_once
    assert countdown.reward(completion, EXAMPLE, use_all=True) == exactly_once


def test_division_is_exact():
    example = tasks.Example(prompt="p",
                            answer={"numbers": [4, 6, 8], "target": 12})
    assert countdown.reward("6/4*8", example) == 1.0  # 1.5 * 8, not 1 * 8.
    assert countdown.reward("8/(6/4)", example) == 0.0  # 16/3.
    assert countdown.reward("(8/4) * 6", example) == 1.0


def test_repeated_numbers_may_be_used_as_often_as_given():
    # 3 * 3 + 5 = 14; a third 3 is not available.
    example = tasks.Example(prompt="p",
                            answer={"numbers": [3, 3, 5], "target": 14})
    assert countdown.reward("3*3+5", example) == 1.0
    assert countdown.reward("3*3+5+3-3", example) == 0.0


def test_format_reward_only_for_well_formed_expressions():
    kwargs = {"format_reward": 0.1}
    assert countdown.reward("3*7+2*5", EXAMPLE, **kwargs) == 1.0
    assert countdown.reward("2 + 3", EXAMPLE, **kwargs) == 0.1
    assert countdown.reward("99 * 99", EXAMPLE, **kwargs) == 0.1
    assert countdown.reward("7", EXAMPLE, **kwargs) == 0.0  # No operator.
    assert countdown.reward("3 + + ", EXAMPLE, **kwargs) == 0.0
    assert countdown.reward("hello", EXAMPLE, **kwargs) == 0.0
    task = tasks.get_task("countdown", format_reward=0.1)
    assert task.reward("2 + 3", EXAMPLE) == 0.1


ADVERSARIAL = [
    "__import__('os').system('touch {marker}')",
    "open('{marker}', 'w').write('x')",
    "3*7+2*5 or __import__('os').system('touch {marker}')",
    "().__class__.__bases__[0].__subclasses__()",
    "exec(\"open('{marker}', 'w')\")",
    "lambda: 31",
    "[31][0]",
    "31 if True else 0",
    "1_0 + 21",
    "0x1f",
    "1e1 + 21",
    "(" * 500 + "31" + ")" * 500,
    "1" * 100_000,
    "9" * 150 + " * " + "9" * 150,
]


@pytest.mark.parametrize("attack", ADVERSARIAL)
def test_adversarial_answers_score_zero_and_never_execute(
        attack, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    completion = attack.format(marker=marker)

    def forbidden(*args, **kwargs):
        raise AssertionError(f"executed code for {completion[:60]!r}")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    for kwargs in ({}, {"use_all": True}, {"format_reward": 0.1}):
        value = countdown.reward(completion, EXAMPLE, **kwargs)
        assert value in (0.0, kwargs.get("format_reward", 0.0))
    assert not marker.exists()


@pytest.mark.parametrize("use_all", [False, True])
def test_targets_are_reachable_by_the_generating_expression(use_all):
    task = tasks.get_task("countdown", seed=0, use_all=use_all)
    examples = [task.train_example(i) for i in range(1500)]
    examples += task.eval_split(200)
    for example in examples:
        numbers = example.answer["numbers"]
        target = example.answer["target"]
        solution = example.meta["solution"]
        assert 3 <= len(numbers) <= 4
        assert all(1 <= n <= 20 for n in numbers)
        assert 1 <= target <= 100
        assert f"equals {target}." in example.prompt
        assert ", ".join(map(str, numbers)) in example.prompt
        # The solution uses every number exactly once and hits the target.
        assert countdown.reward(solution, example, use_all=True) == 1.0
        assert task.reward(solution, example) == 1.0
        if not use_all:
            assert target not in numbers  # Not solvable by one number alone.
    assert collections.Counter(len(e.answer["numbers"]) for e in examples)[3]


def test_operator_config_and_exactly_once_prompt():
    task = tasks.get_task("countdown", operators="+", use_all=True,
                          min_numbers=2, max_numbers=2)
    for i in range(200):
        example = task.train_example(i)
        a, b = example.answer["numbers"]
        assert example.answer["target"] == a + b
        assert "exactly once" in example.prompt
    assert "exactly once" in task.describe()


@pytest.mark.parametrize("kwargs, pattern", [
    ({"min_numbers": 1}, "min_numbers"),
    ({"min_number": 0}, "min_number"),
    ({"operators": "+%"}, "operators"),
    ({"max_target": 0}, "max_target"),
    ({"format_reward": 1.0}, "format_reward"),
])
def test_bad_config(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        tasks.get_task("countdown", **kwargs)


_TOKENS = st.sampled_from(["2", "3", "5", "7", "1", "31", "+", "-", "*", "/",
                           "(", ")", " ", "=", "\n", "x", "**", "."])


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(parts=st.lists(_TOKENS, max_size=25))
def test_reward_total_on_expression_like_text(parts):
    value = countdown.reward("".join(parts), EXAMPLE, format_reward=0.1)
    assert value in (0.0, 0.1, 1.0)
