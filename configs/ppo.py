"""ppo: value critic + GAE, clipped ratio, KL in the reward (Schulman et al. 2017; Ouyang et al. 2022).

Run: rljax train --config configs/ppo.py
Print the resolved config: rljax config --config configs/ppo.py
"""

import pathlib
import runpy

_BASE = runpy.run_path(str(pathlib.Path(__file__).with_name("base.py")))


def get_config():
    return _BASE["get_config"]("ppo")
