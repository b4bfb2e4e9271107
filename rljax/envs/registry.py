"""Environment names -> classes; ``get_env`` builds a fresh one per call."""

from __future__ import annotations

import inspect

from rljax.envs.base import Environment
from rljax.envs.calculator import CalculatorEnv
from rljax.envs.python_tool import PythonEnv
from rljax.envs.toy import ToyMultiTurnEnv
from rljax.tasks.base import Task

ENVS: dict[str, type[Environment]] = {
    cls.name: cls for cls in (CalculatorEnv, PythonEnv, ToyMultiTurnEnv)
}


def env_names() -> list[str]:
    """The registered environment names, sorted."""
    return sorted(ENVS)


def _config_keys(cls: type[Environment]) -> list[str]:
    parameters = inspect.signature(cls.__init__).parameters
    return [name for name, p in parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY]


def get_env(name: str, task: Task, **kwargs) -> Environment:
    """A new, independent environment ``name`` on ``task`` (one per episode).

    Raises:
      ValueError: for an unknown name (listing the valid ones), an unknown
        config key (listing the environment's keys), or a task the
        environment cannot drive.
    """
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; valid environments: "
                         f"{', '.join(env_names())}")
    cls = ENVS[name]
    keys = _config_keys(cls)
    unknown = sorted(set(kwargs) - set(keys))
    if unknown:
        raise ValueError(
            f"environment {name!r} has no config key(s) {', '.join(unknown)}; "
            f"valid keys: {', '.join(keys)}")
    return cls(task, **kwargs)
