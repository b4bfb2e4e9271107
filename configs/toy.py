"""Toy: a tiny transformer learns to copy short strings from scratch, with GRPO.

Run: rljax train --config configs/toy.py --workdir runs/toy
(`--config configs/toy.py:dapo` trains the same toy with another recipe.)
It needs no pretrained weights: the `tiny` preset is initialised from the seed
and the task ships its own character tokenizer. Dense rewards (fraction of
characters right) make it learn within about a minute on 2 CPU cores; the
suite's learning test trains it and asserts the reward rises.
"""

import pathlib
import runpy

import ml_collections

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config(recipe: str = "grpo"):
    c = _BASE["get_config"](recipe)
    c.seed = 0
    c.steps = 150
    c.group_size = 8
    c.max_tokens = 6                 # answers are 2-4 characters + EOS
    c.dapo.overlong_buffer = 1       # only a row that hits the limit is overlong
    c.kl.placement, c.kl.beta = "none", 0.0  # no reference for a from-scratch toy
    c.model.source = "tiny"          # random init from the seed
    c.optim.lr = 1e-3
    c.rollout.prompts_per_step = 8
    c.rollout.length_bucket = 16
    c.task.name = "toy_copy"
    c.task.args = ml_collections.ConfigDict(dict(alphabet="abcd", min_len=2, max_len=4))
    c.task.system_prompt = ""
    c.task.eval_size = 24            # of 336 strings, ~10% are held out
    c.train.checkpoint_every = 50
    return c
