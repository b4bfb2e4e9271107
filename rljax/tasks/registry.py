"""Task names -> classes, and construction by name."""

from __future__ import annotations

import dataclasses

from rljax.tasks.arithmetic import ArithmeticTask
from rljax.tasks.base import Task
from rljax.tasks.countdown import CountdownTask
from rljax.tasks.dataset import DatasetTask
from rljax.tasks.reasoning import ReasoningGymTask
from rljax.tasks.strings import ReverseTask, SortTask
from rljax.tasks.toy import ToyCopyTask, ToyReverseTask

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (ArithmeticTask, CountdownTask, DatasetTask, ReasoningGymTask,
                ReverseTask, SortTask, ToyCopyTask, ToyReverseTask)
}


def task_names() -> list[str]:
    """The registered task names, sorted."""
    return sorted(TASKS)


def get_task(name: str, **kwargs) -> Task:
    """Builds the task ``name`` with config ``kwargs`` (e.g. ``seed=3``).

    Raises:
      ValueError: for an unknown name (listing the valid ones) or an unknown
        config key (listing the task's keys).
    """
    if name not in TASKS:
        raise ValueError(
            f"unknown task {name!r}; valid tasks: {', '.join(task_names())}")
    cls = TASKS[name]
    keys = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(kwargs) - set(keys))
    if unknown:
        raise ValueError(
            f"task {name!r} has no config key(s) {', '.join(unknown)}; valid "
            f"keys: {', '.join(keys)}")
    return cls(**kwargs)
