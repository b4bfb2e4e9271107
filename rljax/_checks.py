"""Boundary checks that fail with a ValueError naming the argument.

chex raises AssertionError; a user passing a bad batch should get a
ValueError that names the field and its shape, so we keep a small helper.
"""

from typing import Any, Sequence

import jax
import numpy as np


def check_rank(name: str, x: Any, rank: int) -> None:
    if np.ndim(x) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {np.shape(x)}")


def check_same_shape(**arrays: Any) -> None:
    """All non-None arrays must share one shape; the error lists every shape."""
    shapes = {k: np.shape(v) for k, v in arrays.items() if v is not None}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{k}={s}" for k, s in shapes.items())
        raise ValueError(f"shapes disagree: {listed}")


def check_choice(field: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(
            f"{field}={value!r} is not valid; choose one of "
            + ", ".join(repr(c) for c in choices))


def is_concrete(x: Any) -> bool:
    """True when x is a value we can inspect now (not a tracer under jit)."""
    return not isinstance(x, jax.core.Tracer)


def check_finite(name: str, x: Any) -> None:
    """Raises on NaN/inf when x is concrete; under jit, callers count instead."""
    if x is None or not is_concrete(x):
        return
    arr = np.asarray(x)
    if not np.all(np.isfinite(arr)):
        bad = np.argwhere(~np.isfinite(arr))[:5].tolist()
        raise ValueError(
            f"{name} has non-finite values (first indices {bad}); "
            "fix the reward function or drop those rows")
