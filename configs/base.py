"""The common base of every run config: a recipe's five axes plus the trainer.

Run: rljax train --config configs/base.py:<recipe> [--config.FIELD=VALUE ...]
The per-recipe files (`configs/dapo.py`, ...) call this with their name. The
config is locked: an unknown key fails, and validation rejects impossible
combinations after the command-line overrides are applied. Every field is
documented in rljax/train/config.py and rljax/recipes.py.
"""

from rljax.train import config as config_lib


def get_config(recipe: str | None = None):
    """Locked config of `recipe` (default grpo) with the trainer's defaults."""
    return config_lib.get_config(recipe or "grpo")
