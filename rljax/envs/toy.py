"""A multi-turn toy for tiny from-scratch models: answer the same prompt K times.

Wraps ``toy_copy`` (or ``toy_reverse``). The toy ``CharTokenizer`` knows only
the task's characters, so there is no tool syntax and no system message:

  * ``reset`` gives the task's messages (the user prompt, e.g. "cab=");
  * turn k's reward is ``task.reward(answer) / K`` (the copy score, a
    fraction of positions right, over K): rewards arrive per turn and the
    episode's return is the MEAN score over its K turns, in [0, 1] like the
    single-turn task, so single- and multi-turn runs compare directly;
    ``info["score"]`` holds the undivided score;
  * the observation repeats the prompt exactly (same string, ending in "=")
    so the model answers again;
  * the episode is done after K = ``max_turns`` turns (default 2).
"""

from __future__ import annotations

from rljax.envs.base import Environment, StepResult, make_info, user_message
from rljax.tasks.base import Example, Task
from rljax.tasks.toy import ToyCopyTask


class ToyMultiTurnEnv(Environment):
    """K answers to one toy prompt; per-turn copy score / K (module doc)."""

    name = "toy_multiturn"

    def __init__(self, task: Task, *, max_turns: int = 2,
                 over_budget_reward: float = 0.0):
        if not isinstance(task, ToyCopyTask):
            raise ValueError(
                f"toy_multiturn: needs a toy_copy or toy_reverse task, got "
                f"{getattr(task, 'name', type(task).__name__)!r}")
        super().__init__(task, max_turns=max_turns,
                         over_budget_reward=over_budget_reward)

    def _first_messages(self, example: Example) -> list[dict]:
        return self.task.messages(example)

    def _step(self, message: str, turn: int, last_turn: bool) -> StepResult:
        score = float(self.task.reward(message, self.example))
        info = make_info(turn, final=last_turn, turn_limit=last_turn)
        info["score"] = score
        observation = [] if last_turn else [user_message(self.example.prompt)]
        return StepResult(observation, score / self.max_turns, last_turn, info)
