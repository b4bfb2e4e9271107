"""Policy weights in transit: nnx states as pure dicts, matched leaf by leaf, saved as orbax checkpoints.

The trainer hands a sampler `nnx.state(model, nnx.Param)`; the sampler must
keep exactly its own pytree structure (or jit would retrace and recompile), so
new values are matched to the old ones by path and checked for shape and
dtype. A remote sampler ships the same state as an orbax checkpoint:
`<dir>/<step>/default/`, written by `ocp.CheckpointManager` with
`StandardSave` of the pure dict, which is what `POST /update_weights`
restores.

Integrity: orbax's zstd chunks carry no checksum, so a checkpoint with a few
garbled bytes can restore "successfully" with wrong values. `save_params`
therefore also writes `<dir>/<step>/rljax_checksums.json` (crc32, dtype and
shape of every leaf), and `load_params` verifies it when present and always
refuses non-finite values; a damaged checkpoint is a `CheckpointError` naming
the leaf, never a silently wrong policy.
"""

from __future__ import annotations

import json
import os
import pathlib
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

CHECKSUM_FILE = "rljax_checksums.json"


class CheckpointError(ValueError):
    """A checkpoint that exists but cannot be used: unreadable, corrupted, or not this model's."""


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


def _flat(state: Any) -> list[tuple[str, Any]]:
    return [(_path_str(p), v) for p, v in jax.tree.flatten_with_path(pure_params(state))[0]]


def params_signature(state: Any) -> dict[str, list]:
    """{leaf path: [dtype name, shape]} of a param state: what two models must share to swap weights."""
    return {path: [np.dtype(v.dtype).name, [int(d) for d in np.shape(v)]] for path, v in _flat(state)}


def signature_differences(ours: Mapping[str, list], theirs: Mapping[str, list], limit: int = 5) -> list[str]:
    """Human-readable differences between two params_signature() dicts (at most `limit` of each kind)."""
    out = []
    missing = [p for p in theirs if p not in ours]
    extra = [p for p in ours if p not in theirs]
    if missing:
        out.append(f"parameters only the other side has: {missing[:limit]}")
    if extra:
        out.append(f"parameters only this side has: {extra[:limit]}")
    differ = [p for p in ours if p in theirs and list(ours[p]) != list(theirs[p])]
    for p in differ[:limit]:
        out.append(f"{p}: {ours[p][0]}{list(ours[p][1])} here, {theirs[p][0]}{list(theirs[p][1])} there")
    return out


def match_leaves(template: nnx.State, new: Any, *, copy: bool = True) -> nnx.State:
    """`template` with every leaf replaced by the leaf at the same path in `new`.

    Raises ValueError naming the first missing, extra, or differently shaped /
    typed parameter. With `copy`, the arrays are copied onto the template's
    devices, so the caller (e.g. a train step that donates its params) can
    reuse or delete its buffers.
    """
    old_flat, treedef = jax.tree.flatten_with_path(template.to_pure_dict())
    new_by_path = dict(_flat(new))
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


def _crc32(value) -> int:
    array = np.ascontiguousarray(np.asarray(jax.device_get(value)))
    return zlib.crc32(array.view(np.uint8).reshape(-1))


def _checksums(state: Any) -> dict[str, dict]:
    return {path: {"dtype": np.dtype(v.dtype).name, "shape": [int(d) for d in np.shape(v)], "crc32": _crc32(v)}
            for path, v in _flat(state)}


def _read_only_options():
    """Readers never create, clean up or delete anything in a directory another process writes."""
    import orbax.checkpoint as ocp
    return ocp.CheckpointManagerOptions(read_only=True, create=False)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest finished orbax step under `directory` (None when there is none or no directory)."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        return None
    with ocp.CheckpointManager(directory, options=_read_only_options()) as manager:
        return manager.latest_step()


def save_params(state: Any, directory: str | os.PathLike, step: int, *, keep: int | None = None) -> str:
    """Writes the params as orbax checkpoint `step` under `directory` (blocking); returns the directory.

    `keep`: keep only the newest `keep` steps (a sync directory need not grow).
    The step must not exist yet (orbax refuses to overwrite; see
    `RemoteSampler.update_weights` for how pushes pick a fresh one).
    """
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    pure = pure_params(state)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, cleanup_tmp_directories=True)
    with ocp.CheckpointManager(directory, options=options) as manager:
        manager.save(int(step), args=ocp.args.StandardSave(pure), force=True)
        manager.wait_until_finished()
    # Written after orbax's atomic commit; a reader that races it only skips
    # the check (the file is replaced atomically, never seen half-written).
    sidecar = pathlib.Path(directory) / str(int(step)) / CHECKSUM_FILE
    tmp = sidecar.with_suffix(".tmp")
    tmp.write_text(json.dumps(_checksums(pure)))
    os.replace(tmp, sidecar)
    return directory


def _verify(restored: dict, sidecar: pathlib.Path) -> None:
    for path, value in _flat(restored):
        array = np.asarray(jax.device_get(value))
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            raise CheckpointError(f"parameter {path!r} has non-finite values (NaN or inf)")
    if not sidecar.exists():
        return
    try:
        expected = json.loads(sidecar.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{CHECKSUM_FILE} is unreadable: {e}") from None
    got = _checksums(restored)
    if set(expected) != set(got):
        raise CheckpointError(f"{CHECKSUM_FILE} lists other parameters than the checkpoint holds")
    for path, want in expected.items():
        if want != got[path]:
            raise CheckpointError(f"parameter {path!r} does not match its checksum (the checkpoint is corrupted)")


def _innermost(e: BaseException) -> BaseException:
    seen = {id(e)}
    while (e.__cause__ or e.__context__) is not None and id(e.__cause__ or e.__context__) not in seen:
        e = e.__cause__ or e.__context__
        seen.add(id(e))
    return e


def load_params(directory: str | os.PathLike, step: int | None, template: nnx.State) -> dict:
    """Restores checkpoint `step` (latest when None) of `directory` into the structure of `template`.

    Raises FileNotFoundError when there is no such directory or step, and
    CheckpointError (a ValueError) naming the cause when the checkpoint is
    unreadable, corrupted (checksums, non-finite values) or shaped for another
    model. Nothing is swapped anywhere: the caller decides what to do.
    """
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no checkpoint directory {directory!r}")
    with ocp.CheckpointManager(directory, options=_read_only_options()) as manager:
        steps = manager.all_steps()
        if step is None:
            step = manager.latest_step()
        if step is None or int(step) not in steps:
            latest = max(steps) if steps else None
            raise FileNotFoundError(f"checkpoint step {step} not found in {directory!r} (latest step: {latest})")
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                template.to_pure_dict())
        try:
            restored = manager.restore(int(step), args=ocp.args.StandardRestore(abstract))
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types; the cause is what matters
            cause = _innermost(e)
            raise CheckpointError(f"checkpoint step {step} could not be read: {type(cause).__name__}: "
                                  f"{str(cause).strip().splitlines()[0][:400] if str(cause).strip() else ''}") from e
    _verify(restored, pathlib.Path(directory) / str(int(step)) / CHECKSUM_FILE)
    return restored
