"""A calculator tool: ``<calc>EXPR</calc>`` gives the exact value of EXPR.

EXPR is checked and evaluated by the countdown task's evaluator
(``rljax.tasks._parse``: a character whitelist, then an ``ast`` whitelist of
non-negative integer literals, binary + - * / and parentheses, at most 200
characters, evaluated with ``fractions.Fraction``); nothing is executed.
Unicode and LaTeX operator spellings (×, ÷, \\times) are accepted. There is
no unary minus: write ``0 - 3``. The value is shown exactly: ``42``, or
``7/2`` for a non-integer.
"""

from __future__ import annotations

from rljax.envs.tools import ToolEnvironment, ToolOutcome
# Private by name, but it is the project's one safe expression evaluator;
# reusing it keeps the calculator's rules identical to the countdown reward's.
from rljax.tasks import _parse

SYSTEM_PROMPT = (
    "You can use a calculator. To get the value of an arithmetic expression, "
    "write <calc>EXPRESSION</calc> and stop; the next message gives "
    "'Tool result: VALUE'. Expressions use non-negative integers, + - * / and "
    "parentheses (write 0 - 3 for -3); division is exact, so 7 / 2 gives 7/2. "
    "When you know the answer, reply without any <calc> tag: that reply is "
    "your final answer.")


def calculate(expression: str) -> ToolOutcome:
    """The exact value of ``expression``, or an error saying why not."""
    text = _parse.normalize_operators(expression).strip()
    tree = _parse.parse_expression(text)
    if tree is None:
        return ToolOutcome(
            f"not an arithmetic expression: {text[:80]!r} (use non-negative "
            f"integers, + - * / and parentheses, at most 200 characters)",
            ok=False)
    value = _parse.evaluate(tree)
    if value is None:  # The evaluator's only failure on a parsed tree.
        return ToolOutcome("division by zero", ok=False)
    return ToolOutcome(str(value), ok=True)  # Fraction: "42" or "7/2".


class CalculatorEnv(ToolEnvironment):
    """Solve a task (arithmetic, countdown, ...) with a calculator tool.

    Rules: see ``rljax.envs.tools`` (turns, final answer, rewards) and
    ``calculate`` (what the tool accepts). The final answer is scored by the
    task's own reward; ``tool_bonus`` (default 0.0) is paid per successful
    call.
    """

    name = "calculator"
    tag = "calc"
    default_system_prompt = SYSTEM_PROMPT

    def run_tool(self, content: str) -> ToolOutcome:
        return calculate(content)
