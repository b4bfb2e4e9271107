"""Reward functions loaded by `module:function` in the trainer tests."""

import math


def constant_for_even_prompts(completion, example):
    """Reward 1 for every completion of prompts of even length (no signal)."""
    if len(example.prompt) % 2 == 0:
        return 1.0
    return float(completion.strip() == example.answer)


def nan_reward(completion, example):
    return math.nan
