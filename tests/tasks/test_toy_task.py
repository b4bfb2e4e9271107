"""The toy copy/reverse tasks and the character tokenizer."""

import numpy as np
import pytest

from rljax import tasks
from rljax.tasks import toy

EXAMPLE = tasks.Example(prompt="abc=", answer="abc")


@pytest.mark.parametrize("completion, expected", [
    ("abc", 1.0),
    (" abc\n", 1.0),
    ("abd", 2 / 3),
    ("ab", 2 / 3),  # Missing positions count as wrong.
    ("abcd", 3 / 4),  # Extra positions count as wrong too.
    ("cba", 1 / 3),
    ("xyz", 0.0),
    ("", 0.0),
])
def test_position_reward(completion, expected):
    assert toy.position_reward(completion, EXAMPLE.answer) == pytest.approx(
        expected)
    assert tasks.get_task("toy_copy").reward(completion, EXAMPLE) == (
        pytest.approx(expected))


def test_copy_and_reverse_answers():
    copy = tasks.get_task("toy_copy", seed=0)
    reverse = tasks.get_task("toy_reverse", seed=0)
    for i in range(200):
        for example, answer_of in ((copy.train_example(i), lambda t: t),
                                   (reverse.train_example(i), lambda t: t[::-1])):
            text = example.meta["text"]
            assert example.prompt == text + "=" and 3 <= len(text) <= 5
            assert set(text) <= set("abcde")
            assert example.answer == answer_of(text)


def test_tokenizer_ids_and_round_trip():
    tokenizer = tasks.get_task("toy_copy").tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id,
            tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.vocab_size == 3 + len("abcde=") == len(tokenizer)
    assert tokenizer.encode("abe=") == [3, 4, 7, 8]
    assert tokenizer.encode("ab", add_bos=True) == [1, 3, 4]
    assert tokenizer.decode([1, 3, 4, 2, 0, 0]) == "ab"
    assert tokenizer.decode([1, 3, 2], skip_special_tokens=False) == (
        "<bos>a<eos>")
    assert tokenizer.batch_decode([[3], [4, 2]]) == ["a", "b"]
    task = tasks.get_task("toy_reverse", seed=4)
    for example in [task.train_example(i) for i in range(50)]:
        ids = tokenizer.encode(example.prompt)
        assert tokenizer.decode(ids) == example.prompt


def test_tokenizer_errors():
    tokenizer = toy.CharTokenizer("ab")
    with pytest.raises(ValueError, match=r"\['z'\]"):
        tokenizer.encode("abz")
    with pytest.raises(ValueError, match="id 5"):
        tokenizer.decode([5])
    with pytest.raises(ValueError, match="distinct"):
        toy.CharTokenizer("aa")


def test_chat_template_concatenates_contents():
    tokenizer = tasks.get_task("toy_copy").tokenizer()
    task = tasks.get_task("toy_copy")
    example = task.train_example(0)
    messages = task.messages(example)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == example.prompt
    assert tokenizer.apply_chat_template(
        [{"role": "system", "content": "ab"}, {"role": "user", "content": "c="}],
        tokenize=True) == tokenizer.encode("abc=")


def test_random_policy_gets_dense_signal():
    # A uniform policy over the 5 letters gets about 1/5 of positions right
    # (less for wrong lengths), so rewards vary within a group from step one.
    rng = np.random.default_rng(0)
    task = tasks.get_task("toy_copy", seed=0)
    rewards = []
    for i in range(400):
        example = task.train_example(i)
        guess = "".join(rng.choice(list("abcde"), size=len(example.answer)))
        rewards.append(task.reward(guess, example))
    assert 0.15 < np.mean(rewards) < 0.25
    assert len(set(rewards)) > 3


@pytest.mark.parametrize("kwargs", [
    {"separator": "a"},
    {"separator": "=="},
    {"alphabet": "aab"},
    {"alphabet": "a b"},
    {"min_len": 3, "max_len": 2},
])
def test_bad_config(kwargs):
    with pytest.raises(ValueError):
        tasks.get_task("toy_copy", **kwargs)
