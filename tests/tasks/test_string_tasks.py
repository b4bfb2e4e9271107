"""Reverse and sort: exact match rules and generation ranges."""

import pytest

from rljax import tasks
from rljax.tasks import strings

REVERSE = tasks.Example(prompt='Reverse the string "hello".', answer="olleh")
SORT = tasks.Example(prompt="Sort: pear, apple, fig.", answer="apple, fig, pear")


@pytest.mark.parametrize("completion, expected", [
    ("olleh", 1.0),
    ("  olleh \n", 1.0),
    ("olleh.", 0.0),
    ('"olleh"', 0.0),
    ("OLLEH", 0.0),
    ("oll eh", 0.0),
    ("hello", 0.0),
    ("", 0.0),
])
def test_reverse_reward(completion, expected):
    assert tasks.get_task("reverse").reward(completion, REVERSE) == expected


@pytest.mark.parametrize("completion, expected", [
    ("apple, fig, pear", 1.0),
    ("apple,fig,pear", 1.0),
    ("  apple ,  fig , pear\n", 1.0),
    ("fig, apple, pear", 0.0),
    ("apple, fig, pear.", 0.0),
    ("apple, fig", 0.0),
    ("apple, fig, pear, pear", 0.0),
    ("Apple, fig, pear", 0.0),
    ("apple fig pear", 0.0),
    ("", 0.0),
])
def test_sort_reward(completion, expected):
    assert tasks.get_task("sort").reward(completion, SORT) == expected


def test_reverse_generation():
    task = tasks.get_task("reverse", seed=0, min_len=3, max_len=4,
                          alphabet="xyz")
    lengths = set()
    for i in range(300):
        example = task.train_example(i)
        text = example.meta["text"]
        assert f'"{text}"' in example.prompt
        assert example.answer == text[::-1]
        assert set(text) <= set("xyz")
        lengths.add(len(text))
    assert lengths == {3, 4}


def test_sort_generation():
    task = tasks.get_task("sort", seed=0, min_words=2, max_words=6)
    counts = set()
    for i in range(300):
        example = task.train_example(i)
        words = example.meta["words"]
        assert len(set(words)) == len(words)
        assert set(words) <= set(strings.WORDS)
        assert ", ".join(words) in example.prompt
        assert example.answer == ", ".join(sorted(words))
        counts.add(len(words))
    assert counts == {2, 3, 4, 5, 6}


@pytest.mark.parametrize("name, kwargs", [
    ("reverse", {"min_len": 0}),
    ("reverse", {"alphabet": "a b"}),
    ("sort", {"max_words": 1000}),
    ("sort", {"words": ("a,b", "c", "d")}),
])
def test_bad_config(name, kwargs):
    with pytest.raises(ValueError):
        tasks.get_task(name, **kwargs)
