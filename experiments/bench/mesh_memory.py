"""Compiled memory per device of the RL train step: FSDP over 8 devices vs. pure data parallelism.

The step is the trainer's (`make_train_step` with the state and batch
shardings of `rljax.parallel`), for the `smollm2-135m` preset and the grpo
recipe with a reference model's log-probs in the batch (KL in the loss).
Nothing is allocated: the step is lowered from ShapeDtypeStructs and compiled,
and XLA's `memory_analysis()` of the partitioned program gives the bytes per
device: arguments (params + Adam moments + batch), outputs, aliased (the
donated state), temporaries. `fsdp=8` shards params and moments eight ways;
`data=8` replicates them.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/bench/mesh_memory.py
     [--rows 16] [--seq 512] [--micro-batches 1] [--preset smollm2-135m] [--remat none full]
(the script sets XLA_FLAGS itself when jax has not started yet). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os

if "jax" not in __import__("sys").modules and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from rljax import parallel  # noqa: E402
from rljax.batch import TrainBatch  # noqa: E402
from rljax.models import get_preset, transformer  # noqa: E402
from rljax.train import config as config_lib  # noqa: E402
from rljax.train import step as step_lib  # noqa: E402

MESHES = {"data=8 (fsdp=1)": dict(data=8, fsdp=1, tensor=1, expert=1),
          "fsdp=8": dict(data=1, fsdp=8, tensor=1, expert=1)}


def abstract_batch(rows: int, seq: int) -> TrainBatch:
    f = jax.ShapeDtypeStruct((rows, seq), jnp.float32)
    i = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
    return TrainBatch(tokens=i, positions=i, loss_mask=f, behavior_logp=f, advantages=f, coef=f,
                      ref_logp=f, policy_version=jax.ShapeDtypeStruct((rows,), jnp.int32))


def memory(mesh_sizes: dict, preset: str, rows: int, seq: int, micro_batches: int, remat: str) -> dict:
    """Bytes per device of the compiled, sharded train step on `mesh_sizes`."""
    config = config_lib.get_config("grpo", **{"model.source": preset, "train.micro_batches": micro_batches,
                                              "rollout.prompts_per_step": rows // 8, "group_size": 8})
    model_cfg = get_preset(preset, remat=remat)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: transformer.Decoder(model_cfg, rngs=nnx.Rngs(0))))
    optimizer = step_lib.make_optimizer(config.optim, config.steps)
    mesh = parallel.make_mesh(mesh_sizes)
    rules = parallel.rules_from_config(config)
    state = jax.eval_shape(lambda p: step_lib.init_state(p, optimizer, 0), params)
    state_sharding = parallel.tree_shardings(state, mesh, rules)
    batch_sharding = parallel.batch_sharding(mesh, rules)
    step = step_lib.make_train_step(config, graphdef, optimizer, micro_batches=micro_batches,
                                    chunk_size=config.model.chunk_size, state_sharding=state_sharding,
                                    batch_sharding=batch_sharding)
    m = step.lower(state, abstract_batch(rows, seq)).compile().memory_analysis()
    out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes}
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--remat", nargs="+", default=["none", "full"], help="model.remat values to compare")
    args = p.parse_args(argv)
    if jax.device_count() != 8:
        raise SystemExit(f"needs 8 devices, found {jax.device_count()}: set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")
    results = {(remat, name): memory(sizes, args.preset, args.rows, args.seq, args.micro_batches, remat)
               for remat in args.remat for name, sizes in MESHES.items()}
    print(f"Train step of `{args.preset}` (grpo, float32), {args.rows} rows x {args.seq} tokens, "
          f"{args.micro_batches} micro-batch(es), 8 devices; MiB per device from "
          f"`.lower(...).compile().memory_analysis()`.\n")
    print("| remat | mesh | arguments (state + batch) | outputs | aliased (donated) | temporaries | "
          "total | data=8 / this |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (remat, name), r in results.items():
        base = results[remat, "data=8 (fsdp=1)"]
        print(f"| {remat} | {name} | {_mib(r['arguments'])} | {_mib(r['outputs'])} | {_mib(r['aliased'])} | "
              f"{_mib(r['temporaries'])} | {_mib(r['total'])} | {base['total'] / r['total']:.2f}x |")
    return results


if __name__ == "__main__":
    main()
