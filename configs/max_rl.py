"""max_rl: group-mean scaled advantages on a base recipe (grpo) (arXiv 2602.02710).

Run: rljax train --config configs/max_rl.py
Print the resolved config: rljax config --config configs/max_rl.py
"""

import pathlib
import runpy

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
    return _BASE["get_config"]("max_rl")
