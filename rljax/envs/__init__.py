"""Multi-turn environments: tools the model calls, rewards per turn or at the end.

    env = rljax.envs.get_env("calculator", rljax.tasks.get_task("countdown"))
    messages = env.reset(example)
    result = env.step(assistant_text)   # observation, reward, done, info
    ...
    env.end_over_budget()                # the loop ran out of tokens

Names: ``calculator`` (``<calc>EXPR</calc>``, exact rational arithmetic),
``python`` (``<python>CODE</python>`` in a sandboxed subprocess) and
``toy_multiturn`` (the toy copy task answered K times, for tiny models).
"""

from rljax.envs.base import Environment
from rljax.envs.base import INFO_KEYS
from rljax.envs.base import StepResult
from rljax.envs.base import summarize_metrics
from rljax.envs.calculator import calculate
from rljax.envs.calculator import CalculatorEnv
from rljax.envs.python_tool import PythonEnv
from rljax.envs.python_tool import run_python
from rljax.envs.registry import ENVS
from rljax.envs.registry import env_names
from rljax.envs.registry import get_env
from rljax.envs.tools import find_tool_call
from rljax.envs.tools import ToolEnvironment
from rljax.envs.tools import ToolOutcome
from rljax.envs.toy import ToyMultiTurnEnv

__all__ = [
    "CalculatorEnv",
    "ENVS",
    "Environment",
    "INFO_KEYS",
    "PythonEnv",
    "StepResult",
    "ToolEnvironment",
    "ToolOutcome",
    "ToyMultiTurnEnv",
    "calculate",
    "env_names",
    "find_tool_call",
    "get_env",
    "run_python",
    "summarize_metrics",
]
