"""toy_multiturn: per-turn copy scores, averaged over K turns."""

import pytest

from rljax import envs
from rljax import tasks

EXAMPLE = tasks.Example(prompt="cab=", answer="cab", meta={"text": "cab"})


def test_two_turns_mean_reward_and_repeated_prompt():
    task = tasks.get_task("toy_copy")
    env = envs.get_env("toy_multiturn", task)
    messages = env.reset(EXAMPLE)
    assert messages == [{"role": "user", "content": "cab="}]

    first = env.step("cab")  # Score 1, over K = 2.
    assert (first.reward, first.done) == (0.5, False)
    assert first.observation == [{"role": "user", "content": "cab="}]
    second = env.step("cax")  # 2 of 3 positions: 2/3, over 2 = 1/3.
    assert second.done and second.observation == []
    assert second.reward == pytest.approx(1 / 3)
    assert second.info["score"] == pytest.approx(2 / 3)
    assert first.reward + second.reward == pytest.approx((1 + 2 / 3) / 2)

    # The whole conversation stays inside the toy tokenizer's vocabulary, and
    # each assistant turn ends in the EOS the model sampled, so the rendered
    # conversation re-encodes to the sampled tokens.
    conversation = messages + [{"role": "assistant", "content": "cab"}]
    conversation += first.observation + [{"role": "assistant", "content": "cae"}]
    tok = task.tokenizer()
    text = tok.apply_chat_template(conversation)
    assert text == "cab=cab<eos>cab=cae<eos>"
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.encode(text).count(tok.eos_token_id) == 2


def test_k_turns_and_budget():
    env = envs.get_env("toy_multiturn", tasks.get_task("toy_reverse"),
                       max_turns=3, over_budget_reward=-1.0)
    env.reset(tasks.Example(prompt="cab=", answer="bac"))
    results = [env.step("bac") for _ in range(2)]
    assert [r.done for r in results] == [False, False]
    assert [r.reward for r in results] == [pytest.approx(1 / 3)] * 2
    assert env.end_over_budget().reward == -1.0


def test_needs_a_toy_task():
    with pytest.raises(ValueError, match="toy_copy or toy_reverse"):
        envs.get_env("toy_multiturn", tasks.get_task("arithmetic"))
