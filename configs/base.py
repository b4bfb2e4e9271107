"""The run config of any recipe: its five axes plus the trainer's defaults (the main job).

Run:   rljax train --config configs/base.py:dapo [--config.FIELD=VALUE ...]
Print: rljax config --config configs/base.py:dapo
`:<recipe>` picks one of `rljax recipes` (default grpo, which is also what
`rljax train` uses without --config). The config is locked: an unknown key
fails, and validation rejects impossible combinations after the command-line
overrides are applied. Every field is commented in rljax/train/config.py and
rljax/recipes.py.
"""

from rljax.train import config as config_lib


def get_config(recipe: str | None = None):
    """Locked config of `recipe` (default grpo) with the trainer's defaults."""
    return config_lib.get_config(recipe or "grpo")
