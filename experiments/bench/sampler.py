"""Generated tokens/s of the KV-cache sampler vs. a no-cache baseline, prefill and decode separately.

Both run in this process on the same random-weight model, batch, prompts and
sampling (temperature 1, no truncation, no stop tokens, so every row
generates exactly N tokens):

- KV cache: `InProcessSampler.generate`: one jitted prefill, then one jitted
  `lax.while_loop` of single-token decode steps (`rljax.sampling.decode`).
  Prefill and decode times are the sampler's own (`last_timing`).
- No cache: every step runs the full forward over the whole prefix again
  (unembedding only the last position) and samples the next token with the
  same `sample_step`. The prefix lives in a
  buffer padded to a multiple of 32 tokens (causal attention ignores the
  padding), so it compiles a handful of programs, all warmed up before timing.
  Its "prefill" is the first step (a forward over the prompt), its "decode"
  the other N - 1.

Tokens/s = B * N / (prefill + decode); each figure is the median of
`--repeats` runs after a warm-up run that compiles everything.

Run: python experiments/bench/sampler.py [--new-tokens 32 128] [--batch 8] [--prompt 64]
     [--preset small | tiny | smollm2-135m]
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rljax.models.config import ModelConfig, get_preset
from rljax.models.transformer import Decoder
from rljax.sampling import InProcessSampler, SamplingParams
from rljax.sampling.decode import sample_step

# A small Llama-shaped model: big enough that a forward is real work, small
# enough for a CPU (about 6M parameters).
SMALL = ModelConfig(vocab_size=8192, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, mlp_dim=768,
                    max_seq_len=1024)
PAD_TO = 32


def make_config(name: str) -> ModelConfig:
    return SMALL if name == "small" else get_preset(name)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _no_cache_step(graphdef, state, tokens_BxL, length, key, temperature_B):
    """Full forward over the padded prefix; samples the token after position length - 1."""
    model = nnx.merge(graphdef, state)
    # Unembed only the last position, as the sampler's prefill does: the baseline pays for the
    # recomputed prefix, not for [B, L, V] logits it would throw away.
    hidden_BxLxD = model(tokens_BxL, return_hidden=True).hidden
    last_BxD = jax.lax.dynamic_index_in_dim(hidden_BxLxD, length - 1, axis=1, keepdims=False)
    logits_BxV = jnp.einsum("bd,vd->bv", last_BxD, model.unembed_weight().astype(last_BxD.dtype),
                            preferred_element_type=jnp.float32)
    B = tokens_BxL.shape[0]
    keys_B = jax.random.split(jax.random.fold_in(key, length), B)
    s = sample_step(logits_BxV, keys_B, temperature_B, jnp.zeros((B,), jnp.int32), jnp.ones((B,), jnp.float32))
    return s.tokens_B


def no_cache_generate(graphdef, state, prompt_BxP: np.ndarray, new_tokens: int, seed: int = 0):
    """(tokens [B, N], first-step seconds, other-steps seconds) of the recompute-everything baseline."""
    B, P = prompt_BxP.shape
    total = -(-(P + new_tokens) // PAD_TO) * PAD_TO
    buffer = np.zeros((B, total), np.int32)
    buffer[:, :P] = prompt_BxP
    key, temperature_B = jax.random.key(seed), jnp.ones((B,), jnp.float32)
    t0 = time.perf_counter()
    first = None
    for i in range(new_tokens):
        length = P + i
        width = -(-length // PAD_TO) * PAD_TO  # the prefix, padded: one program per 32 tokens
        tokens = _no_cache_step(graphdef, state, jnp.asarray(buffer[:, :width]), jnp.int32(length), key,
                                temperature_B)
        buffer[:, length] = np.asarray(tokens)  # the host needs the token to build the next input
        if first is None:
            first = time.perf_counter() - t0
    return buffer[:, P:P + new_tokens], first, time.perf_counter() - t0 - first


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--preset", default="small", help='"small" (default), or a model preset name')
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    config = make_config(args.preset)
    model = nnx.jit(lambda: Decoder(config, rngs=nnx.Rngs(0)))()
    graphdef, state = nnx.split(model)
    n_params = sum(x.size for x in jax.tree.leaves(state))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, size=(args.batch, args.prompt)).astype(np.int32)
    sampler = InProcessSampler(model, prompt_buckets=(args.prompt,), completion_buckets=tuple(args.new_tokens),
                               max_batch=args.batch, batch_buckets=(args.batch,))

    backend = jax.devices()[0].platform
    print(f"sampler throughput: {args.preset} model ({n_params / 1e6:.1f}M params, {config.n_layers} layers, "
          f"d={config.d_model}, V={config.vocab_size}), batch {args.batch}, prompt {args.prompt} tokens, "
          f"float32, backend={backend}, median of {args.repeats}\n")
    print("| new tokens | KV prefill | KV decode | KV tokens/s | no-cache first step | no-cache rest | "
          "no-cache tokens/s | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.new_tokens:
        params = SamplingParams(max_new_tokens=n, temperature=1.0, seed=0)
        kv = []
        for _ in range(args.repeats + 1):  # the first run compiles
            out = sampler.generate(prompt.tolist(), params)
            assert all(len(c.completion_ids) == n for c in out)
            kv.append((sampler.last_timing["prefill_s"], sampler.last_timing["decode_s"]))
        base = []
        for _ in range(args.repeats + 1):
            _, first, rest = no_cache_generate(graphdef, state, prompt, n)
            base.append((first, rest))
        kv_pre, kv_dec = np.median(np.array(kv[1:]), axis=0)
        b_pre, b_dec = np.median(np.array(base[1:]), axis=0)
        tokens = args.batch * n
        kv_tps, b_tps = tokens / (kv_pre + kv_dec), tokens / (b_pre + b_dec)
        print(f"| {n} | {kv_pre * 1e3:,.1f} ms | {kv_dec * 1e3:,.1f} ms | {kv_tps:,.0f} | {b_pre * 1e3:,.1f} ms | "
              f"{b_dec * 1e3:,.1f} ms | {b_tps:,.0f} | {kv_tps / b_tps:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
