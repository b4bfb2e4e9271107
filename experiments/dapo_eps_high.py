"""DAPO's clip-higher: the upper clip bound eps_high on the toy copy task.

Run: rljax sweep experiments/dapo_eps_high.py   (or --print for a scheduler)
On-policy with one optimizer step per batch every ratio is 1 and the clip is
inert, so this sweep takes two epochs of two minibatches per batch: steps 2-4
see ratios away from 1, where eps_high decides which positive-advantage tokens
keep a gradient. 0.2 is PPO's symmetric clip, 0.28 the paper's value.
"""


def get_sweep():
    return {
        "name": "dapo_eps_high",
        "base": "configs/toy.py:dapo",
        "fixed": {"offpolicy.epochs": 2, "offpolicy.minibatches": 2},
        "overrides": [{"loss.eps_high": e} for e in (0.2, 0.28, 0.4)],
    }
