"""Every reward and answer parser on adversarial inputs of 100k-1.6M characters.

No timing is asserted. Each input is large enough that a quadratic parser
(a lazy regex rescanning from every unclosed "<answer>", a brace scan from
every "\\boxed{", a parse per "=" piece) takes minutes on it, so a regression
shows as this file blowing the suite's time budget; the linear parsers finish
all of it in about a second. The results are asserted too, so a parser cannot
pass by giving up early.
"""

import pytest

from rljax import tasks
from rljax.tasks import arithmetic, countdown, extract, strings, toy
from rljax.tasks.base import Example

N = 200_000  # Repeats of a short pattern.

# name -> text; each is a known worst case of some parser's former or
# naive form (see the module docstring).
ADVERSARIAL = {
    "unclosed_answer_tags": "<answer>" * N,
    "answer_tags_closed_at_end": "<answer>" * N + "7</answer>",
    "unclosed_boxes": "\\boxed{" * N,
    "open_braces": "{" * N,
    "close_braces": "}" * N,
    "equals_chain": "1=" * N,
    "digits": "1" * N,
    "thousands": "1" + ",000" * (N // 4),
    "comma_ones": "1," * N,
    "minus_signs": "-" * N,
    "dots": "1." * N,
    "parens": "(" * N,
    "newlines": "\n1" * N,
    "boxed_numbers": "\\boxed{1}" * (N // 10),
    "spaces_then_text": " " * N + "x",
}

_COUNTDOWN = Example("p", {"numbers": [3, 5, 3], "target": 24})
_NUMBER = Example("p", 7)


def _every_parser(text):
    """Runs every reward and extractor of rljax.tasks on ``text``."""
    out = [extract.extract(text, mode) for mode in extract.MODES]
    out.append(countdown.reward(text, _COUNTDOWN, format_reward=0.1))
    out.append(arithmetic.reward(text, _NUMBER))
    out.append(arithmetic.reward(text, _NUMBER, strict=True))
    out.append(strings.strip_reward(text, "abc"))
    out.append(strings.word_list_reward(text, "a, b"))
    out.append(toy.position_reward(text, "abc"))
    return out


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_every_parser_on_adversarial_input(name):
    text = ADVERSARIAL[name]
    values = _every_parser(text)
    assert all(0.0 <= v <= 1.0 for v in values[len(extract.MODES):])


def test_adversarial_results_are_the_rules_results():
    # The answers on the worst cases, so "finished fast" means "right".
    assert extract.answer_tag(ADVERSARIAL["unclosed_answer_tags"]) is None
    assert extract.answer_tag(ADVERSARIAL["answer_tags_closed_at_end"]) == (
        "<answer>" * (N - 1) + "7")
    assert extract.last_boxed(ADVERSARIAL["unclosed_boxes"]) is None
    assert extract.last_boxed(ADVERSARIAL["boxed_numbers"]) == "1"
    assert extract.last_number(ADVERSARIAL["dots"]) == "1.1"  # "1.1" "." "1.1" ...
    assert extract.last_number(ADVERSARIAL["thousands"]) == (
        ADVERSARIAL["thousands"])
    # "7" closes the last tag; 7 is the arithmetic answer, not countdown's.
    assert arithmetic.reward(ADVERSARIAL["answer_tags_closed_at_end"],
                             _NUMBER) == 1.0
    assert countdown.reward("(3 + 5) * 3 = 24" + "=1" * N, _COUNTDOWN) == 0.0
    assert countdown.reward("1 =" * N + "(3 + 5) * 3 = 24", _COUNTDOWN) == 1.0
    assert len(countdown.candidate_expressions(ADVERSARIAL["equals_chain"])) <= (
        countdown.MAX_PIECES)


def test_dataset_scorers_on_adversarial_input(tmp_path):
    # exact and regex (RE2: linear for any pattern, even "(a+)+b", which
    # takes exponential time in Python's backtracking re) after each
    # extraction mode.
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"question": "q{i}", "answer": "(a+)+b"}}\n'
                            for i in range(10)))
    for scorer in ("exact", "regex"):
        for mode in extract.MODES:
            task = tasks.get_task("dataset", path=str(path), scorer=scorer,
                                  extract=mode)
            example = task.train_example(0)
            for text in ("a" * N, "<answer>" * N, "\\boxed{" * N):
                assert task.reward(text, example) == 0.0
            assert task.reward("a" * N + "b", example) == float(
                scorer == "regex" and mode == "none")
