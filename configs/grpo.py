"""grpo: group-normalized advantages, clip, k3 KL in the loss (Shao et al. 2024 (DeepSeekMath)).

Run: rljax train --config configs/grpo.py
Print the resolved config: rljax config --config configs/grpo.py
"""

import pathlib
import runpy

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
    return _BASE["get_config"]("grpo")
