"""The aggregation (loss normalization) modes of docs/algorithms.md §3 under GRPO.

Run: rljax sweep experiments/aggregation.py
Every token-level mode on the same advantages and trust region; `seq_mean`
is left out because it needs a sequence-level surrogate (GSPO, GMPO).
The toy's answers are 2-5 tokens, so the length bias these modes differ in
is mild here; notebooks/token_weights.ipynb shows it at 200 vs 800 tokens.
"""

MODES = ("seq_mean_token_mean", "token_mean", "group_token_mean",
         "seq_mean_token_sum", "token_sum_norm")


def get_sweep():
    return {
        "name": "aggregation",
        "base": "configs/toy.py:grpo",
        "overrides": [{"loss.norm": m} for m in MODES],
    }
