"""Policy weights in transit: nnx states as pure dicts, matched leaf by leaf, saved as orbax checkpoints.

The trainer hands a sampler `nnx.state(model, nnx.Param)`; the sampler must
keep exactly its own pytree structure (or jit would retrace and recompile), so
new values are matched to the old ones by path and checked for shape and
dtype. A remote sampler ships the same state as an orbax checkpoint:
`<dir>/<step>/default/`, written by `ocp.CheckpointManager` with
`StandardSave` of the pure dict, which is what `POST /update_weights`
restores.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx


def pure_params(state: Any) -> dict:
    """A plain nested dict of arrays from an nnx.State (or a dict that already is one)."""
    if isinstance(state, nnx.State):
        return state.to_pure_dict()
    if isinstance(state, nnx.Module):
        return nnx.state(state, nnx.Param).to_pure_dict()
    if isinstance(state, Mapping):
        return dict(state)
    raise ValueError(f"expected an nnx.State of the model's params (or its pure dict), got {type(state).__name__}")


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def match_leaves(template: nnx.State, new: Any, *, copy: bool = True) -> nnx.State:
    """`template` with every leaf replaced by the leaf at the same path in `new`.

    Raises ValueError naming the first missing, extra, or differently shaped /
    typed parameter. With `copy`, the arrays are copied onto the template's
    devices, so the caller (e.g. a train step that donates its params) can
    reuse or delete its buffers.
    """
    old_flat, treedef = jax.tree.flatten_with_path(template.to_pure_dict())
    new_flat, _ = jax.tree.flatten_with_path(pure_params(new))
    new_by_path = {_path_str(p): v for p, v in new_flat}
    old_paths = [_path_str(p) for p, _ in old_flat]
    missing = [p for p in old_paths if p not in new_by_path]
    extra = sorted(set(new_by_path) - set(old_paths))
    if missing or extra:
        raise ValueError(f"new weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    leaves = []
    for path, (_, old) in zip(old_paths, old_flat):
        value = new_by_path[path]
        if tuple(np.shape(value)) != tuple(old.shape) or np.dtype(value.dtype) != np.dtype(old.dtype):
            raise ValueError(f"new weight {path!r} is {np.dtype(value.dtype).name}{list(np.shape(value))}, "
                             f"the model's is {np.dtype(old.dtype).name}{list(old.shape)}")
        sharding = getattr(old, "sharding", None)
        leaves.append(jax.device_put(value, sharding, may_alias=False if copy else None))
    result = jax.tree.map(lambda x: x, template)  # a new State, same Variables' structure
    nnx.replace_by_pure_dict(result, jax.tree.unflatten(treedef, leaves))
    return result


def save_params(state: Any, directory: str | os.PathLike, step: int, *, keep: int | None = None) -> str:
    """Writes the params as orbax checkpoint `step` under `directory` (blocking); returns the directory.

    `keep`: keep only the newest `keep` steps (a sync directory need not grow).
    """
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(max_to_keep=keep)
    with ocp.CheckpointManager(directory, options=options) as manager:
        manager.save(int(step), args=ocp.args.StandardSave(pure_params(state)), force=True)
        manager.wait_until_finished()
    return directory


def load_params(directory: str | os.PathLike, step: int | None, template: nnx.State) -> dict:
    """Restores checkpoint `step` (latest when None) of `directory` into the structure of `template`."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise ValueError(f"no checkpoint directory {directory!r}")
    with ocp.CheckpointManager(directory) as manager:
        steps = manager.all_steps()
        if step is None:
            step = manager.latest_step()
        if step is None or int(step) not in steps:
            raise ValueError(f"checkpoint step {step} not found in {directory!r}; available: {sorted(steps)}")
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                template.to_pure_dict())
        return manager.restore(int(step), args=ocp.args.StandardRestore(abstract))
