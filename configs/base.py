"""The common base of every run config: a recipe's five axes (rljax.recipes).

Load any recipe with `--config configs/base.py:<recipe>`, or use the
per-recipe files (`--config configs/dapo.py`). Override fields from the
command line: `--config.loss.eps_high=0.3`. The config is locked: an unknown
key fails, and `rljax.recipes.validate` rejects impossible combinations after
the overrides are applied.
"""

from rljax import recipes


def get_config(recipe: str | None = None):
    """Locked config of `recipe` (default grpo)."""
    return recipes.get(recipe or "grpo")
