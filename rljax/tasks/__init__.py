"""Verifiable tasks: seeded train streams, held-out eval splits, exact rewards.

    task = rljax.tasks.get_task("arithmetic", seed=0)
    example = task.train_example(step * batch_size + i)
    score = task.reward(completion_text, example)
    held_out = task.eval_split(256)

Your own data: ``get_task("dataset", path="file.jsonl", scorer="math")``
(``rljax.tasks.dataset``); any reasoning-gym data set:
``get_task("reasoning_gym", dataset="chain_sum")`` (``rljax.tasks.reasoning``).

Any ``"module:function"`` taking ``(completion_text, example)`` can replace a
task's reward (``get_task(..., reward_fn="pkg.mod:fn")``) or be loaded with
``load_reward_fn``.
"""

from rljax.tasks.arithmetic import ArithmeticTask
from rljax.tasks.base import Example
from rljax.tasks.base import is_eval_prompt
from rljax.tasks.base import load_reward_fn
from rljax.tasks.base import RewardFn
from rljax.tasks.base import Task
from rljax.tasks.countdown import CountdownTask
from rljax.tasks.dataset import DatasetTask
from rljax.tasks.reasoning import ReasoningGymTask
from rljax.tasks.registry import get_task
from rljax.tasks.registry import task_names
from rljax.tasks.registry import TASKS
from rljax.tasks.strings import ReverseTask
from rljax.tasks.strings import SortTask
from rljax.tasks.toy import CharTokenizer
from rljax.tasks.toy import ToyCopyTask
from rljax.tasks.toy import ToyReverseTask

__all__ = [
    "ArithmeticTask",
    "CharTokenizer",
    "CountdownTask",
    "DatasetTask",
    "Example",
    "ReasoningGymTask",
    "RewardFn",
    "ReverseTask",
    "SortTask",
    "TASKS",
    "Task",
    "ToyCopyTask",
    "ToyReverseTask",
    "get_task",
    "is_eval_prompt",
    "load_reward_fn",
    "task_names",
]
