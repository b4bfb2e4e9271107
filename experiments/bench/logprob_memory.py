"""Peak temporary memory and time of chunked vs. full-logits token log-probs, forward + backward.

Memory is XLA's compiled memory analysis (`temp_size_in_bytes` of
`jax.jit(f).lower(...).compile().memory_analysis()`): exact for the compiled
program, no allocator noise. The function differentiated is
`sum(token_logprobs(h, W, y))` w.r.t. the hidden states h and the unembedding
W, at SmolLM2-135M's width (d = 576) and vocabulary (V = 49152), T = 4096.
Times are the median of a few runs of both versions in this one process.

Run: python experiments/bench/logprob_memory.py [--batch 1 8] [--seq 4096] [--no-time]
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs, token_logprobs_full


def _grad_fn(logprob_fn):
    def loss(h, w, y):
        return jnp.sum(logprob_fn(h, w, y))
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def compiled(kind: str, batch: int, seq: int, d_model: int, vocab: int, chunk_size: int,
             dtype=jnp.float32):
    """(compiled executable, example args) of the forward+backward of `kind` ('chunked' | 'full')."""
    fn = (functools.partial(token_logprobs, chunk_size=chunk_size) if kind == "chunked"
          else token_logprobs_full)
    args = (jax.ShapeDtypeStruct((batch, seq, d_model), dtype),
            jax.ShapeDtypeStruct((vocab, d_model), dtype),
            jax.ShapeDtypeStruct((batch, seq), jnp.int32))
    return _grad_fn(fn).lower(*args).compile()


def temp_bytes(kind: str, batch: int, seq: int, d_model: int, vocab: int,
               chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """XLA's peak temporary allocation for the forward + backward of `kind`."""
    return compiled(kind, batch, seq, d_model, vocab, chunk_size).memory_analysis().temp_size_in_bytes


def _time(executable, args, repeats: int) -> float:
    jax.block_until_ready(executable(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(executable(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--d-model", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-time", action="store_true", help="memory only (compiles, never runs)")
    args = parser.parse_args(argv)

    backend = jax.devices()[0].platform
    print(f"token log-probs, forward + backward (grad wrt hidden and unembedding), float32, "
          f"T={args.seq}, V={args.vocab}, d={args.d_model}, chunk={args.chunk_size}, backend={backend}\n")
    print("| B | full-logits temp memory | chunked temp memory | memory ratio | full time | chunked time | time ratio (chunked/full) |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for batch in args.batch:
        shapes = (batch, args.seq, args.d_model, args.vocab, args.chunk_size)
        full = compiled("full", *shapes)
        chunked = compiled("chunked", *shapes)
        full_mem = full.memory_analysis().temp_size_in_bytes
        chunked_mem = chunked.memory_analysis().temp_size_in_bytes
        row = [f"{batch}", f"{full_mem / 2**20:,.0f} MiB", f"{chunked_mem / 2**20:,.0f} MiB",
               f"{full_mem / chunked_mem:.1f}x"]
        if args.no_time:
            row += ["-", "-", "-"]
        else:
            example = (jnp.asarray(rng.normal(size=(batch, args.seq, args.d_model)), jnp.float32),
                       jnp.asarray(rng.normal(size=(args.vocab, args.d_model)) * 0.02, jnp.float32),
                       jnp.asarray(rng.integers(0, args.vocab, size=(batch, args.seq)), jnp.int32))
            t_full = _time(full, example, args.repeats)
            t_chunked = _time(chunked, example, args.repeats)
            row += [f"{t_full * 1e3:,.0f} ms", f"{t_chunked * 1e3:,.0f} ms", f"{t_chunked / t_full:.2f}"]
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
