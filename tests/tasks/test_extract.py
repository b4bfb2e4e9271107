"""Answer extraction: the rules, and equality with the regexes they replace."""

import re

import hypothesis
from hypothesis import strategies as st
import pytest

from rljax.tasks import extract

# Fragments that make tag and brace structure likely in generated text.
_TAG_PIECES = ["<answer>", "</answer>", "<answer", "answer>", "</", "<", ">",
               " ", "\n", "\t", "a", "42", "-"]
_BRACE_PIECES = ["\\boxed{", "{", "}", "\\boxed", "1", "x", " ", "\\frac"]


def _texts(pieces):
    return st.lists(st.sampled_from(pieces), max_size=30).map("".join)


@pytest.mark.parametrize("text, expected", [
    ("no tags", None),
    ("<answer>42</answer>", "42"),
    ("<answer> 42 \n</answer>", "42"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("<answer>1</answer> then <answer>2", "1"),        # The last is unclosed.
    ("<answer><answer>3</answer>", "<answer>3"),       # Pairs like the regex.
    ("<answer>1</answer></answer>", "1"),
    ("<answer></answer>", ""),
    ("</answer><answer>", None),
])
def test_answer_tag(text, expected):
    assert extract.answer_tag(text) == expected


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(text=_texts(_TAG_PIECES))
def test_answer_tag_equals_reasoning_gym_extract_answer(text):
    from reasoning_gym.utils import extract_answer
    assert extract.answer_tag(text) == extract_answer(text)


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(text=_texts(_TAG_PIECES))
def test_last_tagged_equals_the_lazy_regex(text):
    # The rule countdown used before: the last findall match of the lazy regex.
    matches = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    assert extract.last_tagged(text, "<answer>", "</answer>") == (
        matches[-1] if matches else None)


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{42}", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{1} and \\boxed{2}", "2"),
    ("\\boxed{1} and \\boxed{2", "1"),          # Unclosed: not an answer.
    ("} \\boxed{7}}", "7"),                      # Stray closing braces.
    ("\\boxed{a \\boxed{b}}", "b"),              # The last by opening.
    ("{\\boxed{5}", "5"),
    ("boxed{5}", None),
    ("", None),
])
def test_last_boxed(text, expected):
    assert extract.last_boxed(text) == expected


def _boxed_reference(text):
    """Quadratic reference: for each opening from the last, scan for balance."""
    for start in reversed([m.end() for m in re.finditer(r"\\boxed\{", text)]):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(text=_texts(_BRACE_PIECES))
def test_last_boxed_equals_a_direct_scan(text):
    assert extract.last_boxed(text) == _boxed_reference(text)


@pytest.mark.parametrize("text, expected", [
    ("23 + 48 = 71", "71"),
    ("The answer is 1,234.", "1,234"),
    ("it is \u22127 degrees", "-7"),
    ("3.5 then 2", "2"),
    ("x = 3.25", "3.25"),
    ("none", None),
])
def test_last_number(text, expected):
    assert extract.last_number(text) == expected


def test_extract_modes_and_bad_mode():
    text = "I think <answer>7</answer>, i.e. \\boxed{8}, no: 9"
    assert [extract.extract(text, m) for m in extract.MODES] == [
        text, "7", "8", "9"]
    with pytest.raises(ValueError, match=r"'tags'.*none, answer_tag, boxed, "
                                         r"last_number"):
        extract.extract(text, "tags")
