"""Long-tailed lengths, side by side in one process: each section compares two ways of doing the same work.

Sections (`--section`, default all that exist):

  a  Sampler generated tokens/s, continuous vs static batching, on long-tailed
     completion lengths, and the equal-length throughput with the same
     number of rows and generated tokens.

Section (a). A random-init decoder (d 256, 4 layers, 4 heads of 64, 2 KV
heads, MLP 768, vocab 4,096, float32), `--rows` rows with random
`--prompt`-token prompts, at most `--limit` new tokens each. Each row's
length is drawn from a geometric distribution with median `--median` (at
most limit / 8), clipped to [1, limit], and forced by the row's own
max_new_tokens (a random model has no reliable stop token; the sampler does
not look at max_new_tokens to schedule, it fills slots in row order). The
equal-length rows all have the long-tailed mean length, so both workloads
generate the same number of tokens. Every variant runs on the same sampler
settings (max_batch slots, completion bucket = limit), the variants
interleaved, each figure the median of `--repeats` runs after a warm-up
that compiles everything. tokens/s = generated tokens / wall time of
`generate_rows` (prefill, decode and host work).

Run: python experiments/bench/long_tail.py [--section a] [--rows 256] [--slots 64] [--limit 512]
     [--median 64] [--prompt 32] [--repeats 3]
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from rljax.models.config import ModelConfig
from rljax.models.transformer import Decoder
from rljax.sampling import InProcessSampler
from rljax.sampling.sampler import Row

CONFIG = ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=768,
                     max_seq_len=1024)


def long_tailed_lengths(n: int, median: float, limit: int, rng: np.random.Generator) -> np.ndarray:
    """Geometric lengths (support 1, 2, ...) with the given median, clipped to the limit."""
    p = 1.0 - 0.5 ** (1.0 / median)  # P(len <= median) = 1 - (1 - p)^median = 1/2
    return np.minimum(rng.geometric(p, size=n), limit)


def section_a(args) -> None:
    if args.median > args.limit / 8:
        raise SystemExit(f"--median {args.median} must be at most --limit / 8 = {args.limit / 8}")
    model = nnx.jit(lambda: Decoder(CONFIG, rngs=nnx.Rngs(0)))()
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, CONFIG.vocab_size, size=(args.rows, args.prompt)).tolist()
    tail = long_tailed_lengths(args.rows, args.median, args.limit, rng)
    equal = np.full(args.rows, int(round(tail.mean())))

    def rows(lengths):
        return [Row(tuple(p), int(m), temperature=1.0, seed=1, row_id=i)
                for i, (p, m) in enumerate(zip(prompts, lengths))]

    kw = dict(prompt_buckets=(args.prompt,), completion_buckets=(args.limit,), max_batch=args.slots)
    samplers = {"continuous": InProcessSampler(model, **kw), "static": InProcessSampler(model, continuous=False, **kw)}
    workloads = {"long-tailed": rows(tail), "equal": rows(equal)}
    runs = {(s, w): [] for s in samplers for w in workloads}
    steps = {}
    for rep in range(args.repeats + 1):  # the first round compiles
        for (s, w), times in runs.items():
            t0 = time.perf_counter()
            out = samplers[s].generate_rows(workloads[w])
            dt = time.perf_counter() - t0
            assert [len(r.completion.completion_ids) for r in out] == [r.max_new_tokens for r in workloads[w]]
            if rep:
                times.append(dt)
            t = samplers[s].last_timing
            steps[s, w] = t["decode_steps"]
            print(f"  round {rep} {s:10s} {w:11s} {dt:7.2f} s: {t['decode_steps']} decode steps in {t['chunks']} "
                  f"chunks {t['decode_s']:.2f} s, {t['inserts']} inserts {t['prefill_s']:.2f} s, "
                  f"{t['resizes']} resizes", flush=True)
    tokens = {w: int(sum(r.max_new_tokens for r in rs)) for w, rs in workloads.items()}
    tps = {k: tokens[k[1]] / float(np.median(v)) for k, v in runs.items()}

    print(f"\n(a) sampler tokens/s: {n_params / 1e6:.1f}M-param decoder (d {CONFIG.d_model}, {CONFIG.n_layers} layers, "
          f"vocab {CONFIG.vocab_size}, float32), {args.rows} rows, prompt {args.prompt}, {args.slots} slots, "
          f"limit {args.limit}; long-tailed lengths geometric, median {np.median(tail):.0f}, mean {tail.mean():.1f}, "
          f"max {tail.max()}; equal rows {equal[0]} tokens; backend={jax.devices()[0].platform}, "
          f"median of {args.repeats}\n")
    print("| lengths | generated tokens | continuous tokens/s | static tokens/s | continuous / static | "
          "decode steps (cont / static) |")
    print("|---|---|---|---|---|---|")
    for w in workloads:
        c, s = tps["continuous", w], tps["static", w]
        print(f"| {w} | {tokens[w]:,} | {c:,.0f} | {s:,.0f} | {c / s:.2f}x | "
              f"{steps['continuous', w]} / {steps['static', w]} |")
    print(f"\nlong-tailed / equal-length throughput: continuous {tps['continuous', 'long-tailed'] / tps['continuous', 'equal']:.2f}, "
          f"static {tps['static', 'long-tailed'] / tps['static', 'equal']:.2f}")


SECTIONS = {"a": section_a}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--limit", type=int, default=512)
    parser.add_argument("--median", type=float, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    for name in args.section:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
