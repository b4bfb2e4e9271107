"""GRPO on SmolLM2-135M-Instruct over a JSONL file of word problems, math reward.

Run: rljax train --config experiments/gsm_synth.py --workdir /tmp/gsm_run
The data is examples/gsm_synth/train.jsonl (written by its generate.py): 300
GSM8K-style problems with an integer answer each. The dataset task holds out
the rows whose question hashes below eval_fraction, puts two worked train
solutions before each question (few-shot turns ending in "#### N", which
SmolLM2-135M then imitates: 16% greedy accuracy instead of 9% with an
"answer with just the number" instruction), and scores a completion with
math-verify (parse + verify of the whole completion against the answer
field), so "#### 22", "22 apples" and "\\boxed{22}" all count. Sized for
about ten minutes on 2 CPU cores.
"""

import pathlib
import runpy

import ml_collections

_HERE = pathlib.Path(__file__).resolve().parent
_BASE = runpy.run_path(str(_HERE.parent / "configs" / "base.py"))
DATA = _HERE.parent / "examples" / "gsm_synth" / "train.jsonl"


def get_config(recipe: str = "grpo"):
    c = _BASE["get_config"](recipe)
    c.steps = 6
    c.group_size = 8
    c.max_tokens = 32                # a one-line solution, "#### N" and EOS
    c.dapo.overlong_buffer = 8
    c.optim.lr = 2e-5
    c.rollout.prompts_per_step = 4
    c.rollout.max_prompt_tokens = 256  # two few-shot turns: ~160 tokens
    # Rows are ~200 tokens, 3x the main job's: log-probs over the 49k-token
    # vocabulary in chunks of 32 positions and 4 micro-batches keep the step
    # under ~5 GB (whole rows at once took 22 GB and were OOM-killed).
    c.model.chunk_size = 32
    c.train.micro_batches = 4
    c.task.name = "dataset"
    c.task.args = ml_collections.ConfigDict(dict(
        path=str(DATA),
        prompt_field="question",
        answer_field="answer",
        few_shot=2,
        few_shot_field="solution",   # the worked solution, not just the number
        scorer="math",
        eval_fraction=0.2,           # about 60 of the 300 problems held out
    ))
    c.task.system_prompt = ""        # the task's (none): the chat template's own
    c.task.eval_size = 32
    c.task.eval_samples = 1
    return c
