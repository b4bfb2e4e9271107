"""Long contexts: compiled memory and step time of forward + backward of the decoder, per attention and remat.

The function is the gradient of `sum(sequence_logprobs(model, tokens))` w.r.t.
every parameter (a training step without the optimizer), B = 1, random
weights of the `--preset` shapes (smollm2-135m by default).

1. Compiled temporaries (XLA's `memory_analysis().temp_size_in_bytes`,
   compile only, nothing runs) for each T, each attention implementation this
   backend has (xla, blockwise; cudnn on NVIDIA GPUs, splash on TPUs) and each
   remat policy, with the implementation `auto` runs and memory per 1k tokens
   (constant when memory is linear in T).
2. Step time, median of `--repeats` interleaved runs in this process, where
   affordable: on CPU only T <= `--time-max-seq` and with `--time-layers`
   layers of the same shapes, skipping programs whose temporaries exceed
   `--time-budget-gib`; ratios to xla at the same T and remat.
3. Compile time of the `--compile-layers`-layer model (default: all of the
   preset's), layers under one lax.scan vs an unrolled Python loop.

Run: python experiments/bench/long_context.py [--seq 1024 4096 16384 32768] [--remat none full]
       [--time-max-seq 4096] [--time-layers 2] [--repeats 3] [--no-time] [--no-compile-time]
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.models import attention as attention_lib
from rljax.models import get_preset, sequence_logprobs
from rljax.models.transformer import Decoder

GIB = 2 ** 30


def implementations(backend: str) -> list[str]:
    """The attention implementations that can run on `backend` (attention_lib.backend_kind())."""
    return ["xla", "blockwise"] + {"nvidia": ["cudnn"], "tpu": ["splash"]}.get(backend, [])


def _abstract(config):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    return graphdef, state


def grad_step(graphdef):
    def loss(state, tokens_BxT):
        return jnp.sum(sequence_logprobs(nnx.merge(graphdef, state), tokens_BxT))
    return jax.jit(jax.grad(loss))


def compile_step(config, seq: int):
    """(compiled gradient step, seconds to lower + compile) of `config` at [1, seq] tokens."""
    graphdef, state = _abstract(config)
    start = time.perf_counter()
    compiled = grad_step(graphdef).lower(state, jax.ShapeDtypeStruct((1, seq), jnp.int32)).compile()
    return compiled, time.perf_counter() - start


def ran(config, seq: int) -> str:
    """The implementation `config.attention` runs at `seq` queries (the decoder's own choice)."""
    return attention_lib.choose(config.attention, q_len=seq, dtype=config.compute_jnp_dtype,
                                head_dim=config.head_dim)


def memory_table(base, seqs, impls, remats):
    rows, cache = [], {}
    for seq in seqs:
        for impl in ["auto"] + impls:
            config = base.replace(attention=impl)
            chosen = ran(config, seq)
            for remat in remats:
                key = (seq, chosen, remat)
                if key not in cache:  # auto runs one of the others: the same program
                    compiled, seconds = compile_step(config.replace(attention=chosen, remat=remat), seq)
                    cache[key] = compiled.memory_analysis().temp_size_in_bytes
                    print(f"# compiled T={seq} {chosen} remat={remat} in {seconds:.0f} s: "
                          f"{cache[key] / GIB:.2f} GiB", file=sys.stderr, flush=True)
                rows.append((seq, impl, chosen, remat, cache[key]))
    print("| T | attention | ran | remat | temporaries (GiB) | per 1k tokens (MiB) |")
    print("|---|---|---|---|---|---|")
    for seq, impl, chosen, remat, temps in rows:
        print(f"| {seq:,} | {impl} | {chosen} | {remat} | {temps / GIB:.2f} | {temps / 2**20 / (seq / 1024):.0f} |")
    return cache


def _random_state(config):
    """Random parameters of `config`, initialised in one compiled program."""
    return jax.jit(lambda: nnx.state(Decoder(config, rngs=nnx.Rngs(0))))()


def time_table(base, seqs, impls, remats, layers, repeats, budget_gib):
    config_base = base.replace(n_layers=layers)
    print(f"\nStep time (s), forward + backward, {base.d_model}-wide {layers}-layer model with the preset's shapes, "
          f"median of {repeats} interleaved runs:")
    print("| T | attention | remat | temporaries (GiB) | step (s) | vs xla |")
    print("|---|---|---|---|---|---|")
    for seq in seqs:
        for remat in remats:
            runs = {}
            for impl in impls:
                config = config_base.replace(attention=impl, remat=remat)
                compiled, _ = compile_step(config, seq)
                temps = compiled.memory_analysis().temp_size_in_bytes
                if temps > budget_gib * GIB:
                    print(f"| {seq:,} | {impl} | {remat} | {temps / GIB:.2f} | skipped (> {budget_gib} GiB) | |")
                    continue
                state = _random_state(config)
                tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, seq)), jnp.int32)
                jax.block_until_ready(compiled(state, tokens))  # warm up
                runs[impl] = (compiled, state, tokens, temps, [])
            for _ in range(repeats):  # interleaved, so load changes hit every variant alike
                for compiled, state, tokens, _, times in runs.values():
                    start = time.perf_counter()
                    jax.block_until_ready(compiled(state, tokens))
                    times.append(time.perf_counter() - start)
            medians = {impl: float(np.median(r[4])) for impl, r in runs.items()}
            for impl, r in runs.items():
                ratio = f"{medians[impl] / medians['xla']:.2f}x" if "xla" in medians else ""
                print(f"| {seq:,} | {impl} | {remat} | {r[3] / GIB:.2f} | {medians[impl]:.2f} | {ratio} |")
            runs.clear()


