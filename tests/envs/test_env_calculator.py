"""Calculator environment: exact tool values, error observations, turn rules."""

import pytest

from rljax import envs
from rljax import tasks

# 23 + 48 = 71.
ARITH = tasks.Example(prompt="Compute 23 + 48. Answer with just the number.",
                      answer=71)
# 3 * 7 + 2 * 5 = 21 + 10 = 31, each number at most once.
COUNTDOWN = tasks.Example(prompt="Using the numbers 2, 3, 5, 7, 1, ...",
                          answer={"numbers": [2, 3, 5, 7, 1], "target": 31})


def make(task_name="arithmetic", **kwargs):
    return envs.get_env("calculator", tasks.get_task(task_name), **kwargs)


@pytest.mark.parametrize("expression, value", [
    ("23 + 48", "71"),
    ("3 + 4 * 2", "11"),           # * before +.
    ("(1 + 2) * (3 - 10)", "-21"),  # 3 * -7.
    ("7 / 2", "7/2"),              # Exact, not 3.5.
    ("6 / 4 * 2", "3"),            # 3/2 * 2.
    (" 2 \u00d7 3 ", "6"),          # Unicode times, surrounding spaces.
])
def test_calculate_exact(expression, value):
    outcome = envs.calculate(expression)
    assert outcome.ok and outcome.text == value


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"),
    ("1 / (2 - 2)", "division by zero"),
    ("2 ** 10", "not an arithmetic expression"),
    ("-3 + 1", "not an arithmetic expression"),  # No unary minus.
    ("__import__('os')", "not an arithmetic expression"),
    ("1.5 + 1", "not an arithmetic expression"),
    ("2 +", "not an arithmetic expression"),
    ("", "not an arithmetic expression"),
    ("1+" * 150 + "1", "not an arithmetic expression"),  # Over 200 chars.
])
def test_calculate_errors(expression, message):
    outcome = envs.calculate(expression)
    assert not outcome.ok and message in outcome.text


def test_arithmetic_episode_tool_then_final_answer():
    env = make()
    messages = env.reset(ARITH)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "<calc>" in messages[0]["content"]
    assert messages[1]["content"] == ARITH.prompt

    result = env.step("Let me check. <calc>23 + 48</calc>")
    assert result.observation == [{"role": "user", "content": "Tool result: 71"}]
    assert (result.reward, result.done) == (0.0, False)
    assert result.info["tool_call"] and result.info["tool_ok"]
    assert set(envs.INFO_KEYS) <= set(result.info)

    result = env.step("The answer is 71.")
    assert (result.observation, result.reward, result.done) == ([], 1.0, True)
    assert result.info["final"] and not result.info["tool_call"]
    assert env.metrics() == {
        "turns": 2, "tool_calls": 1, "tool_ok": 1, "tool_errors": 0,
        "tool_timeouts": 0, "observation_chars": len("Tool result: 71"),
        "over_budget": 0, "turn_limit": 0}


def test_wrong_final_answer_gets_task_reward_zero():
    env = make()
    env.reset(ARITH)
    result = env.step("72")
    assert (result.reward, result.done) == (0.0, True)


@pytest.mark.parametrize("message, error", [
    ("<calc>2 +</calc>", "not an arithmetic expression"),
    ("<calc>1 / 0</calc>", "division by zero"),
    ("<calc></calc>", "not an arithmetic expression"),
    ("<calc>import os</calc>", "not an arithmetic expression"),
    ("2 + 3 </calc>", "</calc> without <calc>"),
    ("<calc><calc>1</calc></calc>", "not an arithmetic expression"),
])
def test_malformed_call_gives_error_observation(message, error):
    env = make(tool_bonus=0.5)
    env.reset(ARITH)
    result = env.step(message)
    [observation] = result.observation
    assert observation["role"] == "user"
    assert observation["content"].startswith("Tool error: ")
    assert error in observation["content"]
    assert (result.reward, result.done) == (0.0, False)
    assert result.info["tool_call"] and not result.info["tool_ok"]
    assert env.metrics()["tool_errors"] == 1


