"""gmpo: geometric mean of token ratios, clipped in log space (Zhao et al. 2025).

Run: rljax train --config configs/gmpo.py
Print the resolved config: rljax config --config configs/gmpo.py
"""

import pathlib
import runpy

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
    return _BASE["get_config"]("gmpo")
