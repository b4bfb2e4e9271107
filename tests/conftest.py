"""Suite-wide JAX settings: fail on implicit rank promotion, as rlax does."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
