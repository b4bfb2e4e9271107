"""InProcessSampler: batched generation with a KV cache, length buckets, and in-place weight swaps.

A `generate` call becomes rows (prompt x n), split into batches of at most
`max_batch` rows. Each batch is padded to a fixed set of shapes, so a run
compiles a small, fixed set of programs:

    batch    next power of two (capped at max_batch)
    prompt   smallest `prompt_buckets` entry >= the longest prompt
    decode   smallest `completion_buckets` entry >= the largest max_new_tokens

Then one jitted prefill writes the prompts into a KV cache of
prompt_bucket + completion_bucket slots, and one jitted `lax.while_loop`
samples until every row has stopped (see `rljax.sampling.decode`).

Weights live outside the compiled programs as an argument, so
`update_weights` swaps them (same structure, shapes and dtypes: checked) with
no recompilation.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from rljax import parallel
from rljax.models.transformer import Decoder
from rljax.sampling import decode as decode_lib
from rljax.sampling import weights as weights_lib
from rljax.sampling.types import Completion, SamplingParams, check_prompts


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


def _bucket(n: int, buckets: Sequence[int], what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what} {n} is longer than the largest bucket {buckets[-1]}; buckets: {tuple(buckets)}")


@dataclasses.dataclass(frozen=True)
class Row:
    """One row to sample: a prompt with its own settings (server requests mix them).

    `row_id` with `seed` picks the row's random stream (SamplingParams.seed).
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    row_id: int = 0


@dataclasses.dataclass
class RowResult:
    """A Completion plus, when the sampler keeps them, the top alternatives of each step:
    top_ids / top_logprobs int32 / float32 [len(completion_ids), top_logprobs] (else None)."""

    completion: Completion
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


def rows_for(prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Row]:
    """Prompt-major rows: the n samples of prompt i are rows i*n .. i*n+n-1, with row ids 0, 1, ..."""
    rows = []
    for i, prompt in enumerate(prompts):
        for j in range(params.n):
            rows.append(Row(tuple(prompt), int(params.max_new_tokens), float(params.temperature),
                            float(params.top_p), int(params.top_k), params.stop_token_ids, int(params.seed),
                            i * params.n + j))
    return rows


