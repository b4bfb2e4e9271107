"""Toy multi-turn: the tiny model answers the copy prompt twice in one episode.

Run: rljax train --config configs/toy_multiturn.py --workdir runs/toy_mt
(`--config configs/toy_multiturn.py:rloo` for another recipe.)
Each episode is one row: prompt, first answer, the environment's repeated
prompt (loss mask 0), second answer. Each turn earns half its copy score, so
the return is the mean score. The suite's multi-turn learning test trains it.
"""

import pathlib
import runpy

_TOY = runpy.run_path(str(pathlib.Path(__file__).with_name("toy.py")))


def get_config(recipe: str = "grpo"):
    c = _TOY["get_config"](recipe)
    c.steps = 120
    c.env.name = "toy_multiturn"
    c.env.max_turns = 2
    c.env.token_budget = 2 * c.max_tokens
    c.env.max_row_tokens = 64
    c.rollout.length_bucket = 32
    return c
