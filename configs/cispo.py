"""cispo: truncated, detached IS weight; every token keeps a gradient (MiniMax-M1 2025).

Run: rljax train --config configs/cispo.py
Print the resolved config: rljax config --config configs/cispo.py
"""

import pathlib
import runpy

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
    return _BASE["get_config"]("cispo")
