"""Meshes, logical axis rules and multi-host start-up: one CPU to a TPU pod.

The mesh has four named axes, sized in the config (`config.mesh`, one size
may be -1: the devices left over):

    data     data parallel, parameters replicated
    fsdp     data parallel, parameters and optimizer state sharded (ZeRO-3)
    tensor   heads, MLP hidden units and the vocabulary split (Megatron)
    expert   MoE experts split

Parameters carry logical axis names (`layers`, `vocab`, `embed`, `heads`,
...; see rljax.models.transformer); activations use `batch`, `length`,
`kv_heads`, `head_dim`. Rules kept in the config map each logical name to mesh axes
(MaxText's `logical_axis_rules`). A dimension is split only over the mesh
axes that exist, are larger than one, are not already used by another
dimension of the same array and divide it; otherwise it is replicated. So
one rule set serves every mesh, and the sampler's own `(data, tensor)` mesh.

Multi-host: `initialize(config)` starts `jax.distributed` (multi-controller:
every process runs this same program on its local devices); the batch is
built on every process and each one feeds only the rows its devices hold
(`shard_batch`, `jax.make_array_from_process_local_data`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger("rljax.parallel")

MESH_AXES = ("data", "fsdp", "tensor", "expert")
SAMPLER_AXES = ("data", "tensor")

# Logical name -> mesh axes. Parameters: FSDP shards the model width, tensor
# parallelism the heads / MLP / vocabulary, expert parallelism the experts.
# The stacked layer axis (the scan over blocks) stays whole: each scan step
# slices one layer. Activations: rows over both data axes (FSDP is data
# parallel too), KV-cache heads over tensor like the k/v projections that
# write them.
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("layers", ()),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("mlp", ("tensor",)),
    ("experts", ("expert",)),
    ("batch", ("data", "fsdp")),
    ("length", ()),
)

Rules = tuple[tuple[str, tuple[str, ...]], ...]


# ----------------------------------------------------------------------------
# Config -> mesh and rules.


def rules_from_config(config) -> Rules:
    """`config.logical_axis_rules` (name -> "axis,axis" strings) as a hashable tuple.

    A config without the section gets DEFAULT_RULES; a section written before a
    logical name existed (e.g. `layers`, from a saved run) gets that name's default.
    """
    section = config.get("logical_axis_rules") if hasattr(config, "get") else None
    if section is None:
        return DEFAULT_RULES
    rules = parse_rules(dict(section))
    named = {name for name, _ in rules}
    return rules + tuple(rule for rule in DEFAULT_RULES if rule[0] not in named)


def parse_rules(rules: Mapping[str, str | Sequence[str] | None] | Rules) -> Rules:
    """Rules from a mapping of logical name -> mesh axes ("fsdp", "data,fsdp", "" or a list)."""
    items = rules.items() if isinstance(rules, Mapping) else rules
    out = []
    for name, axes in items:
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = tuple(a.strip() for a in axes.split(",") if a.strip())
        axes = tuple(axes)
        bad = [a for a in axes if a not in MESH_AXES]
        if bad:
            raise ValueError(f"logical_axis_rules.{name}={','.join(axes)!r}: unknown mesh axis "
                             f"{bad[0]!r}; valid: {', '.join(MESH_AXES)}")
        out.append((str(name), axes))
    return tuple(out)


def mesh_sizes(mesh_config, n_devices: int) -> dict[str, int]:
    """Axis sizes {data, fsdp, tensor, expert} with a -1 resolved from `n_devices`."""
    sizes = {a: int(mesh_config[a]) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    bad = [a for a, s in sizes.items() if s == 0 or s < -1]
    if bad or len(free) > 1:
        raise ValueError(f"mesh sizes {sizes}: each must be >= 1, and at most one may be -1")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if n_devices % fixed:
            raise ValueError(f"mesh {sizes}: {n_devices} devices are not a multiple of the fixed "
                             f"axes' product {fixed}, so mesh.{free[0]}=-1 cannot be resolved")
        sizes[free[0]] = n_devices // fixed
    elif fixed != n_devices:
        raise ValueError(f"mesh {sizes} has {fixed} devices, but there are {n_devices}; "
                         f"set one axis to -1 to use all of them")
    return sizes


def make_mesh(mesh_config=None, devices: Sequence[Any] | None = None) -> Mesh:
    """The trainer's mesh over `devices` (default: every device of every process).

    `mesh_config` is `config.mesh` (or a dict with the four sizes); None is
    pure data parallelism. Axes are Auto: the compiler propagates shardings
    from the parameters and the batch.
    """
    devices = list(jax.devices() if devices is None else devices)
    if mesh_config is None:
        mesh_config = {"data": -1, "fsdp": 1, "tensor": 1, "expert": 1}
    sizes = mesh_sizes(mesh_config, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)


def make_sampler_mesh(tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """The in-process sampler's own `(data, tensor)` mesh over this process's devices.

    Decoding has no use for FSDP (every step would all-gather the weights),
    so the sampler keeps whole weights per tensor shard and splits rows over
    `data`; KV-cache heads follow `tensor`.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if tensor < 1 or len(devices) % tensor:
        raise ValueError(f"mesh.sampler_tensor={tensor} must divide the {len(devices)} local devices")
    return jax.make_mesh((len(devices) // tensor, tensor), SAMPLER_AXES,
                         axis_types=(AxisType.Auto,) * 2, devices=devices)


# ----------------------------------------------------------------------------
# Logical names -> shardings.


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Rules = DEFAULT_RULES) -> P:
    """The PartitionSpec of an array with logical axis `names` and `shape` on `mesh`.

    Each dimension takes the mesh axes its rule names, keeping only those that
    exist on `mesh`, are larger than one, are unused by an earlier dimension
    and keep the dimension divisible; the rest of it is replicated.
    """
    if len(names) != len(shape):
        raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape):
        axes = []
        if name is not None and name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; rules cover {', '.join(table)}")
        for axis in table.get(name, ()) if name is not None else ():
            size = mesh.shape.get(axis, 1)
            if size == 1 or axis in used:
                continue
            if dim % (math.prod(mesh.shape[a] for a in axes) * size):
                continue
            axes.append(axis)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _names_of(x) -> tuple | None:
    if _is_variable(x):
        names = x.get_metadata().get("out_sharding") or x.get_metadata().get("sharding_names")
        return tuple(names) if names else None
    return None


