"""rljax: policy-gradient RL for language models as five independent axes.

The public face: recipes, the inspection API, the loss, and the axis modules.
"""

from rljax import advantages
from rljax import kl
from rljax import normalizers
from rljax import offpolicy
from rljax import recipes
from rljax import shaping
from rljax import surrogates
from rljax.batch import TrainBatch
from rljax.objective import compute_advantages
from rljax.objective import policy_loss
from rljax.objective import rl_streams
from rljax.objective import token_weights

__all__ = [
    "TrainBatch",
    "advantages",
    "compute_advantages",
    "kl",
    "normalizers",
    "offpolicy",
    "policy_loss",
    "recipes",
    "rl_streams",
    "shaping",
    "surrogates",
    "token_weights",
]
