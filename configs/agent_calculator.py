"""GRPO on SmolLM2-135M-Instruct with a calculator tool, on the arithmetic task.

Run: rljax train --config configs/agent_calculator.py --workdir runs/calc
(`--config configs/agent_calculator.py:dapo` for another recipe.)
The model may write <calc>EXPR</calc>; the environment answers with the value
(a user turn, loss mask 0) and the episode goes on until a reply without a
tool call, which is scored by the task's exact reward, or the turn limit.
"""

import pathlib
import runpy

import ml_collections

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config(recipe: str = "grpo"):
    c = _BASE["get_config"](recipe)
    c.steps = 20
    c.group_size = 4
    c.max_tokens = 48
    c.dapo.overlong_buffer = 16
    c.optim.lr = 1e-5
    c.rollout.prompts_per_step = 4
    c.task.name = "arithmetic"
    c.task.args = ml_collections.ConfigDict(dict(max_value=99, operators="+-"))
    c.task.system_prompt = ""  # the calculator environment brings its own
    c.task.eval_size = 32
    c.env.name = "calculator"
    c.env.max_turns = 3
    c.env.token_budget = 128
    c.env.max_row_tokens = 512
    return c