def compile_time_table(base, layers, seq):
    config = base.replace(n_layers=layers)
    print(f"\nCompile time (s) of the {layers}-layer gradient step at T={seq:,} ({ran(config, seq)} attention):")
    print("| layers | remat | scanned | unrolled | unrolled / scanned |")
    print("|---|---|---|---|---|")
    for remat in ("none", "full"):
        scanned = compile_step(config.replace(remat=remat), seq)[1]
        unrolled = compile_step(config.replace(remat=remat, scan_layers=False), seq)[1]
        print(f"| {layers} | {remat} | {scanned:.1f} | {unrolled:.1f} | {unrolled / scanned:.1f}x |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    backend = attention_lib.backend_kind()
    on_cpu = backend == "cpu"
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--remat", nargs="+", default=["none", "full"])
    p.add_argument("--attention", nargs="+", default=None, help="implementations (default: all on this backend)")
    p.add_argument("--compute-dtype", default="float32" if on_cpu else "bfloat16")
    p.add_argument("--time-max-seq", type=int, default=4096 if on_cpu else 1 << 30)
    p.add_argument("--time-layers", type=int, default=2 if on_cpu else 0, help="0: the preset's depth")
    p.add_argument("--time-budget-gib", type=float, default=3.0 if on_cpu else 1e9)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile-layers", type=int, default=0, help="0: the preset's depth")
    p.add_argument("--compile-seq", type=int, default=1024)
    p.add_argument("--no-time", action="store_true")
    p.add_argument("--no-compile-time", action="store_true")
    args = p.parse_args(argv)

    base = get_preset(args.preset, compute_dtype=args.compute_dtype, max_seq_len=max(args.seq))
    impls = args.attention or implementations(backend)
    print(f"Command: python experiments/bench/long_context.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"Backend: {backend} ({jax.devices()[0].device_kind}), {args.preset}, B=1, {args.compute_dtype}, "
          f"blocks {base.attention_block_q}x{base.attention_block_kv}\n")
    print("Compiled temporaries of forward + backward (XLA memory analysis, compile only):")
    memory_table(base, args.seq, impls, args.remat)
    if not args.no_time:
        layers = args.time_layers or base.n_layers
        time_table(base, [s for s in args.seq if s <= args.time_max_seq], impls, args.remat, layers, args.repeats,
                   args.time_budget_gib)
    if not args.no_compile_time:
        compile_time_table(base, args.compile_layers or base.n_layers, args.compile_seq)


if __name__ == "__main__":
    main()
