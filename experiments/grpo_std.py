"""GRPO with and without the group std in the advantage, over two seeds.

Run: rljax sweep experiments/grpo_std.py
`advantage.scale='none'` is Dr. GRPO's advantage (without its constant
normalizer): groups with a small reward spread are no longer scaled up, which
is the question this sweep asks on the toy copy task's dense rewards.
"""


def get_sweep():
    return {
        "name": "grpo_std",
        "base": "configs/toy.py:grpo",
        "product": {"advantage.scale": ["group_std", "none"], "seed": [0, 1]},
    }
