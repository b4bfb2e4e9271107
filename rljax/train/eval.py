"""Held-out evaluation: greedy, and sampled at the rollout temperature.

The distribution RL optimises is the sampled one, so with
`task.eval_samples > 0` each held-out prompt is also sampled that many times
at the rollout temperature. Multi-turn runs play whole greedy episodes and
score their return.
"""

import numpy as np

from rljax.train import collect

EVAL_SEED = 12345  # the same draws at every evaluation of a run


def evaluate(run, version: int) -> dict:
    """`eval_reward` / `eval_accuracy` (and `eval_sampled_*`) on `run.task`'s held-out split."""
    c = run.config
    examples = run.task.eval_split(c.task.eval_size)
    if c.env.name:
        episodes, _ = collect.run_episodes(run, run.task, examples, 1, seed=0,
                                           version=version, greedy=True)
        rewards = np.array([e.reward for e in episodes])
        return {"eval_reward": float(np.mean(rewards)),
                "eval_accuracy": float(np.mean(rewards >= 1.0 - 1e-6))}
    prompts = [collect.render(run, ex, run.task) for ex in examples]
    out = {}
    for prefix, temperature, n in [("eval", 0.0, 1), ("eval_sampled", None, c.task.eval_samples)]:
        if n <= 0:
            continue
        params = collect.sampling_params(run, seed=EVAL_SEED, n=n)
        if temperature is not None:
            params = params.replace(temperature=temperature)
        comps = collect.generate(run, prompts, params)
        rewards = np.array([run.task.reward(collect.decode(run, cc.completion_ids), ex)
                            for cc, ex in zip(comps, np.repeat(examples, n))])
        out[f"{prefix}_reward"] = float(np.mean(rewards))
        out[f"{prefix}_accuracy"] = float(np.mean(rewards >= 1.0))
    return out