class InProcessSampler:
    """The in-process `Sampler`: `InProcessSampler(model, prompt_buckets=..., completion_buckets=...)`.

    Args:
      model: the policy `Decoder`; its weights are copied (later changes to the
        model do not leak in; use update_weights).
      prompt_buckets, completion_buckets: ascending padded lengths; default
        powers of two from 16 up to the model's max_seq_len.
      max_batch: rows per compiled batch; larger calls run in several batches.
      batch_buckets: padded batch sizes; default powers of two up to max_batch
        (the largest must be max_batch). `(max_batch,)` compiles the fewest programs.
      version: version of the initial weights.
      top_logprobs: also keep the N most likely tokens of every step (for the
        server's `logprobs=N`); a static shape, fixed per sampler.
      max_stop_ids: width of the per-row stop-token array (static shape).
      mesh: generate sharded on this mesh (rljax.parallel.make_sampler_mesh, or
        the trainer's): weights placed by `rules`, rows over `data`, KV-cache
        heads over `tensor`; `update_weights` reshards whatever it is given.
      rules: logical axis rules (default rljax.parallel.DEFAULT_RULES).
    """

    def __init__(self, model: Decoder, *, prompt_buckets: Sequence[int] | None = None,
                 completion_buckets: Sequence[int] | None = None, max_batch: int = 64,
                 batch_buckets: Sequence[int] | None = None, version: int = 0, top_logprobs: int = 0,
                 max_stop_ids: int = 8, mesh=None, rules=None):
        self.config = model.config
        ctx = self.config.max_seq_len
        default = _powers_of_two(min(16, ctx), ctx)
        self.prompt_buckets = tuple(sorted(int(b) for b in (prompt_buckets or default)))
        self.completion_buckets = tuple(sorted(int(b) for b in (completion_buckets or default)))
        if not self.prompt_buckets or self.prompt_buckets[0] < 1 or not self.completion_buckets or \
                self.completion_buckets[0] < 1:
            raise ValueError(f"buckets must be positive lengths, got prompt {self.prompt_buckets}, "
                             f"completion {self.completion_buckets}")
        if max_batch < 1 or top_logprobs < 0 or max_stop_ids < 1:
            raise ValueError(f"need max_batch >= 1, top_logprobs >= 0, max_stop_ids >= 1; got {max_batch}, "
                             f"{top_logprobs}, {max_stop_ids}")
        self.batch_buckets = tuple(sorted(int(b) for b in (batch_buckets or _powers_of_two(1, max_batch))))
        if self.batch_buckets[0] < 1 or self.batch_buckets[-1] != max_batch:
            raise ValueError(f"batch_buckets {self.batch_buckets} must be positive and end at max_batch={max_batch}")
        self.max_batch = int(max_batch)
        self.top_logprobs = int(top_logprobs)
        self.max_stop_ids = int(max_stop_ids)
        self.graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError(f"the model has non-parameter state, which the sampler cannot carry: {rest}")
        self._rest = rest
        self.mesh = mesh
        self.rules = parallel.DEFAULT_RULES if rules is None else tuple(rules)
        if mesh is not None:
            params = parallel.shard_params(params, mesh, self.rules)
        self._params = weights_lib.match_leaves(params, params)  # a private copy
        self.version = int(version)
        self.last_timing: dict[str, float] = {}

    # ------------------------------------------------------------------ weights

    def update_weights(self, state: Any, version: int) -> None:
        """Swaps in `state` (nnx.State of the params, or its pure dict) as `version`; no recompilation."""
        # The trainer's weights may span other hosts' devices: gather them first;
        # match_leaves then reshards onto this sampler's devices.
        state = parallel.to_local(weights_lib.pure_params(state))
        self._params = weights_lib.match_leaves(self._params, state)
        self.version = int(version)

    @property
    def params(self) -> nnx.State:
        return self._params

    def model(self) -> Decoder:
        """A Decoder holding the sampler's current weights (for scoring with the same params)."""
        return nnx.merge(self.graphdef, self._params, self._rest)

    def compiled_programs(self) -> int:
        """Programs compiled so far by the sampler's jitted prefill and decode (all samplers together)."""
        return (decode_lib.prefill_jit._cache_size() + decode_lib.decode_jit._cache_size()
                + _prefill_sharded_jit._cache_size() + _decode_sharded_jit._cache_size())

    # ------------------------------------------------------------------ sharding

    def _prefill(self, graphdef, params, prompt_BxP, prompt_len_B, *, cache_len):
        if self.mesh is None:
            return decode_lib.prefill_jit(graphdef, params, prompt_BxP, prompt_len_B, cache_len=cache_len)
        put = self._rows
        return _prefill_sharded_jit(graphdef, params, put(prompt_BxP), put(prompt_len_B), cache_len=cache_len,
                                    mesh=self.mesh, rules=self.rules)

    def _decode(self, graphdef, params, logits, cache, last_routing, *rows, max_new, n_top):
        if self.mesh is None:
            return decode_lib.decode_jit(graphdef, params, logits, cache, last_routing, *rows, max_new=max_new,
                                         n_top=n_top)
        return _decode_sharded_jit(graphdef, params, logits, cache, last_routing, *map(self._rows, rows),
                                   max_new=max_new, n_top=n_top, mesh=self.mesh, rules=self.rules)

    def _rows(self, x):
        """`x` with its rows over the batch axes (replicated when they do not divide)."""
        names = ("batch",) + (None,) * (x.ndim - 1)
        spec = parallel.logical_to_spec(names, x.shape, self.mesh, self.rules)
        return jax.device_put(x, NamedSharding(self.mesh, spec))

    # ------------------------------------------------------------------ sampling

    def check_row(self, row: Row) -> None:
        """ValueError for a row that cannot run: context, buckets, ids, settings."""
        n, m, ctx = len(row.prompt_ids), row.max_new_tokens, self.config.max_seq_len
        if m < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {m}")
        if n + m > ctx:
            raise ValueError(f"prompt of {n} tokens + max_new_tokens {m} = {n + m} exceeds the model's context "
                             f"of {ctx} tokens")
        _bucket(n, self.prompt_buckets, "prompt of length")
        _bucket(m, self.completion_buckets, "max_new_tokens")
        if len(row.stop_token_ids) > self.max_stop_ids:
            raise ValueError(f"{len(row.stop_token_ids)} stop token ids; at most {self.max_stop_ids}")
        bad = [t for t in row.prompt_ids + row.stop_token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}")

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * n completions, prompt-major (rows i*n .. i*n+n-1 are prompt i's group)."""
        prompts = check_prompts(prompts, self.config.vocab_size)
        return [r.completion for r in self.generate_rows(rows_for(prompts, params))]

    def generate_rows(self, rows: Sequence[Row]) -> list[RowResult]:
        """Samples arbitrary rows (each with its own settings), in order; batches of <= max_batch rows."""
        for row in rows:
            self.check_row(row)
        version, params = self.version, self._params
        timing = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "tokens": 0}
        results: list[RowResult] = []
        for start in range(0, len(rows), self.max_batch):
            results.extend(self._run_batch(rows[start:start + self.max_batch], params, version, timing))
        self.last_timing = timing
        return results

    def _run_batch(self, rows: Sequence[Row], params: nnx.State, version: int, timing: dict) -> list[RowResult]:
        n = len(rows)
        B = _bucket(n, self.batch_buckets, "batch of")
        P = _bucket(max(len(r.prompt_ids) for r in rows), self.prompt_buckets, "prompt of length")
        C = _bucket(max(r.max_new_tokens for r in rows), self.completion_buckets, "max_new_tokens")
        S = self.max_stop_ids
        # Padding rows: a one-token prompt and max_new 0, done before the first step.
        prompt = np.zeros((B, P), np.int32)
        prompt_len = np.ones((B,), np.int32)
        stop = np.full((B, S), -1, np.int32)
        max_new = np.zeros((B,), np.int32)
        temperature = np.ones((B,), np.float32)
        top_p = np.ones((B,), np.float32)
        top_k = np.zeros((B,), np.int32)
        seeds = np.zeros((B,), np.uint32)
        row_ids = np.zeros((B,), np.uint32)
        for b, r in enumerate(rows):
            prompt[b, :len(r.prompt_ids)] = r.prompt_ids
            prompt_len[b] = len(r.prompt_ids)
            stop[b, :len(r.stop_token_ids)] = r.stop_token_ids
            max_new[b] = r.max_new_tokens
            temperature[b], top_p[b], top_k[b] = r.temperature, r.top_p, r.top_k
            seeds[b] = r.seed % 2**32  # keys take 32-bit seeds
            row_ids[b] = r.row_id % 2**32

        t0 = time.perf_counter()
        logits, cache, prompt_routing, last_routing = self._prefill(
                self.graphdef, params, jnp.asarray(prompt), jnp.asarray(prompt_len), cache_len=P + C)
        jax.block_until_ready(logits)
        t1 = time.perf_counter()
        out = self._decode(self.graphdef, params, logits, cache, last_routing, jnp.asarray(prompt_len),
                           jnp.asarray(seeds), jnp.asarray(row_ids), jnp.asarray(temperature),
                           jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(stop),
                           jnp.asarray(max_new), max_new=C, n_top=self.top_logprobs)
        out = jax.device_get(out)
        t2 = time.perf_counter()
        timing["prefill_s"] += t1 - t0
        timing["decode_s"] += t2 - t1
        timing["decode_steps"] += int(out.steps)
        prompt_routing = None if prompt_routing is None else np.asarray(prompt_routing)

        results = []
        for b, r in enumerate(rows):
            k = int(out.n_tokens_B[b])
            completion = Completion(
                prompt_ids=list(r.prompt_ids), completion_ids=out.tokens_BxC[b, :k].tolist(),
                logprobs=out.logp_BxC[b, :k].tolist(), finish_reason="stop" if out.stopped_B[b] else "length",
                version=version,
                routing=None if out.routing_BxCxLxK is None else np.asarray(out.routing_BxCxLxK[b, :k]),
                prompt_routing=None if prompt_routing is None else prompt_routing[b, :len(r.prompt_ids)])
            timing["tokens"] += k
            top = self.top_logprobs > 0
            results.append(RowResult(completion, out.top_ids_BxCxN[b, :k] if top else None,
                                     out.top_logp_BxCxN[b, :k] if top else None))
        return results


