"""The server's Batcher, in process around a real InProcessSampler: a failing request fails alone, a cancelled
request's remaining rows are never sampled, and a weight swap never lands inside one request's rows."""

import asyncio
import threading

import pytest

from rljax.sampling import InProcessSampler
from rljax.sampling.batching import Batcher, SamplingFailed
from rljax.sampling.sampler import Row

POISON = 666


class Recording:
    """The real sampler, recording each call's seeds; it raises on rows seeded POISON, and runs `hook` (on the
    sampler thread) before the first call. After validation no real input makes the sampler fail, so the
    failure is injected; the rows that succeed are really sampled."""

    def __init__(self, sampler, hook=None):
        self.sampler, self.hook, self.calls = sampler, hook, []

    def generate_rows(self, rows):
        self.calls.append([r.seed for r in rows])
        if self.hook is not None and len(self.calls) == 1:
            self.hook()
        if any(r.seed == POISON for r in rows):
            raise RuntimeError("injected failure")
        return self.sampler.generate_rows(rows)


@pytest.fixture(scope="module")
def sampler(tiny):
    model, _, _ = tiny
    # One compiled shape for every call (4 rows, prompt and completion buckets of 16), the local one of the
    # server tests.
    return InProcessSampler(model, max_batch=4, batch_buckets=(4,), top_logprobs=5)


def rows(seed, n=1):
    return [Row((3, 4, 5), 4, 1.0, 1.0, 0, (), seed, i) for i in range(n)]


def ids(results):
    return [r.completion.completion_ids for r in results]


def run(coro):
    return asyncio.run(coro)


def test_a_failing_request_does_not_fail_the_requests_batched_with_it(sampler):
    recording = Recording(sampler)

    async def main():
        batcher = Batcher(recording, max_queue=8, max_rows=4, wait_s=0.05)
        batcher.start()
        try:
            return await asyncio.gather(batcher.generate(rows(1)), batcher.generate(rows(POISON)),
                                        batcher.generate(rows(2, 2)), return_exceptions=True), batcher.counters
        finally:
            await batcher.stop()

    (good1, bad, good2), counters = run(main())
    assert recording.calls[0] == [1, POISON, 2, 2]  # all three shared one sampler call...
    assert sorted(recording.calls[1:]) == sorted([[1], [POISON], [2, 2]])  # ...then each ran alone
    assert isinstance(bad, SamplingFailed) and "RuntimeError: injected failure" in str(bad)
    assert ids(good1) == ids(sampler.generate_rows(rows(1)))
    assert ids(good2) == ids(sampler.generate_rows(rows(2, 2)))
    assert counters.failed_requests == 1 and counters.requests == 2


def test_a_cancelled_request_stops_at_the_sampler_call_in_flight(sampler):
    task_box, loop_box = [], []

    def cancel():  # on the sampler thread, during the first of three calls of 4 rows
        loop_box[0].call_soon_threadsafe(task_box[0].cancel)

    recording = Recording(sampler, hook=cancel)

    async def main():
        loop_box.append(asyncio.get_running_loop())
        batcher = Batcher(recording, max_queue=8, max_rows=4, wait_s=0)
        batcher.start()
        try:
            task_box.append(asyncio.ensure_future(batcher.generate(rows(7, 12))))
            with pytest.raises(asyncio.CancelledError):
                await task_box[0]
            after = await batcher.generate(rows(8))  # the batcher carries on
            return batcher.counters, after
        finally:
            await batcher.stop()

    counters, after = run(main())
    assert recording.calls == [[7] * 4, [8]]  # rows 4..11 of the cancelled request never reached the sampler
    assert counters.cancelled_requests == 1 and counters.rows_skipped == 8 and counters.rows_sampled == 5
    assert ids(after) == ids(sampler.generate_rows(rows(8)))


def test_a_weight_swap_waits_for_the_request_in_progress(sampler):
    order, box = [], {}
    swapped = threading.Event()

    def ask_for_swap():  # during the first call of request A: a swap arrives, then request B
        box["swap"] = asyncio.run_coroutine_threadsafe(box["batcher"].exclusive(lambda: order.append("swap")),
                                                       box["loop"])
        box["b"] = asyncio.run_coroutine_threadsafe(box["batcher"].generate(rows(9)), box["loop"])
        swapped.set()

    class Ordered(Recording):
        def generate_rows(self, rs):
            order.append(rs[0].seed)
            return super().generate_rows(rs)

    recording = Ordered(sampler, hook=ask_for_swap)

    async def main():
        box["loop"] = asyncio.get_running_loop()
        batcher = box["batcher"] = Batcher(recording, max_queue=8, max_rows=4, wait_s=0)
        batcher.start()
        try:
            await batcher.generate(rows(5, 12))
            await asyncio.wrap_future(box["swap"])
            await asyncio.wrap_future(box["b"])
        finally:
            await batcher.stop()

    run(main())
    assert swapped.is_set()
    # A's three calls, then the swap, then B: A's 12 rows all came from the old weights.
    assert order == [5, 5, 5, "swap", 9]
