"""The environment contract for multi-turn episodes, and shared bookkeeping.

An episode is ``messages = env.reset(example)``, then for each sampled
assistant turn ``result = env.step(text)``: append the reply and
``result.observation`` to the conversation and sample again, until
``result.done``. The episode's return is the sum of its turns' rewards.

Turn and budget rules (every environment):
  * ``max_turns`` counts assistant turns. The step of turn ``max_turns``
    always returns ``done=True``; tool environments then score that message
    by the task's reward and do not run a tool call in it (no turn is left to
    read the result).
  * The environment does not count tokens. The rollout loop does, and calls
    ``end_over_budget()`` when an episode runs out of its token budget; that
    ends the episode with reward ``over_budget_reward`` (constructor argument,
    default 0.0) for the interrupted turn.
  * ``step`` and ``end_over_budget`` after the episode ended, or before
    ``reset``, raise RuntimeError: that is a bug in the loop, not bad model
    output. Bad model output never raises; it becomes an observation.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Iterable

from rljax.tasks.base import Example, Task

# Keys every StepResult.info carries, so the loop can count without .get().
INFO_KEYS = ("turn", "tool_call", "tool_ok", "tool_timeout", "final",
             "turn_limit", "over_budget")


@dataclasses.dataclass
class StepResult:
    """What one assistant turn produced.

    Attributes:
      observation: chat messages to append after the assistant reply (role
        "user", content prefixed e.g. "Tool result: 42"); [] when done.
      reward: this turn's reward (0.0 when rewards come only at the end).
      done: the episode is over; do not call ``step`` again.
      info: at least the keys of ``INFO_KEYS``: ``turn`` (1-based),
        ``tool_call`` (the message called a tool, well-formed or not),
        ``tool_ok`` (the call ran and returned a value), ``tool_timeout``
        (the tool was killed at its timeout), ``final`` (the reward is the
        episode's final reward), ``turn_limit`` (ended by ``max_turns``),
        ``over_budget`` (ended by ``end_over_budget``).
    """

    observation: list[dict]
    reward: float
    done: bool
    info: dict[str, Any]


def make_info(turn: int, **flags) -> dict[str, Any]:
    """An info dict with every key of ``INFO_KEYS`` (False unless given)."""
    unknown = set(flags) - set(INFO_KEYS)
    if unknown:
        raise ValueError(f"unknown info keys {sorted(unknown)}")
    info: dict[str, Any] = {key: False for key in INFO_KEYS}
    info.update(flags, turn=turn)
    return info


def user_message(content: str) -> dict[str, str]:
    """An observation message. Role "user" works with every chat template."""
    return {"role": "user", "content": content}


class Environment(abc.ABC):
    """One episode at a time; ``get_env`` builds a fresh one per episode.

    Subclasses implement ``_first_messages`` and ``_step``; the base class
    keeps the turn count, enforces the turn limit and the call order, and
    collects the per-episode counters of ``metrics()``.

    Attributes:
      task: gives the prompts and the reward.
      max_turns: assistant turns per episode (>= 1).
      over_budget_reward: the reward ``end_over_budget`` gives.
    """

    name: ClassVar[str] = "environment"

    def __init__(self, task: Task, *, max_turns: int = 4,
                 over_budget_reward: float = 0.0):
        if not isinstance(task, Task):
            raise TypeError(f"{self.name}: task must be a rljax Task, got "
                            f"{type(task).__name__}")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or (
                max_turns < 1):
            raise ValueError(
                f"{self.name}: max_turns must be an int >= 1, got {max_turns!r}")
        self.task = task
        self.max_turns = max_turns
        self.over_budget_reward = float(over_budget_reward)
        self._example: Example | None = None
        self._done = True
        self._counts = _empty_counts()

    # --- implemented by subclasses -------------------------------------------

    @abc.abstractmethod
    def _first_messages(self, example: Example) -> list[dict]:
        """The messages that open an episode on ``example``."""

    @abc.abstractmethod
    def _step(self, message: str, turn: int, last_turn: bool) -> StepResult:
        """One assistant turn; must return done=True when ``last_turn``."""

    # --- the contract --------------------------------------------------------

    @property
    def example(self) -> Example:
        if self._example is None:
            raise RuntimeError(f"{self.name}: call reset(example) first")
        return self._example

    def reset(self, example: Example) -> list[dict]:
        """Starts an episode: clears the counters, returns the first messages."""
        if not isinstance(example, Example):
            raise TypeError(f"{self.name}: reset needs an Example, got "
                            f"{type(example).__name__}")
        self._example = example
        self._done = False
        self._counts = _empty_counts()
        return self._first_messages(example)

    def step(self, assistant_message: str) -> StepResult:
        """Plays one assistant turn (see the module docstring for the rules)."""
        self._require_running("step")
        if not isinstance(assistant_message, str):
            raise TypeError(f"{self.name}: step needs the assistant text as a "
                            f"str, got {type(assistant_message).__name__}")
        self._counts["turns"] += 1
        turn = self._counts["turns"]
        last_turn = turn >= self.max_turns
        result = self._step(assistant_message, turn, last_turn)
        if last_turn and not result.done:
            raise AssertionError(f"{self.name}: _step ignored the turn limit")
        self._record(result)
        return result

    def end_over_budget(self) -> StepResult:
        """Ends the episode because its token budget ran out."""
        self._require_running("end_over_budget")
        result = StepResult(
            observation=[], reward=self.over_budget_reward, done=True,
            info=make_info(self._counts["turns"], final=True, over_budget=True))
        self._counts["over_budget"] = 1
        self._record(result)
        return result

    @property
    def done(self) -> bool:
        return self._done

    def metrics(self) -> dict[str, int]:
        """This episode's counters (a copy).

        turns, tool_calls, tool_ok, tool_errors (malformed or failed calls,
        timeouts included), tool_timeouts, observation_chars (characters of
        the observations returned; the loop counts their tokens),
        over_budget and turn_limit (0 or 1).
        """
        return dict(self._counts)

    # --- helpers -------------------------------------------------------------

    def _require_running(self, what: str) -> None:
        if self._example is None:
            raise RuntimeError(f"{self.name}: {what} before reset(example)")
        if self._done:
            raise RuntimeError(f"{self.name}: {what} after the episode ended")

    def _record(self, result: StepResult) -> None:
        info = result.info
        if info.get("tool_call"):
            self._counts["tool_calls"] += 1
            if info.get("tool_ok"):
                self._counts["tool_ok"] += 1
            else:
                self._counts["tool_errors"] += 1
        if info.get("tool_timeout"):
            self._counts["tool_timeouts"] += 1
        if info.get("turn_limit"):
            self._counts["turn_limit"] = 1
        self._counts["observation_chars"] += sum(
            len(m.get("content", "")) for m in result.observation)
        self._done = bool(result.done)


def _empty_counts() -> dict[str, int]:
    return {"turns": 0, "tool_calls": 0, "tool_ok": 0, "tool_errors": 0,
            "tool_timeouts": 0, "observation_chars": 0, "over_budget": 0,
            "turn_limit": 0}


def summarize_metrics(per_episode: Iterable[dict[str, int]]) -> dict[str, float]:
    """Batch metrics from ``metrics()`` of each episode.

    turns_per_episode (mean), tool_calls (total), tool_success_rate
    (tool_ok / tool_calls; 0.0 without calls, never NaN), tool_timeouts
    (total), observation_chars_per_episode (mean), over_budget_episodes and
    turn_limit_episodes (totals).
    """
    episodes = list(per_episode)
    if not episodes:
        raise ValueError("summarize_metrics: no episodes")
    total = {key: sum(m[key] for m in episodes) for key in _empty_counts()}
    n = len(episodes)
    calls = total["tool_calls"]
    return {
        "turns_per_episode": total["turns"] / n,
        "tool_calls": float(calls),
        "tool_success_rate": total["tool_ok"] / calls if calls else 0.0,
        "tool_timeouts": float(total["tool_timeouts"]),
        "observation_chars_per_episode": total["observation_chars"] / n,
        "over_budget_episodes": float(total["over_budget"]),
        "turn_limit_episodes": float(total["turn_limit"]),
    }
