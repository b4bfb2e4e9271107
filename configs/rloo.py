"""rloo: leave-one-out baseline, one on-policy REINFORCE step (Ahmadian et al. 2024).

Run: rljax train --config configs/rloo.py
Print the resolved config: rljax config --config configs/rloo.py
"""

import pathlib
import runpy

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
    return _BASE["get_config"]("rloo")
