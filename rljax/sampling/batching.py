"""The server's batcher: concurrent requests share sampler calls; one bad request fails alone.

The sampler is used through one narrow call, `sampler.generate_rows(rows)`
(each row carries its own prompt, settings and seed, so rows of different
requests can share a batch and still give the tokens they would alone).

- Requests queue in arrival order. Each sampler call takes up to `max_rows`
  rows from the front of the queue, splitting a large request over several
  calls, so a client that disconnects stops costing sampling time after the
  call in flight: its remaining rows are never sampled.
- If a shared call raises, each request in it is re-run on its own, so the
  failure lands only on the request(s) that cause it.
- `exclusive(fn)` runs `fn` (a weight swap) on the sampler thread between
  requests, never between two calls of one request, so all rows of a
  request come from one weights version.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rljax.serve")


class QueueFullError(RuntimeError):
    """More than max_queue requests are waiting (the server answers 503)."""


class SamplingFailed(RuntimeError):
    """The sampler raised on this request's rows (and only on them)."""


@dataclasses.dataclass
class _Pending:
    rows: list
    future: asyncio.Future
    next_row: int = 0  # rows before this one have been handed to the sampler
    results: list = dataclasses.field(default_factory=list)

    @property
    def started(self) -> bool:
        return self.next_row > 0


@dataclasses.dataclass
class Counters:
    """What /health reports: batches run, requests answered, rows sampled / skipped, failures."""

    batches: int = 0
    requests: int = 0
    rows_sampled: int = 0
    cancelled_requests: int = 0
    rows_skipped: int = 0
    failed_requests: int = 0
    running_rows: int = 0


class Batcher:
    """`Batcher(sampler, max_queue=..., max_rows=..., wait_s=...)`; start() inside the event loop."""

    def __init__(self, sampler, *, max_queue: int, max_rows: int, wait_s: float):
        self.sampler = sampler
        self.max_queue, self.max_rows, self.wait_s = int(max_queue), int(max_rows), float(wait_s)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._ops: collections.deque[tuple[Callable, tuple, asyncio.Future]] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sampler")
        self._task: asyncio.Task | None = None
        self.counters = Counters()

    @property
    def queued(self) -> int:
        """Requests waiting whose rows have not started sampling."""
        return sum(not p.started for p in self._pending)

    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def generate(self, rows: list) -> list:
        """The RowResults of `rows`, in order. Cancelling the caller drops the rows not yet sampled."""
        if self.queued >= self.max_queue:
            raise QueueFullError(f"server busy: {self.queued} requests are queued (max_queue={self.max_queue}); "
                                 "retry later")
        item = _Pending(list(rows), asyncio.get_running_loop().create_future())
        self._pending.append(item)
        self._wakeup.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            self.counters.cancelled_requests += 1
            self.counters.rows_skipped += len(item.rows) - item.next_row
            item.next_row = len(item.rows)
            raise

    async def exclusive(self, fn: Callable, *args) -> Any:
        """fn(*args) on the sampler thread, when no request is part-way through its rows."""
        future = asyncio.get_running_loop().create_future()
        self._ops.append((fn, args, future))
        self._wakeup.set()
        return await future

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _drop_cancelled(self) -> None:
        self._pending = collections.deque(p for p in self._pending if not p.future.done())

    async def _run_ops(self) -> None:
        while self._ops:
            fn, args, future = self._ops.popleft()
            try:
                result = await self._call(fn, *args)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                if not future.done():
                    future.set_exception(e)
            else:
                if not future.done():
                    future.set_result(result)

    def _take(self, only_started: bool) -> list[tuple[_Pending, int, int]]:
        """Up to max_rows rows from the front of the queue, as (item, start, stop) slices.

        With `only_started` (a weight swap is waiting) no new request is begun,
        so the swap runs as soon as the requests already begun are done.
        """
        batch, n = [], 0
        for item in self._pending:
            if n >= self.max_rows or (only_started and not item.started):
                break
            take = min(len(item.rows) - item.next_row, self.max_rows - n)
            if take <= 0:
                continue
            batch.append((item, item.next_row, item.next_row + take))
            item.next_row += take
            n += take
        return batch

    async def _run(self):
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self.wait_s and self._pending:
                await asyncio.sleep(self.wait_s)
            while True:
                self._drop_cancelled()
                if self._ops and not (self._pending and self._pending[0].started):
                    await self._run_ops()
                    continue
                if not self._pending:
                    break
                await self._sample(self._take(only_started=bool(self._ops)))

    async def _sample(self, batch: list[tuple[_Pending, int, int]]) -> None:
        rows = [r for item, a, b in batch for r in item.rows[a:b]]
        self.counters.running_rows = len(rows)
        try:
            results = await self._call(self.sampler.generate_rows, rows)
            outcome = [(item, results[k:k + b - a]) for (item, a, b), k in zip(batch, _offsets(batch))]
        except Exception as e:  # noqa: BLE001 - isolate: re-run each request's rows alone
            if len(batch) == 1:
                outcome = [(batch[0][0], e)]
            else:
                log.warning("a batch of %d requests failed (%s: %s); re-running each alone", len(batch),
                            type(e).__name__, e)
                outcome = []
                for item, a, b in batch:
                    try:
                        outcome.append((item, await self._call(self.sampler.generate_rows, item.rows[a:b])))
                    except Exception as e2:  # noqa: BLE001 - this request's own failure
                        outcome.append((item, e2))
        finally:
            self.counters.running_rows = 0
        self.counters.batches += 1
        for item, got in outcome:
            if isinstance(got, Exception):
                self._fail(item, got)
                continue
            self.counters.rows_sampled += len(got)
            item.results.extend(got)
            if len(item.results) == len(item.rows) and not item.future.done():
                self.counters.requests += 1
                item.future.set_result(item.results)

    def _fail(self, item: _Pending, error: Exception) -> None:
        log.error("sampling failed for a request of %d rows: %s: %s", len(item.rows), type(error).__name__, error)
        self.counters.failed_requests += 1
        item.next_row = len(item.rows)  # its other rows are not worth sampling
        with contextlib.suppress(ValueError):
            self._pending.remove(item)
        if not item.future.done():
            wrapped = error if isinstance(error, ValueError) else SamplingFailed(f"{type(error).__name__}: {error}")
            item.future.set_exception(wrapped)


def _offsets(batch) -> list[int]:
    out, k = [], 0
    for _, a, b in batch:
        out.append(k)
        k += b - a
    return out
