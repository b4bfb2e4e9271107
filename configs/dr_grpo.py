"""dr_grpo: GRPO without the std and with a constant normalizer (Liu et al. 2025).

Run: rljax train --config configs/dr_grpo.py
Print the resolved config: rljax config --config configs/dr_grpo.py
"""

import pathlib
import runpy

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
    return _BASE["get_config"]("dr_grpo")
