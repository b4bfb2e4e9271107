"""Host side of continuous batching: which row runs in which slot, and when.

`Engine` owns a `rljax.sampling.slots.SlotState` of B slots and a FIFO of
waiting rows. Each `step()`:

1. frees the slots of cancelled rows;
2. refills free slots with waiting rows (one `insert` of up to B rows, padded
   to a power of two), in continuous mode once at least `refill_min` slots
   are free (or every waiting row fits), in static mode only when every slot
   is free (the classic batch: a wave runs until its last row stops);
3. shrinks the slot count to the next power of two when no row waits and at
   most half the slots are busy (continuous mode), so a long tail does not
   pay for empty slots; it grows back when rows arrive;
4. runs one `decode_chunk` of at most `chunk` steps, which returns early
   once enough slots are free to refill;
5. hands each row its new tokens and resolves the futures of finished rows.

Rows are submitted from any thread (`submit` returns one future per row);
`run()` drives steps on the calling thread until nothing is left, `start()`
on a background thread that also accepts rows submitted later. A row's
tokens depend only on its prompt, settings, seed and row id (see
`rljax.sampling.slots`), so the schedule never changes a result.

Failures are per row where they can be: a row that fails `check` fails only
its own future; a failing device program fails the rows that were in it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from rljax.sampling import slots as slots_lib
from rljax.sampling.types import Completion

log = logging.getLogger("rljax.sampling")


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... below hi, then hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


def bucket(n: int, buckets: Sequence[int], what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what} {n} is longer than the largest bucket {buckets[-1]}; buckets: {tuple(buckets)}")


@dataclasses.dataclass
class RowResult:
    """A Completion plus, when the sampler keeps them, the top alternatives of each step:
    top_ids / top_logprobs int32 / float32 [len(completion_ids), top_logprobs] (else None)."""

    completion: Completion
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


@dataclasses.dataclass
class _Job:
    row: object  # sampler.Row
    future: concurrent.futures.Future
    parts: list = dataclasses.field(default_factory=list)  # Emitted slices as numpy
    prompt_routing: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shapes and policy. slots: B at most; capacity: cache positions per slot (a
    multiple of block); chunk: decode steps per device call at most; refill_min: free slots
    that trigger a refill (continuous); continuous: False is static batching."""

    slots: int
    capacity: int
    prompt_buckets: tuple[int, ...]
    n_top: int = 0
    n_stop: int = 8
    chunk: int = 32
    block: int = 64
    refill_min: int = 1
    continuous: bool = True
    shrink: bool = True
    slot_buckets: tuple[int, ...] | None = None  # slot counts (default powers of two up to slots)


