"""The whole run state in one orbax CheckpointManager.

Items: `state` (params, optimizer state, step, RNG) and `meta` (data
position, sampler version, consecutive skips): everything needed to resume
the same trajectory. Only complete checkpoints are ever restored (orbax
finalizes a step atomically), so a run killed mid-save resumes from the
previous one.
"""

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """`save(step, state, meta)`, `restore(abstract_state) -> (step, state, meta)`."""

    def __init__(self, directory, *, keep: int = 2):
        self.directory = pathlib.Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, *, wait: bool = False) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        if wait:
            self.manager.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None):
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return step, restored["state"], dict(restored["meta"])

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract(tree: Any) -> Any:
    """Shape/dtype/sharding skeleton of `tree` for a restore target."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
