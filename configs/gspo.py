"""gspo: sequence-level ratio and clip (Zheng et al. 2025 (Qwen)).

Run: rljax train --config configs/gspo.py
Print the resolved config: rljax config --config configs/gspo.py
"""

import pathlib
import runpy

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
    return _BASE["get_config"]("gspo")