@pytest.mark.parametrize("message", [
    "\x00<calc>\x00</calc>", "<calc>" * 1000, "<calc>(" * 500 + "1",
    "<CALC>1</CALC>", "\ud800", "",
])
def test_junk_never_raises(message):
    env = make(max_turns=3)
    env.reset(ARITH)
    result = env.step(message)
    assert isinstance(result.reward, float)


def test_unclosed_tag_reads_to_end_of_message():
    # A loop that stops at "</calc>" and strips it leaves this shape.
    env = make()
    env.reset(ARITH)
    assert env.step("<calc>2 + 3").observation[0]["content"] == "Tool result: 5"


def test_only_the_first_call_runs_and_tool_bonus_is_paid():
    env = make(tool_bonus=0.25)
    env.reset(ARITH)
    result = env.step("<calc>1 + 1</calc> <calc>5 * 5</calc>")
    assert result.observation[0]["content"] == "Tool result: 2"
    assert result.reward == 0.25


def test_max_turns_forces_done_without_running_the_tool():
    env = make(max_turns=2, tool_bonus=1.0)
    env.reset(ARITH)
    assert not env.step("<calc>23 + 48</calc>").done
    # Last turn: the call is not run; the message is scored as the answer
    # ("<calc>70 + 1</calc>": last number 1, not 71).
    result = env.step("<calc>70 + 1</calc>")
    assert (result.observation, result.reward, result.done) == ([], 0.0, True)
    assert result.info["turn_limit"] and result.info["final"]
    assert result.info["tool_call"] and not result.info["tool_ok"]
    assert env.metrics()["turn_limit"] == 1
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("71")


def test_max_turns_one_scores_the_first_message():
    env = make(max_turns=1)
    env.reset(ARITH)
    result = env.step("<calc>23 + 48</calc> so 71")
    assert result.done and result.reward == 1.0


def test_countdown_via_calculator():
    env = make("countdown")
    env.reset(COUNTDOWN)
    result = env.step("Try <calc>3 * 7 + 2 * 5</calc>")
    assert result.observation[0]["content"] == "Tool result: 31"
    result = env.step("<answer>3 * 7 + 2 * 5</answer>")
    assert (result.reward, result.done) == (1.0, True)
    env.reset(COUNTDOWN)  # A reset starts a fresh episode on the same env.
    assert env.metrics()["turns"] == 0
    result = env.step("<answer>3 * 7 + 5</answer>")  # 26, not 31.
    assert (result.reward, result.done) == (0.0, True)


def test_over_budget_ends_with_configured_reward():
    env = make(over_budget_reward=-0.5)
    env.reset(ARITH)
    env.step("<calc>23 + 48</calc>")
    result = env.end_over_budget()
    assert (result.observation, result.reward, result.done) == ([], -0.5, True)
    assert result.info["over_budget"] and result.info["final"]
    assert env.metrics()["over_budget"] == 1
    with pytest.raises(RuntimeError):
        env.end_over_budget()
    default = make()
    default.reset(ARITH)
    assert default.end_over_budget().reward == 0.0


def test_get_env_is_a_factory_and_checks_names_and_keys():
    first, second = make(), make()
    assert first is not second
    first.reset(ARITH)
    first.step("<calc>1 + 1</calc>")
    assert second.metrics()["turns"] == 0
    assert envs.env_names() == ["calculator", "python", "toy_multiturn"]
    with pytest.raises(ValueError, match="calculator, python, toy_multiturn"):
        envs.get_env("shell", tasks.get_task("arithmetic"))
    with pytest.raises(ValueError, match="valid keys: .*tool_bonus"):
        make(bonus=1.0)
    with pytest.raises(RuntimeError, match="before reset"):
        make().step("1")


def test_summarize_metrics():
    # Episode A: one good call, one bad call, final. Episode B: final only.
    a, b = make(), make()
    a.reset(ARITH)
    a.step("<calc>1 + 1</calc>")
    a.step("<calc>1 / 0</calc>")
    a.step("71")
    b.reset(ARITH)
    b.step("71")
    summary = envs.summarize_metrics([a.metrics(), b.metrics()])
    assert summary["turns_per_episode"] == 2.0  # (3 + 1) / 2.
    assert summary["tool_calls"] == 2.0
    assert summary["tool_success_rate"] == 0.5
    assert envs.summarize_metrics([b.metrics()])["tool_success_rate"] == 0.0