def tree_shardings(tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """NamedShardings for a pytree (arrays or ShapeDtypeStructs; nnx States inside).

    Every nnx Variable with logical axis names (parameters, and the optimizer
    moments optax builds in their image) is sharded by `rules`; every other
    leaf (step counters, RNG keys, scalars) is replicated. The result is a
    prefix of `tree`, usable as jit in/out shardings and for device_put.
    """

    def one(x):
        names = _names_of(x)
        if names is None:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, logical_to_spec(names, x.shape, mesh, rules))

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def batch_sharding(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Rows over the rule of `batch` (data x fsdp by default); one sharding for every field."""
    axes = tuple(a for a in dict(rules).get("batch", ()) if mesh.shape.get(a, 1) > 1)
    return NamedSharding(mesh, P(axes if len(axes) != 1 else axes[0]) if axes else P())


def batch_divisor(mesh: Mesh, rules: Rules = DEFAULT_RULES) -> int:
    """How many ways the rows of a batch are split: micro-batches must be a multiple."""
    return math.prod(mesh.shape.get(a, 1) for a in dict(rules).get("batch", ()))


def microbatch_sharding(sharding: Any) -> Any:
    """`sharding` of a batch with a leading micro-batch axis prepended (unsplit)."""
    return jax.tree.map(lambda s: NamedSharding(s.mesh, P(None, *s.spec)), sharding,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def compute_shardings(sharding: Any, gathered: Sequence[str] = ("fsdp",)) -> Any:
    """`sharding` (a tree of NamedShardings) without the `gathered` axes: the weights' layout
    for compute. FSDP stores weights split over `fsdp` and all-gathers them for the
    forward and backward pass (ZeRO-3); tensor and expert splits stay."""

    def one(s: NamedSharding) -> NamedSharding:
        spec = []
        for entry in s.spec:
            axes = [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
            axes = [a for a in axes if a not in gathered]
            spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        return NamedSharding(s.mesh, P(*spec))

    return jax.tree.map(one, sharding, is_leaf=lambda x: isinstance(x, NamedSharding))


def is_sharded(sharding: NamedSharding) -> bool:
    """True when the array is split over at least one mesh axis larger than one."""
    return not sharding.is_fully_replicated


# ----------------------------------------------------------------------------
# Sharded initialisation and placement.


def init_sharded(make_module: Callable[[], nnx.Module], mesh: Mesh,
                 rules: Rules = DEFAULT_RULES) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of `make_module()`, created already sharded.

    eval_shape -> shardings -> jit(init, out_shardings): no device ever holds
    the whole unsharded model (nanodo's `train.py`).
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(make_module))
    shardings = tree_shardings(abstract, mesh, rules)
    state = jax.jit(lambda: nnx.split(make_module())[1], out_shardings=shardings)()
    return graphdef, state


def init_state_sharded(init_fn: Callable[..., Any], mesh: Mesh, rules: Rules, *args) -> tuple[Any, Any]:
    """(state, shardings): `init_fn(*args)` jitted with out_shardings from its eval_shape.

    For the TrainState: optimizer moments get their parameter's sharding,
    counters and RNG keys are replicated.
    """
    shardings = tree_shardings(jax.eval_shape(init_fn, *args), mesh, rules)
    return jax.jit(init_fn, out_shardings=shardings)(*args), shardings


def shard_params(tree: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """`tree` (host or single-device arrays, identical on every process) placed by `rules`.

    For loaded checkpoints: each process supplies only its devices' slices.
    """
    shardings = tree_shardings(tree, mesh, rules)
    flat, treedef = jax.tree.flatten(tree)
    flat_s = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    out = []
    for x, s in zip(flat, flat_s):
        if isinstance(x, jax.Array) and x.is_fully_addressable and s.is_fully_addressable:
            out.append(jax.device_put(x, s))
            continue
        host = to_host(x)
        out.append(jax.make_array_from_callback(host.shape, s, lambda idx, h=host: h[idx]))
    return jax.tree.unflatten(treedef, out)


def _local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The contiguous rows this process's devices hold of an array sharded on its first axis."""
    starts, stops = [], []
    for idx in sharding.addressable_devices_indices_map(shape).values():
        rows = idx[0] if idx else slice(None)
        start, stop, _ = rows.indices(shape[0])
        starts.append(start)
        stops.append(stop)
    lo, hi = min(starts), max(stops)
    covered = np.zeros(shape[0], bool)
    for a, b in zip(starts, stops):
        covered[a:b] = True
    if not covered[lo:hi].all():
        raise ValueError(f"this process's rows of a {shape} batch are not contiguous under {sharding}; "
                         "order the mesh so each process holds one block of the batch axes")
    return slice(lo, hi)


def shard_batch(batch: Any, sharding: NamedSharding) -> Any:
    """Global arrays from a host batch that every process holds in full.

    Each process passes only the rows its devices hold
    (`jax.make_array_from_process_local_data`); on one process this is a
    sharded device_put.
    """

    def one(x):
        x = to_host(x)
        if x.ndim == 0:
            return jax.make_array_from_process_local_data(NamedSharding(sharding.mesh, P()), x)
        n = math.prod(sharding.mesh.shape[a] for a in _spec_axes(sharding.spec[:1]))
        if x.shape[0] % n:
            raise ValueError(f"a batch of {x.shape[0]} rows cannot be split over {n} devices "
                             f"({sharding.spec}); make rows per micro-batch a multiple of {n}")
        rows = _local_rows(sharding, x.shape)
        return jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(x[rows]), x.shape)

    return jax.tree.map(one, batch)


