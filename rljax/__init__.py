"""rljax: policy-gradient RL for language models as five independent axes.

The public face: recipes, the composition the trainer runs (rollout ->
streams -> TrainBatch -> loss), the inspection API built on it, and the axis
modules. docs/algorithms.md has the math.
"""

from rljax import advantages
from rljax import kl
from rljax import normalizers
from rljax import offpolicy
from rljax import recipes
from rljax import shaping
from rljax import surrogates
from rljax.batch import Rollout
from rljax.batch import TrainBatch
from rljax.objective import compute_advantages
from rljax.objective import Estimator
from rljax.objective import Logprobs
from rljax.objective import LossConfig
from rljax.objective import Objective
from rljax.objective import policy_loss
from rljax.objective import rl_streams
from rljax.objective import rollout_token_weights
from rljax.objective import SourceSpec
from rljax.objective import Streams
from rljax.objective import token_streams
from rljax.objective import token_weights
from rljax.objective import train_batch

__all__ = [
    "Estimator",
    "Logprobs",
    "LossConfig",
    "Objective",
    "Rollout",
    "SourceSpec",
    "Streams",
    "TrainBatch",
    "advantages",
    "compute_advantages",
    "kl",
    "normalizers",
    "offpolicy",
    "policy_loss",
    "recipes",
    "rl_streams",
    "rollout_token_weights",
    "shaping",
    "surrogates",
    "token_streams",
    "token_weights",
    "train_batch",
]