def _constrain_cache(cache, mesh, rules):
    """The KV cache pinned to rows over `data` and heads over `tensor` (where they divide)."""
    def one(x, names):
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, parallel.logical_to_spec(names, x.shape, mesh, rules)))
    kv = ("layers", "batch", "length", "kv_heads", "head_dim")
    return type(cache)(k=one(cache.k, kv), v=one(cache.v, kv), lengths_B=one(cache.lengths_B, ("batch",)))


def _prefill_sharded(graphdef, state, prompt_BxP, prompt_len_B, cache_len, mesh, rules):
    out = decode_lib.prefill(graphdef, state, prompt_BxP, prompt_len_B, cache_len)
    return (out[0], _constrain_cache(out[1], mesh, rules)) + tuple(out[2:])


def _decode_sharded(graphdef, state, logits, cache, *args, max_new, n_top, mesh, rules):
    return decode_lib.decode(graphdef, state, logits, _constrain_cache(cache, mesh, rules), *args,
                             max_new=max_new, n_top=n_top)


# Meshes and rules are static: one program per (mesh, shapes), like the unsharded jits.
_prefill_sharded_jit = jax.jit(_prefill_sharded, static_argnames=("graphdef", "cache_len", "mesh", "rules"))
_decode_sharded_jit = jax.jit(_decode_sharded, static_argnames=("graphdef", "max_new", "n_top", "mesh", "rules"))
