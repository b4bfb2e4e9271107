"""InProcessSampler: continuous batching over KV-cache decode slots, length buckets, in-place weight swaps.

A `generate` call becomes rows (prompt x n). They run on a fixed number of
decode slots (`rljax.sampling.engine`): when a row stops, its slot is
refilled with the next waiting row, whose prefill is inserted into the
running decode, until every row is done. `continuous=False` runs the same
slots as static batches instead (each batch decodes until its last row
stops), for comparisons. Shapes come from a small fixed set, so a run
compiles a fixed set of programs:

    slots      a power of two <= max_batch (fewer while a call's tail runs)
    prompt     smallest `prompt_buckets` entry >= the longest prompt inserted together
    capacity   cache positions per slot: the next power of two (>= attention_block)
               holding the call's longest prompt bucket + max_new_tokens

Decode attention reads only the cache blocks each step has written, so a
step costs the same however large the capacity is (`rljax.sampling.slots`).

Weights live outside the compiled programs as an argument, so
`update_weights` swaps them (same structure, shapes and dtypes: checked) with
no recompilation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from rljax import parallel
from rljax.models.transformer import Decoder
from rljax.sampling import engine as engine_lib
from rljax.sampling import slots as slots_lib
from rljax.sampling import weights as weights_lib
from rljax.sampling.engine import RowResult, bucket as _bucket, powers_of_two as _powers_of_two
from rljax.sampling.types import Completion, SamplingParams, check_prompts


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
        powers of two from 16 up to the model's max_seq_len. A row's
        max_new_tokens must fit the largest completion bucket.
      max_batch: decode slots at most (rows decoded together).
      batch_buckets: slot counts; default powers of two up to max_batch (the
        largest must be max_batch).
      version: version of the initial weights.
      top_logprobs: also keep the N most likely tokens of every step (for the
        server's `logprobs=N`); a static shape, fixed per sampler.
      max_stop_ids: width of the per-row stop-token array (static shape).
      mesh: generate sharded on this mesh (rljax.parallel.make_sampler_mesh, or
        the trainer's): weights placed by `rules`, slots over `data`, KV-cache
        heads over `tensor`; `update_weights` reshards whatever it is given.
      rules: logical axis rules (default rljax.parallel.DEFAULT_RULES).
      continuous: refill finished slots with waiting rows (default); False
        decodes static batches, each until its last row stops.
      decode_chunk: decode steps per device call at most (between calls the
        host refills slots and collects tokens).
      refill_min: free slots that trigger a refill while rows wait (default
        max(1, max_batch // 8): one prefill per several finished rows).
      attention_block: cache positions per block of decode attention.
    """

    def __init__(self, model: Decoder, *, prompt_buckets: Sequence[int] | None = None,
                 completion_buckets: Sequence[int] | None = None, max_batch: int = 64,
                 batch_buckets: Sequence[int] | None = None, version: int = 0, top_logprobs: int = 0,
                 max_stop_ids: int = 8, mesh=None, rules=None, continuous: bool = True, decode_chunk: int = 32,
                 refill_min: int | None = None, attention_block: int = 64):
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
        if decode_chunk < 1 or attention_block < 1 or attention_block & (attention_block - 1):
            raise ValueError(f"need decode_chunk >= 1 and attention_block a power of two; got {decode_chunk}, "
                             f"{attention_block}")
        refill_min = max(1, max_batch // 8) if refill_min is None else int(refill_min)
        if not 1 <= refill_min <= max_batch:
            raise ValueError(f"refill_min must be in [1, max_batch={max_batch}], got {refill_min}")
        self.max_batch = int(max_batch)
        self.top_logprobs = int(top_logprobs)
        self.max_stop_ids = int(max_stop_ids)
        self.continuous, self.decode_chunk = bool(continuous), int(decode_chunk)
        self.refill_min, self.attention_block = refill_min, int(attention_block)
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
        """Programs compiled so far by the sampler's jitted insert, decode and slot programs (all samplers)."""
        return slots_lib.compiled_programs()

    # ------------------------------------------------------------------ sampling

    def check_row(self, row: Row) -> None:
        """ValueError for a row that cannot run: context, buckets, ids, settings."""
        n, m, ctx = len(row.prompt_ids), row.max_new_tokens, self.config.max_seq_len
        if n < 1:
            raise ValueError("the prompt is empty; a prompt needs at least one token to condition on")
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
        if not row.temperature >= 0 or not 0 < row.top_p <= 1 or row.top_k < 0:
            raise ValueError(f"need temperature >= 0, top_p in (0, 1], top_k >= 0; got {row.temperature}, "
                             f"{row.top_p}, {row.top_k}")

    def capacity_for(self, rows: Sequence[Row]) -> int:
        """Cache positions per slot for these rows (a power of two >= attention_block)."""
        need = max(max(_bucket(len(r.prompt_ids), self.prompt_buckets, "prompt of length"),
                       len(r.prompt_ids) + r.max_new_tokens) for r in rows)
        cap = self.attention_block
        while cap < need:
            cap *= 2
        return cap

    def engine(self, *, capacity: int | None = None, slots: int | None = None,
               slot_buckets: Sequence[int] | None = None) -> engine_lib.Engine:
        """An Engine on the current weights: for a server, `engine.start()`, then `submit(rows)`
        from any thread. capacity default: the model's context (any valid row fits)."""
        cap = capacity or self.capacity_for([Row((0,) * 1, self.config.max_seq_len - 1)])
        slots = slots or self.max_batch
        if slot_buckets is None:
            slot_buckets = tuple(b for b in self.batch_buckets if b < slots) + (slots,)
        cfg = engine_lib.EngineConfig(
                slots=slots, capacity=cap,
                prompt_buckets=tuple(b for b in self.prompt_buckets if b <= cap) or (cap,),
                n_top=self.top_logprobs, n_stop=self.max_stop_ids, chunk=self.decode_chunk,
                block=self.attention_block, refill_min=self.refill_min, continuous=self.continuous,
                slot_buckets=tuple(slot_buckets))
        return engine_lib.Engine(self.config, self.graphdef, self._params, self.version, cfg, mesh=self.mesh,
                                 rules=self.rules, check=self.check_row)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * n completions, prompt-major (rows i*n .. i*n+n-1 are prompt i's group)."""
        prompts = check_prompts(prompts, self.config.vocab_size)
        return [r.completion for r in self.generate_rows(rows_for(prompts, params))]

    def generate_rows(self, rows: Sequence[Row]) -> list[RowResult]:
        """Samples arbitrary rows (each with its own settings), results in order."""
        for row in rows:
            self.check_row(row)
        if not rows:
            return []
        slots = _bucket(min(len(rows), self.max_batch), self.batch_buckets, "batch of")
        eng = self.engine(capacity=self.capacity_for(rows), slots=slots)
        futures = eng.submit(rows)
        eng.run()
        self.last_timing = dict(eng.timing)
        return engine_lib.wait_all(futures)
