"""Environments where the model calls a tool by writing a tagged block.

A tool call is ``<TAG>CONTENT</TAG>`` anywhere in the assistant message
(``TAG`` is ``calc`` or ``python``, lowercase). Rules, in order:

  * The first complete block is the call; anything after it is ignored.
  * An opening tag with no closing tag reads as a call running to the end
    of the message: a loop that stops generation at ``</TAG>`` and strips
    the stop string still works.
  * A closing tag without an opening one is a malformed call: an error
    observation, counted as a failed tool call.
  * A message without either tag is the final answer: ``done=True`` and
    ``reward = task.reward(message, example)``.

A call on a turn before ``max_turns`` runs the tool and returns one user
message, ``"Tool result: ..."`` or ``"Tool error: ..."``; its reward is
``tool_bonus`` if the call succeeded, else 0.0. On turn ``max_turns`` the
tool is not run and the message is scored as the final answer.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar, Optional

from rljax.envs.base import Environment, StepResult, make_info, user_message
from rljax.tasks.base import Example, Task

RESULT_PREFIX = "Tool result: "
ERROR_PREFIX = "Tool error: "


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
    """What one tool run gave: ``text`` without the Result/Error prefix."""

    text: str
    ok: bool
    timeout: bool = False


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed call: ``content`` is None when the call is malformed."""

    content: Optional[str]
    error: str = ""


def find_tool_call(message: str, tag: str) -> Optional[ToolCall]:
    """The message's tool call under the module's rules, or None (final)."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    start = message.find(opening)
    if start < 0:
        if closing in message:
            return ToolCall(None, f"{closing} without {opening}; write "
                                  f"{opening}...{closing}")
        return None
    body_start = start + len(opening)
    end = message.find(closing, body_start)
    content = message[body_start:] if end < 0 else message[body_start:end]
    return ToolCall(content)


class ToolEnvironment(Environment):
    """Shared turn logic for tagged-tool environments.

    Attributes (besides the base class's):
      tool_bonus: per-turn reward added when a tool call succeeds.
      system_prompt: replaces the default tool instructions when given; the
        task's own system prompt, if any, follows the instructions.
    """

    tag: ClassVar[str] = "tool"
    default_system_prompt: ClassVar[str] = ""

    def __init__(self, task: Task, *, max_turns: int = 4,
                 over_budget_reward: float = 0.0, tool_bonus: float = 0.0,
                 system_prompt: Optional[str] = None):
        super().__init__(task, max_turns=max_turns,
                         over_budget_reward=over_budget_reward)
        self.tool_bonus = float(tool_bonus)
        self.system_prompt = (self.default_system_prompt
                              if system_prompt is None else system_prompt)

    @abc.abstractmethod
    def run_tool(self, content: str) -> ToolOutcome:
        """Runs one call's content; never raises on bad content."""

    def _first_messages(self, example: Example) -> list[dict]:
        parts = [p for p in (self.system_prompt, self.task.system_prompt) if p]
        messages = []
        if parts:
            messages.append({"role": "system", "content": "\n\n".join(parts)})
        messages.append({"role": "user", "content": example.prompt})
        return messages

    def _final(self, message: str, turn: int, **flags) -> StepResult:
        reward = float(self.task.reward(message, self.example))
        return StepResult([], reward, True,
                          make_info(turn, final=True, **flags))

    def _step(self, message: str, turn: int, last_turn: bool) -> StepResult:
        call = find_tool_call(message, self.tag)
        if call is None:
            return self._final(message, turn)
        if last_turn:
            # No turn is left to read a result: score the message as it is.
            return self._final(message, turn, tool_call=True, turn_limit=True)
        if call.content is None:
            outcome = ToolOutcome(call.error, ok=False)
        else:
            outcome = self.run_tool(call.content)
        prefix = RESULT_PREFIX if outcome.ok else ERROR_PREFIX
        return StepResult(
            observation=[user_message(prefix + outcome.text)],
            reward=self.tool_bonus if outcome.ok else 0.0,
            done=False,
            info=make_info(turn, tool_call=True, tool_ok=outcome.ok,
                           tool_timeout=outcome.timeout))