def _spec_axes(spec) -> list[str]:
    out = []
    for entry in spec:
        if entry is None:
            continue
        out.extend([entry] if isinstance(entry, str) else list(entry))
    return out


def to_host(x: Any) -> np.ndarray:
    """A numpy copy of the global value of `x`, on every process (all-gathered if needed)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def to_local(tree: Any) -> Any:
    """`tree` with every array that spans other processes gathered into a host copy.

    What a sampler on this process's devices needs from the trainer's global
    weights; arrays already fully addressable pass through untouched.
    """
    return jax.tree.map(
        lambda x: to_host(x) if isinstance(x, jax.Array) and not x.is_fully_addressable else x, tree)


class ShardedFn:
    """A jitted function whose listed array arguments are host data fed per process.

    `fn(*args)`: the arguments at `feed` are turned into global arrays sharded
    like `sharding` (rows over the batch axes, `shard_batch`); results are
    returned as they come from the jitted function. Exposes `_cache_size()`
    so callers can check for recompilation.
    """

    def __init__(self, jitted, sharding: NamedSharding, feed: Sequence[int], local_outputs: bool = False):
        self.jitted, self.sharding, self.feed = jitted, sharding, tuple(feed)
        self.local_outputs = local_outputs

    def __call__(self, *args):
        args = list(args)
        for i in self.feed:
            args[i] = shard_batch(args[i], self.sharding)
        out = self.jitted(*args)
        if self.local_outputs and jax.process_count() > 1:
            out = jax.tree.map(to_host, out)
        return out

    def _cache_size(self) -> int:
        return self.jitted._cache_size()

    def lower(self, *args):
        return self.jitted.lower(*args)


# ----------------------------------------------------------------------------
# Multi-host start-up.


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def _managed_multihost() -> bool:
    """A cluster that jax.distributed can detect by itself, with more than one process."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("TPU_PROCESS_ADDRESSES") or ""
    if len([h for h in hosts.split(",") if h]) > 1:
        return True
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if (_env_int(var) or 1) > 1:
            return True
    return False


