"""dapo: clip-higher, token-mean loss, dynamic sampling, overlong (Yu et al. 2025).

Run: rljax train --config configs/dapo.py
Print the resolved config: rljax config --config configs/dapo.py
"""

import pathlib
import runpy

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
    return _BASE["get_config"]("dapo")
