"""The task contract, checked for every registered task."""

import json
import textwrap

import hypothesis
from hypothesis import strategies as st
import pytest

from rljax import tasks
from rljax.tasks import base

# The tasks that generate their problems; "dataset" reads a file and has its
# own contract tests (tests/tasks/test_dataset_task.py).
ALL = [name for name in tasks.task_names() if name != "dataset"]


def _right_answer(task, example):
    """A completion that must score 1.0: the ground truth in the task's form."""
    if task.name == "countdown":
        return example.meta["solution"]
    if task.name == "reasoning_gym":
        return f"<answer>{example.answer}</answer>"
    return str(example.answer)


def test_registry_names():
    assert tasks.task_names() == [
        "arithmetic", "countdown", "dataset", "reasoning_gym", "reverse", "sort",
        "toy_copy", "toy_reverse"]


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError) as err:
        tasks.get_task("arithmetics")
    message = str(err.value)
    assert "'arithmetics'" in message
    for name in ALL:
        assert name in message


def test_unknown_config_key_lists_valid_keys():
    with pytest.raises(ValueError, match=r"max_vlaue.*valid keys:.*max_value"):
        tasks.get_task("arithmetic", max_vlaue=9)


@pytest.mark.parametrize("kwargs", [{"seed": -1}, {"seed": 1.5},
                                    {"eval_fraction": 0.0},
                                    {"eval_fraction": 1.0}])
def test_bad_base_config_fails_at_construction(kwargs):
    with pytest.raises((ValueError, TypeError)):
        tasks.get_task("reverse", **kwargs)


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_examples_and_different_seed_differs(name):
    a = tasks.get_task(name, seed=3)
    b = tasks.get_task(name, seed=3)
    c = tasks.get_task(name, seed=4)
    train_a = [a.train_example(i) for i in range(50)]
    # Reversed call order: each example depends only on (seed, index).
    train_b = [b.train_example(i) for i in reversed(range(50))][::-1]
    train_c = [c.train_example(i) for i in range(50)]
    assert train_a == train_b
    assert [e.prompt for e in train_a] != [e.prompt for e in train_c]
    assert a.eval_split(20) == b.eval_split(20)
    assert ([e.prompt for e in a.eval_split(20)]
            != [e.prompt for e in c.eval_split(20)])


@pytest.mark.parametrize("name", ALL)
def test_eval_split_is_held_out_from_train(name):
    task = tasks.get_task(name, seed=0)
    train = {task.train_example(i).prompt for i in range(3000)}
    held_out = task.eval_split(200)
    eval_prompts = {e.prompt for e in held_out}
    assert len(eval_prompts) == 200  # Distinct prompts.
    assert not train & eval_prompts
    # The partition, not luck, is what separates them.
    assert all(tasks.is_eval_prompt(name, p, task.eval_fraction)
               for p in eval_prompts)
    assert not any(tasks.is_eval_prompt(name, p, task.eval_fraction)
                   for p in train)
    # Held out from training runs with any seed, not only the same one.
    other = tasks.get_task(name, seed=1)
    assert not {other.train_example(i).prompt for i in range(500)} & eval_prompts


@pytest.mark.parametrize("name", ALL)
def test_eval_split_is_prefix_stable(name):
    task = tasks.get_task(name, seed=5)
    assert task.eval_split(30)[:10] == task.eval_split(10)
    assert task.eval_split(0) == []


@pytest.mark.parametrize("name", ALL)
def test_examples_are_json_and_right_answer_scores_one(name):
    task = tasks.get_task(name, seed=2)
    for example in [task.train_example(i) for i in range(100)] + (
            task.eval_split(20)):
        record = {"prompt": example.prompt, "answer": example.answer,
                  "meta": example.meta}
        if name == "reasoning_gym":  # Its metadata has tuples (JSON lists).
            assert json.loads(json.dumps(record))["prompt"] == example.prompt
        else:
            assert json.loads(json.dumps(record)) == record
        assert task.reward(_right_answer(task, example), example) == 1.0
        assert task.reward("", example) == 0.0


@pytest.mark.parametrize("name", ALL)
def test_iter_train_resumes_at_a_data_position(name):
    task = tasks.get_task(name, seed=0)
    stream = task.iter_train(start=7)
    assert [next(stream) for _ in range(3)] == [
        task.train_example(i) for i in (7, 8, 9)]