class Engine:
    """Continuous (or static) batching of rows over a fixed set of decode slots."""

    def __init__(self, model_config, graphdef, params, version: int, cfg: EngineConfig, *, mesh=None, rules=None,
                 check: Callable | None = None):
        if cfg.capacity % cfg.block:
            raise ValueError(f"capacity {cfg.capacity} must be a multiple of the attention block {cfg.block}")
        if max(cfg.prompt_buckets) > cfg.capacity:
            raise ValueError(f"prompt bucket {max(cfg.prompt_buckets)} exceeds the slot capacity {cfg.capacity}")
        self.model_config, self.graphdef, self.cfg = model_config, graphdef, cfg
        self.params, self.version = params, int(version)
        self.mesh, self.rules, self.check = mesh, rules, check
        self.slot_buckets = cfg.slot_buckets or powers_of_two(1, cfg.slots)
        if self.slot_buckets[-1] != cfg.slots:
            raise ValueError(f"slot_buckets {self.slot_buckets} must end at slots={cfg.slots}")
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._pending_weights = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._state = None
        self._jobs: list[_Job | None] = []
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "tokens": 0, "chunks": 0,
                       "inserts": 0, "resizes": 0}

    # ------------------------------------------------------------------ submitting

    def submit(self, rows: Sequence) -> list[concurrent.futures.Future]:
        """One future per row (a RowResult); thread-safe. A row that fails `check` fails its own future."""
        futures = []
        with self._lock:
            for row in rows:
                fut = concurrent.futures.Future()
                futures.append(fut)
                try:
                    if self.check is not None:
                        self.check(row)
                except Exception as e:  # noqa: BLE001 - the row's own error, on its own future
                    fut.set_exception(e)
                    continue
                self._waiting.append(_Job(row, fut))
            self._lock.notify_all()
        return futures

    def update_weights(self, params, version: int) -> None:
        """New weights from the next row on: admission pauses until the rows in flight finish
        (a row is never sampled with two versions), then they are swapped in."""
        with self._lock:
            self._pending_weights = (params, int(version))
            self._lock.notify_all()

    @property
    def busy(self) -> int:
        """Rows in slots now."""
        return sum(j is not None for j in self._jobs)

    @property
    def state(self) -> slots_lib.SlotState | None:
        """The device state (for inspection: shardings, shapes)."""
        return self._state

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ driving

    def run(self) -> None:
        """Steps on this thread until no row is waiting or running."""
        while self.step():
            pass

    def start(self) -> None:
        """Steps on a background thread, waiting for rows when idle, until `stop()`."""
        def loop():
            while True:
                with self._lock:
                    while not self._stop and not self._waiting and not self.busy and self._pending_weights is None:
                        self._lock.wait()
                    if self._stop:
                        return
                self.step()

        self._thread = threading.Thread(target=loop, name="rljax-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()

    def step(self) -> bool:
        """One scheduling round (see the module docstring); False when there is nothing to do."""
        try:
            with slots_lib.counting():
                return self._step()
        except Exception as e:  # noqa: BLE001 - a failed device program fails the rows in it
            log.exception("sampling failed")
            for i, job in enumerate(self._jobs):
                if job is not None and not job.future.done():
                    job.future.set_exception(e)
                self._jobs[i] = None
            self._state = None
            return bool(self._waiting)

    # ------------------------------------------------------------------ internals

    def _ensure_state(self, want: int) -> None:
        """A state of `want` slots (a slot bucket), keeping the rows in the current one."""
        cfg = self.cfg
        if self._state is None:
            state = slots_lib.empty_state_jit(self.model_config, want, cfg.capacity, cfg.n_stop, mesh=self.mesh,
                                              rules=self.rules)
            if self.mesh is None:
                # Committed like every later state (program outputs are), so the first insert's
                # signature is the same as the others' and compiles once.
                state = jax.device_put(state, next(iter(jax.tree.leaves(self.params)[0].devices())))
            self._state = state
            self._jobs = [None] * want
            return
        have = len(self._jobs)
        if want == have:
            return
        busy = [i for i, j in enumerate(self._jobs) if j is not None]
        index = np.zeros(want, np.int32)
        keep = np.zeros(want, bool)
        index[:len(busy)] = busy
        keep[:len(busy)] = True
        self._state = slots_lib.take_jit(self._state, index, keep, mesh=self.mesh, rules=self.rules)
        self._jobs = [self._jobs[i] for i in busy] + [None] * (want - len(busy))
        self.timing["resizes"] += 1

    def _step(self) -> bool:
        cfg = self.cfg
        with self._lock:
            # Cancelled rows leave their slots.
            freed = [i for i, j in enumerate(self._jobs) if j is not None and j.future.cancelled()]
            for i in freed:
                self._jobs[i] = None
            self._waiting = collections.deque(j for j in self._waiting if not j.future.cancelled())
            if self._pending_weights is not None and not self.busy:
                self.params, self.version = self._pending_weights
                self._pending_weights = None
            admit = self._pending_weights is None
            n_wait = len(self._waiting) if admit else 0
            if not n_wait and not self.busy:
                return False
        if freed:
            mask = np.zeros(len(self._jobs), bool)
            mask[freed] = True
            self._state = slots_lib.release_jit(self._state, mask)

        busy = self.busy
        if cfg.continuous:
            want = bucket(min(max(busy + n_wait, 1), cfg.slots), self.slot_buckets, "slots") if cfg.shrink \
                else cfg.slots
            if self._state is None or want > len(self._jobs) or (cfg.shrink and want <= len(self._jobs) // 2):
                self._ensure_state(want)
        elif self._state is None or not busy:
            self._ensure_state(bucket(max(min(n_wait, cfg.slots), 1), self.slot_buckets, "slots"))
        B = len(self._jobs)
        free = B - self.busy
        if n_wait and free and (self.busy == 0 or cfg.continuous and free >= min(cfg.refill_min, n_wait)):
            self._insert(min(free, n_wait))
        live = self.busy
        if not live:
            return bool(self._waiting)
        with self._lock:
            n_wait = len(self._waiting) if self._pending_weights is None else 0
        exit_at = B if not (cfg.continuous and n_wait) else (B - self.busy) + min(cfg.refill_min, n_wait)
        self._decode(max(exit_at, 1))
        return True

    def _insert(self, n: int) -> None:
        cfg = self.cfg
        with self._lock:
            jobs = [self._waiting.popleft() for _ in range(min(n, len(self._waiting)))]
        if not jobs:
            return
        free = [i for i, j in enumerate(self._jobs) if j is None][:len(jobs)]
        B = len(self._jobs)
        R = bucket(len(jobs), self.slot_buckets, "rows")
        P = bucket(max(len(j.row.prompt_ids) for j in jobs), cfg.prompt_buckets, "prompt of length")
        new = _new_rows(jobs, free, R, P, B, cfg.n_stop)
        t0 = time.perf_counter()
        self._state, out, prompt_routing = slots_lib.insert_jit(self.graphdef, self.params, self._state, new,
                                                                n_top=cfg.n_top, mesh=self.mesh, rules=self.rules)
        out = jax.device_get(out)
        prompt_routing = None if prompt_routing is None else np.asarray(prompt_routing)
        self.timing["prefill_s"] += time.perf_counter() - t0
        self.timing["inserts"] += 1
        for r, (job, slot) in enumerate(zip(jobs, free)):
            self._jobs[slot] = job
            if prompt_routing is not None:
                job.prompt_routing = prompt_routing[r, :len(job.row.prompt_ids)]
        self._collect(out, {slot: r for r, slot in enumerate(free)})

    def _decode(self, exit_at: int) -> None:
        cfg = self.cfg
        t0 = time.perf_counter()
        self._state, out, steps = slots_lib.decode_chunk_jit(
                self.graphdef, self.params, self._state, np.int32(exit_at), chunk=cfg.chunk, block=cfg.block,
                n_top=cfg.n_top, mesh=self.mesh, rules=self.rules)
        out, steps = jax.device_get((out, steps))
        self.timing["decode_s"] += time.perf_counter() - t0
        self.timing["decode_steps"] += int(steps)
        self.timing["chunks"] += 1
        self._collect(out, {slot: slot for slot in range(len(self._jobs))})

    def _collect(self, out: slots_lib.Emitted, rows_of_slot: dict[int, int]) -> None:
        """Appends each busy slot's emitted tokens; finishes rows whose slot is done."""
        done_B, stopped_B = jax.device_get((self._state.done_B, self._state.stopped_B))
        for slot, r in rows_of_slot.items():
            job = self._jobs[slot]
            if job is None:
                continue
            m = out.emitted_BxT[r]
            if m.any():
                job.parts.append(tuple(np.asarray(x[r])[m] for x in out[:5]))
            if done_B[slot]:
                self._jobs[slot] = None
                if not job.future.cancelled():
                    job.future.set_result(self._result(job, bool(stopped_B[slot])))

    def _result(self, job: _Job, stopped: bool) -> RowResult:
        cols = [np.concatenate(c) for c in zip(*job.parts)]
        tokens, logps, top_ids, top_logps, routing = cols
        self.timing["tokens"] += len(tokens)
        completion = Completion(
                prompt_ids=list(job.row.prompt_ids), completion_ids=tokens.tolist(), logprobs=logps.tolist(),
                finish_reason="stop" if stopped else "length", version=self.version,
                routing=routing if self.model_config.is_moe else None, prompt_routing=job.prompt_routing)
        top = self.cfg.n_top > 0
        return RowResult(completion, top_ids if top else None, top_logps if top else None)


def _new_rows(jobs: list[_Job], slots: list[int], R: int, P: int, B: int, n_stop: int) -> slots_lib.NewRows:
    """Host arrays for `insert`: rows padded to R (padding targets slot B, dropped)."""
    prompt = np.zeros((R, P), np.int32)
    prompt_len = np.ones((R,), np.int32)
    slot = np.full((R,), B, np.int32)
    seed = np.zeros((R,), np.uint32)
    row_id = np.zeros((R,), np.uint32)
    temperature = np.ones((R,), np.float32)
    top_k = np.zeros((R,), np.int32)
    top_p = np.ones((R,), np.float32)
    max_new = np.zeros((R,), np.int32)
    stop = np.full((R, n_stop), -1, np.int32)
    for r, (job, s) in enumerate(zip(jobs, slots)):
        row = job.row
        prompt[r, :len(row.prompt_ids)] = row.prompt_ids
        prompt_len[r], slot[r] = len(row.prompt_ids), s
        seed[r], row_id[r] = row.seed % 2**32, row.row_id % 2**32  # keys take 32-bit seeds
        temperature[r], top_k[r], top_p[r], max_new[r] = row.temperature, row.top_k, row.top_p, row.max_new_tokens
        stop[r, :len(row.stop_token_ids)] = row.stop_token_ids
    return slots_lib.NewRows(prompt, prompt_len, slot, seed, row_id, temperature, top_k, top_p, max_new, stop)


def wait_all(futures: Sequence[concurrent.futures.Future]) -> list[RowResult]:
    """Results in order; the first row's error is raised."""
    return [f.result() for f in futures]
