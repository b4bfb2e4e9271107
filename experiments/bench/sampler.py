"""Generated tokens/s of the KV-cache sampler vs. a no-cache baseline, prefill and decode separately.

Both run in this process on the same random-weight model, batch, prompts and
sampling (temperature 1, no truncation, no stop tokens, so every row
generates exactly N tokens):

- KV cache: `InProcessSampler.generate`: the continuous-batching engine
  (`rljax.sampling.engine`): one jitted insert (prefill + first token), then
  jitted chunks of single-token decode steps over the slots, attending only
  over the written cache blocks (`rljax.sampling.slots`). Prefill and decode
  times are the sampler's own (`last_timing`).
- No cache: every step runs the full forward over the whole prefix again
  (unembedding only the last position) and samples the next token with the
  same `sample_step`. The prefix lives in a
  buffer padded to a multiple of 32 tokens (causal attention ignores the
  padding), so it compiles a handful of programs, all warmed up before timing.
  Its "prefill" is the first step (a forward over the prompt), its "decode"
  the other N - 1.

Tokens/s = B * N / (prefill + decode); each figure is the median of
`--repeats` runs after a warm-up run that compiles everything.

With `--tunix`, a second table: the same sampler against Tunix's
`tunix.generate.sampler.Sampler` (a Llama3 of the same shapes, random init,
its KV cache sized prompt + new tokens), temperature 1, top_p 1, eos never
sampled, log-probs returned by both (rljax always records them), both timed as whole calls, interleaved, median of `--repeats`.
Tunix is not a dependency: run this script with a Python that has
google-tunix installed (e.g. a throwaway venv made with
--system-site-packages).

Run: python experiments/bench/sampler.py [--new-tokens 32 128] [--batch 8] [--prompt 64]
     [--preset small | small4k | tiny | smollm2-135m] [--tunix]
Prints markdown tables.
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
    if name == "small4k":  # the long-tail issue's shapes: vocab 4,096
        return SMALL.replace(vocab_size=4096)
    return SMALL if name == "small" else get_preset(name)


class _IdTokenizer:
    """Space-separated token ids <-> text, for Tunix's string interface (no BOS, pad 0)."""

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def encode(self, text, **kwargs):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return 0  # falsy: Tunix adds no BOS

    def eos_id(self):
        return self.vocab_size  # never sampled: every row generates exactly N tokens

    def pad_id(self):
        return 0


def tunix_table(config: ModelConfig, sampler: InProcessSampler, prompt: np.ndarray, new_tokens, repeats: int):
    """rljax vs Tunix tokens/s at equal shapes; needs google-tunix importable."""
    from tunix.generate import sampler as tunix_sampler
    from tunix.models.llama3 import model as tunix_llama

    tcfg = tunix_llama.ModelConfig(num_layers=config.n_layers, vocab_size=config.vocab_size,
                                   embed_dim=config.d_model, hidden_dim=config.mlp_dim, num_heads=config.n_heads,
                                   head_dim=config.head_dim, num_kv_heads=config.n_kv_heads,
                                   rope_theta=int(config.rope_theta), norm_eps=config.rms_eps,
                                   weight_tying=config.tie_embeddings)
    tmodel = nnx.jit(lambda: tunix_llama.Llama3(tcfg, rngs=nnx.Rngs(0)))()
    B, P = prompt.shape
    texts = [" ".join(map(str, row)) for row in prompt.tolist()]
    print(f"\nrljax vs Tunix ({tunix_sampler.__name__}), batch {B}, prompt {P}, same shapes, float32\n")
    print("| new tokens | rljax tokens/s | Tunix tokens/s | rljax / Tunix |")
    print("|---|---|---|---|")
    for n in new_tokens:
        cache = tunix_sampler.CacheConfig(cache_size=P + n, num_layers=config.n_layers,
                                          num_kv_heads=config.n_kv_heads, head_dim=config.head_dim)
        tsampler = tunix_sampler.Sampler(tmodel, _IdTokenizer(config.vocab_size), cache)
        params = SamplingParams(max_new_tokens=n, temperature=1.0, seed=0)
        times = {"rljax": [], "tunix": []}
        for rep in range(repeats + 1):  # the first round compiles
            t0 = time.perf_counter()
            out = sampler.generate(prompt.tolist(), params)
            t1 = time.perf_counter()
            tout = tsampler(texts, max_generation_steps=n, max_prompt_length=P, temperature=1.0, top_p=1.0,
                            seed=rep, eos_tokens=[config.vocab_size], return_logprobs=True)
            t2 = time.perf_counter()
            assert all(len(c.completion_ids) == n for c in out)
            assert all(len(t) == n for t in tout.tokens), [len(t) for t in tout.tokens]
            if rep:
                times["rljax"].append(t1 - t0)
                times["tunix"].append(t2 - t1)
        r, t = (B * n / float(np.median(times[k])) for k in ("rljax", "tunix"))
        print(f"| {n} | {r:,.0f} | {t:,.0f} | {r / t:.2f}x |", flush=True)


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
    parser.add_argument("--tunix", action="store_true", help="also compare against Tunix (must be importable)")
    parser.add_argument("--skip-baseline", action="store_true", help="only the Tunix table")
    args = parser.parse_args(argv)

    config = make_config(args.preset)
    model = nnx.jit(lambda: Decoder(config, rngs=nnx.Rngs(0)))()
    graphdef, state = nnx.split(model)
    n_params = sum(x.size for x in jax.tree.leaves(state))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, config.vocab_size, size=(args.batch, args.prompt)).astype(np.int32)
    sampler = InProcessSampler(model, prompt_buckets=(args.prompt,), completion_buckets=tuple(args.new_tokens),
                               max_batch=args.batch, batch_buckets=(args.batch,))

    if args.skip_baseline:
        tunix_table(config, sampler, prompt, args.new_tokens, args.repeats)
        return
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
    if args.tunix:
        tunix_table(config, sampler, prompt, args.new_tokens, args.repeats)


if __name__ == "__main__":
    main()