@pytest.mark.parametrize("name", ALL)
def test_describe_states_the_rule(name):
    task = tasks.get_task(name)
    text = task.describe()
    assert text.startswith(name + "(")
    assert "reward: " in text and "1.0" in text
    assert task.config()["seed"] == 0
    assert type(task)(**task.config()) == task  # config() rebuilds the task.


@pytest.mark.parametrize("name", ALL)
def test_messages(name):
    task = tasks.get_task(name)
    example = task.train_example(0)
    assert task.messages(example)[-1] == {"role": "user",
                                          "content": example.prompt}


def test_too_small_problem_space_fails_clearly():
    task = tasks.get_task("toy_copy", alphabet="ab", min_len=1, max_len=1)
    with pytest.raises(ValueError, match="too small"):
        task.eval_split(5)


def test_eval_side_hash_is_stable():
    # A fixed value guards against the partition silently changing between
    # versions (which would leak old eval prompts into training).
    # blake2b-64 of b"arithmetic\x00Compute 1 + 1. ..." is 0xcd38360aef631380,
    # and 0xcd38360aef631380 / 2**64 = 0.80163896...
    prompt = "Compute 1 + 1. Answer with just the number."
    assert base.prompt_hash_unit("arithmetic", prompt) == pytest.approx(
        0xcd38360aef631380 / 2**64)
    assert base.prompt_hash_unit("arithmetic", prompt) == pytest.approx(
        0.8016389633843455)
    assert not tasks.is_eval_prompt("arithmetic", prompt, 0.8)
    assert tasks.is_eval_prompt("arithmetic", prompt, 0.81)
    values = [base.prompt_hash_unit("t", str(i)) for i in range(2000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert 0.07 < sum(v < 0.1 for v in values) / 2000 < 0.13


@pytest.mark.parametrize("name", ALL)
@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(completion=st.text(max_size=300), index=st.integers(0, 50))
def test_reward_in_unit_interval_on_any_text(name, completion, index):
    task = tasks.get_task(name, format_reward=0.1) if name == "countdown" else (
        tasks.get_task(name))
    example = task.train_example(index)
    value = task.reward(completion, example)
    assert isinstance(value, float) and 0.0 <= value <= 1.0
    # Around the right answer too, where parsers do most of their work.
    value = task.reward(completion + _right_answer(task, example) + completion,
                        example)
    assert 0.0 <= value <= 1.0


# --- module:function rewards -----------------------------------------------


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length_match(completion, example):
            return 1.0 if len(completion) == len(str(example.answer)) else 0.0

        class Holder:
            @staticmethod
            def half(completion, example):
                return 0.5

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_load_reward_fn_success(reward_module):
    fn = tasks.load_reward_fn(f"{reward_module}:length_match")
    example = tasks.Example(prompt="p", answer=71)
    assert fn("12", example) == 1.0 and fn("123", example) == 0.0
    assert tasks.load_reward_fn(f"{reward_module}:Holder.half")("", example) == 0.5
    # The built-in rewards are importable the same way.
    assert tasks.load_reward_fn("rljax.tasks.arithmetic:reward")(
        "71", example) == 1.0


@pytest.mark.parametrize("spec, pattern", [
    ("no_such_module_xyz:fn", r"'no_such_module_xyz:fn'.*cannot import module"),
    ("my_rewards:missing", r"'my_rewards:missing'.*no attribute 'missing'"),
    ("my_rewards:NOT_CALLABLE", r"'my_rewards:NOT_CALLABLE' is not callable"),
    ("my_rewards.length_match", r"must look like 'package.module:function'"),
    ("my_rewards:", r"must look like"),
    (":fn", r"must look like"),
    ("a:b:c", r"must look like"),
])
def test_load_reward_fn_errors_name_the_string(reward_module, spec, pattern):
    del reward_module
    with pytest.raises(ValueError, match=pattern):
        tasks.load_reward_fn(spec)


def test_reward_fn_replaces_task_reward(reward_module):
    task = tasks.get_task("arithmetic", reward_fn=f"{reward_module}:Holder.half")
    example = task.train_example(0)
    assert task.reward(str(example.answer), example) == 0.5
    assert "replaces the task reward" in task.describe()
    # A bad spec fails when the task is built, not in the middle of a run.
    with pytest.raises(ValueError, match="nope"):
        tasks.get_task("arithmetic", reward_fn=f"{reward_module}:nope")
