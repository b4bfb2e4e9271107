"""The reasoning_gym task: any data set by name, full-credit scoring.

(The seeded-stream, held-out and resume contract is checked for it with the
other generated tasks in test_tasks_base.py.)
"""

import threading

import pytest

from rljax import tasks


def _chain_sum(**kwargs):
    return tasks.get_task("reasoning_gym", **{"dataset": "chain_sum", **kwargs})


def test_substring_answers_get_no_partial_credit():
    import reasoning_gym
    task = _chain_sum(seed=0)
    example = task.train_example(0)
    entry = example.meta["entry"]
    wrong = "1" + example.answer  # Contains the right answer as a substring.
    own = reasoning_gym.create_dataset("chain_sum", seed=0, size=task.size)
    # reasoning-gym's own score: partial credit, len(answer) / len(wrong).
    assert own.score_answer(wrong, entry) == pytest.approx(
        len(example.answer) / len(wrong))
    assert task.reward(f"<answer>{wrong}</answer>", example) == 0.0
    partial = _chain_sum(seed=0, partial_credit=True)
    assert partial.reward(f"<answer>{wrong}</answer>", example) == pytest.approx(
        len(example.answer) / len(wrong))
    # The whole completion is never scored as the answer (no tags: 0.0).
    assert task.reward(f"The answer is {example.answer}", example) == 0.0
    # The data set's own tolerance still applies: "+01,000.00" == "1000".
    assert task.reward(f"<answer> {int(example.answer):,}.00 </answer>",
                       example) == 1.0


def test_dataset_args_reach_the_generator():
    task = _chain_sum(dataset_args={"min_terms": 2, "max_terms": 2,
                                    "min_digits": 1, "max_digits": 1})
    for i in range(30):
        expression = task.train_example(i).meta["entry"]["metadata"]["expression"]
        terms = expression.replace("-", "+").split("+")
        assert len(terms) == 2 and all(len(t.strip()) == 1 for t in terms)
    assert task.config()["dataset_args"]["max_terms"] == 2


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(dataset="chain_summ"), r"dataset='chain_summ' is not a reasoning-gym "
                                 r"data set; valid: .*chain_sum"),
    (dict(dataset_args={"max_termz": 3}), r"dataset_args=.*rejected by "
                                          r"'chain_sum'.*its fields: min_terms"),
    (dict(dataset_args={"min_terms": 5, "max_terms": 2}), r"rejected by "
                                                         r"'chain_sum'"),
    (dict(dataset_args={"seed": 3}), r"dataset_args may not set seed"),
    (dict(size=0), r"size=0 must be an int >= 1"),
    (dict(prompt_style="chatty"), r"prompt_style='chatty'; valid: '' \(none\), "
                                  r".*default"),
    (dict(extract="tags"), r"extract='tags' is not an extraction mode"),
])
def test_config_errors_name_the_field(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        _chain_sum(**kwargs)


def test_prompt_style_is_the_system_prompt():
    from reasoning_gym.utils import SYSTEM_PROMPTS
    task = _chain_sum(prompt_style="direct")
    example = task.train_example(0)
    assert task.messages(example) == [
        {"role": "system", "content": SYSTEM_PROMPTS["direct"]},
        {"role": "user", "content": example.prompt}]
    bare = _chain_sum(prompt_style="")
    assert bare.messages(example) == [{"role": "user", "content": example.prompt}]


def test_another_data_set_by_name_with_other_extraction():
    task = tasks.get_task("reasoning_gym", dataset="gsm_symbolic", seed=1,
                          extract="last_number")
    example = task.train_example(0)
    assert task.reward(f"So the result is {example.answer}.", example) == 1.0
    assert example.answer != "0.5"
    assert task.reward("So the result is 0.5.", example) == 0.0


def test_scoring_from_a_sampler_thread():
    task = _chain_sum(seed=2)
    examples = [task.train_example(i) for i in range(4)]
    out = []
    thread = threading.Thread(target=lambda: out.extend(
        task.reward(f"<answer>{e.answer}</answer>", e) for e in examples))
    thread.start()
    thread.join()
    assert out == [1.0] * 4
    assert task.stats() == {"reward_timeouts": 0, "reward_errors": 0}