def initialize(config=None) -> bool:
    """Starts jax.distributed when the config or the environment asks; True if it did.

    `config.distributed.initialize`: "no" never; "yes" always (with the
    coordinator, process count and id from the config, else $JAX_COORDINATOR_ADDRESS,
    $JAX_NUM_PROCESSES, $JAX_PROCESS_ID, else jax's cluster auto-detection:
    Cloud TPU, SLURM, Open MPI, Kubernetes); "auto" when a coordinator or more
    than one process is named, or a multi-host TPU / SLURM / MPI job is
    detected. Must run before anything touches a device; calling it again is
    a no-op. Processes other than 0 log only warnings.
    """
    d = config.distributed if config is not None and "distributed" in config else None
    mode = d.initialize if d is not None else "auto"
    if mode == "no":
        return False
    if _is_initialized():
        return True
    addr = (d.coordinator_address if d is not None else "") or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    num = (d.num_processes if d is not None and d.num_processes > 0 else None) or _env_int("JAX_NUM_PROCESSES")
    pid = d.process_id if d is not None and d.process_id >= 0 else _env_int("JAX_PROCESS_ID")
    ids = d.local_device_ids if d is not None else ""
    local_ids = [int(i) for i in str(ids).split(",") if i.strip()] or None
    if mode == "auto" and not (addr or (num or 1) > 1 or _managed_multihost()):
        return False
    jax.distributed.initialize(coordinator_address=addr, num_processes=num, process_id=pid,
                               local_device_ids=local_ids)
    if jax.process_index() != 0:
        logging.getLogger("rljax").setLevel(logging.WARNING)
    log.info("jax.distributed: process %d of %d, %d local of %d devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def _is_initialized() -> bool:
    try:
        from jax._src import distributed as _dist
        return _dist.global_state.client is not None
    except (ImportError, AttributeError):
        return False


def describe(mesh: Mesh) -> str:
    """"data=2 fsdp=4 tensor=1 expert=1 (8 devices, 2 processes)"."""
    axes = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    procs = len({d.process_index for d in mesh.devices.flat})
    return f"{axes} ({mesh.devices.size} devices, {procs} process{'es' if procs > 1 else ''})"
