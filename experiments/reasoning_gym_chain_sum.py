"""GRPO on SmolLM2-135M-Instruct over reasoning-gym's chain_sum.

Run: rljax train --config experiments/reasoning_gym_chain_sum.py --workdir /tmp/rg_run
Problems like "State the final answer to the following arithmetic problem:
57 + 8 =" come from reasoning-gym's seeded generator (two terms of one or two
digits here); the reward is chain_sum's own score_answer, full credit only.
The answer is the last number of the completion: the 135M model rarely
writes the <answer> tags that reasoning-gym's prompts ask for, and a reward
it never earns teaches nothing. A larger model would keep the default
extract="answer_tag" with prompt_style="default". Sized for a few minutes on
2 CPU cores.
"""

import pathlib
import runpy

import ml_collections

_HERE = pathlib.Path(__file__).resolve().parent
_BASE = runpy.run_path(str(_HERE.parent / "configs" / "base.py"))


def get_config(recipe: str = "grpo"):
    c = _BASE["get_config"](recipe)
    c.steps = 6
    c.group_size = 8
    c.max_tokens = 12
    c.dapo.overlong_buffer = 4
    c.optim.lr = 1e-5
    c.rollout.prompts_per_step = 4
    c.task.name = "reasoning_gym"
    c.task.args = ml_collections.ConfigDict(dict(
        dataset="chain_sum",
        dataset_args=dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2),
        prompt_style="",              # system prompt below instead
        extract="last_number",
    ))
    c.task.system_prompt = "Reply with only the number."
    c.task.eval_size = 48
    c.task.eval_samples = 2
    return c
