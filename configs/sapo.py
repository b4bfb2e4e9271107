"""sapo: soft sigmoid gate instead of a hard clip (Qwen 2025).

Run: rljax train --config configs/sapo.py
Print the resolved config: rljax config --config configs/sapo.py
"""

import pathlib
import runpy

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
    return _BASE["get_config"]("sapo")
