"""Continuous batching: the same rows as static batching (tokens exact, log-probs to float32 rounding),
whatever the schedule; a fixed set of programs; the engine's submit / cancel / error / weight-swap contract."""

import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from rljax.models.config import get_preset
from rljax.models.transformer import Decoder
from rljax.sampling import InProcessSampler, SamplingParams
from rljax.sampling import slots as slots_lib
from rljax.sampling.sampler import Row, rows_for

# Eight slots refilled from a queue of 20 rows; chunks of 3 steps force many refills and chunk boundaries.
KW = dict(prompt_buckets=(16,), completion_buckets=(32,), max_batch=8, batch_buckets=(8,), decode_chunk=3,
          refill_min=1)


def sharp_model(name="tiny", seed=0, scale=4.0):
    """Random weights scaled up, so predictions are sharp and vary from token to token."""
    model = Decoder(get_preset(name), rngs=nnx.Rngs(seed))
    nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, nnx.state(model, nnx.Param)))
    return model


def mixed_rows(n=20, seed=0, stop=(7, 11, 40)):
    """Rows with their own prompts, lengths and settings (greedy, plain, top-k, top-p, both)."""
    rng = np.random.default_rng(seed)
    settings = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                dict(temperature=1.0, top_p=0.8), dict(temperature=0.9, top_k=20, top_p=0.9)]
    rows = []
    for i in range(n):
        prompt = tuple(int(t) for t in rng.integers(0, 256, int(rng.integers(1, 15))))
        rows.append(Row(prompt, int(rng.integers(1, 33)), stop_token_ids=stop if i % 3 else (), seed=5, row_id=i,
                        **settings[i % len(settings)]))
    return rows


def assert_same_rows(a, b, atol):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = (r.completion if hasattr(r, "completion") else r for r in (x, y))
        assert x.prompt_ids == y.prompt_ids
        assert x.completion_ids == y.completion_ids
        assert x.finish_reason == y.finish_reason
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=atol)
        if x.routing is not None or y.routing is not None:
            np.testing.assert_array_equal(x.routing, y.routing)
            np.testing.assert_array_equal(x.prompt_routing, y.prompt_routing)


@pytest.fixture(scope="module")
def model():
    return sharp_model()


def test_continuous_equals_static_with_mixed_settings_and_weight_swaps(model):
    cont, static = InProcessSampler(model, **KW), InProcessSampler(model, continuous=False, **KW)
    assert cont.continuous != static.continuous
    rows = mixed_rows()
    a, b = cont.generate_rows(rows), static.generate_rows(rows)
    # The schedules really differ: continuous refilled slots one chunk at a time and ran fewer steps.
    assert cont.last_timing["inserts"] > static.last_timing["inserts"] == 3  # waves of 8, 8, 4
    assert cont.last_timing["decode_steps"] < static.last_timing["decode_steps"]
    # Same slot count and insert shape on both sides, so the float32 results are identical.
    assert_same_rows(a, b, atol=0.0)
    reasons = {r.completion.finish_reason for r in a}
    assert reasons == {"stop", "length"}
    assert len({len(r.completion.completion_ids) for r in a}) > 5  # lengths really vary
    # n > 1 through generate: groups stay prompt-major and equal too.
    params = SamplingParams(max_new_tokens=9, temperature=1.0, top_p=0.9, n=3, seed=2, stop_token_ids=(7,))
    prompts = [list(r.prompt_ids) for r in rows[:5]]
    assert_same_rows(cont.generate(prompts, params), static.generate(prompts, params), atol=0.0)

    # Weight swaps between calls: both follow the new weights, still equal, and the rows change.
    new = nnx.state(sharp_model(seed=1), nnx.Param)
    programs = slots_lib.compiled_programs()
    for s in (cont, static):
        s.update_weights(new, version=3)
    a2, b2 = cont.generate_rows(rows), static.generate_rows(rows)
    assert slots_lib.compiled_programs() == programs
    assert_same_rows(a2, b2, atol=0.0)
    assert all(r.completion.version == 3 for r in a2)
    assert [r.completion.completion_ids for r in a2] != [r.completion.completion_ids for r in a]


def test_fixed_slots_compile_three_programs(model):
    # A prompt bucket and capacity no other test uses (bucket 100 -> capacity 128), so the first call compiles.
    sampler = InProcessSampler(model, **dict(KW, prompt_buckets=(100,)))
    before = slots_lib.compiled_programs()
    sampler.generate_rows(mixed_rows(seed=5))
    assert slots_lib.compiled_programs() == before + 3  # empty state, insert of 8 rows, decode chunk of 8 slots
    # Other prompts, lengths, row counts, settings, n and seeds inside the same buckets: nothing new.
    sampler.generate_rows(mixed_rows(n=30, seed=6))
    sampler.generate([[1] * 40, [2]], SamplingParams(max_new_tokens=32, n=3, top_k=4, seed=9))
    assert slots_lib.compiled_programs() == before + 3


def test_schedule_independence_with_shrinking_slots(model):
    """Other slot counts and insert sizes (a shrinking tail) change only float32 rounding."""
    kw = dict(KW, batch_buckets=(4, 8), decode_chunk=4)
    rows = mixed_rows(n=12, seed=1)
    cont = InProcessSampler(model, **kw)
    before = slots_lib.compiled_programs()
    a = cont.generate_rows(rows)
    assert cont.last_timing["resizes"] >= 1  # the tail ran on fewer slots
    # At most: empty state, inserts of 4 / 8 rows, chunks of 8 / 4 slots, resizes 8 -> 4 and 4 -> 8.
    assert slots_lib.compiled_programs() - before <= 7
    # Against one row at a time on 4 slots: a completely different schedule.
    alone = InProcessSampler(model, **dict(kw, max_batch=4, batch_buckets=(4,)))
    b = [alone.generate_rows([r])[0] for r in rows[:6]]
    # float32 on logits of magnitude ~10: matmuls of other batch sizes round differently.
    assert_same_rows(a[:6], b, atol=2e-5)


def test_moe_routing_continuous_equals_static():
    model = sharp_model("tiny-moe", seed=3)
    rows = mixed_rows(n=12, seed=3)
    cont, static = InProcessSampler(model, **KW), InProcessSampler(model, continuous=False, **KW)
    a, b = cont.generate_rows(rows), static.generate_rows(rows)
    L, K = model.config.n_layers, model.config.experts_per_token
    for r in a:
        c = r.completion
        assert c.routing.shape == (len(c.completion_ids), L, K) and c.prompt_routing.shape == (len(c.prompt_ids), L, K)
    assert_same_rows(a, b, atol=0.0)


# ----------------------------------------------------------------------------
# The engine as a server drives it: a background loop, rows submitted at any time.


def _wait(pred, timeout=120.0):
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


def test_engine_joins_short_request_into_running_decode(model):
    sampler = InProcessSampler(model, **dict(KW, completion_buckets=(200,)))
    eng = sampler.engine(capacity=256)
    order = []
    eng.start()
    try:
        long_row = Row((1, 2, 3), 200, temperature=1.0, seed=0, row_id=0)
        short_row = Row((4, 5), 3, temperature=1.0, seed=0, row_id=1)
        (long_f,) = eng.submit([long_row])
        long_f.add_done_callback(lambda f: order.append("long"))
        _wait(lambda: eng.timing["chunks"] >= 2)  # the long row is decoding
        (short_f,) = eng.submit([short_row])
        short_f.add_done_callback(lambda f: order.append("short"))
        short = short_f.result(timeout=120)
        assert not long_f.done()  # it joined the running decode, not the queue behind it
        assert len(long_f.result(timeout=300).completion.completion_ids) == 200
        assert order == ["short", "long"]
        # Same rows as a call of their own.
        ref = sampler.generate_rows([short_row])[0]
        assert short.completion.completion_ids == ref.completion.completion_ids
    finally:
        eng.stop()


def test_engine_cancel_error_isolation_and_weight_swap(model):
    sampler = InProcessSampler(model, **KW)
    eng = sampler.engine(capacity=64)
    good = [Row((3, 4, 5), 6, seed=1, row_id=i) for i in range(3)]
    bad = Row((3, 999), 6)  # token id outside the vocabulary of 256
    futures = eng.submit([good[0], bad, good[1], good[2]])
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        futures[1].result(timeout=0)
    assert futures[2].cancel()  # a client went away before its row ran
    eng.run()
    ref = sampler.generate_rows([good[0], good[2]])
    assert_same_rows([futures[0].result(), futures[3].result()], ref, atol=0.0)
    assert eng.busy == 0 and eng.waiting == 0

    # Cancelling a row mid-decode frees its slot; its neighbour is unaffected.
    long_rows = [Row((7, 8), 30, seed=2, row_id=i) for i in range(2)]
    f0, f1 = eng.submit(long_rows)
    eng.step()  # inserted and decoding
    assert eng.busy == 2
    f1.cancel()
    eng.step()
    assert eng.busy <= 1
    eng.run()
    assert f1.cancelled()
    assert_same_rows([f0.result()], sampler.generate_rows(long_rows[:1]), atol=0.0)

    # A weight update waits for the rows in flight (one version per row), then applies.
    new = nnx.state(sharp_model(seed=4), nnx.Param)
    (old_f,) = eng.submit([Row((9,), 20, seed=3)])
    eng.step()
    sampler.update_weights(new, version=7)  # checks and copies the weights
    eng.update_weights(sampler.params, version=7)
    (new_f,) = eng.submit([Row((9,), 20, seed=3)])
    eng.run()
    assert old_f.result().completion.version == 0 and new_f.result().completion.version == 7
    assert old_f.result().completion.completion_ids != new_f.result().completion.completion_ids


def test_engine_submit_is_thread_safe(model):
    sampler = InProcessSampler(model, **KW)
    eng = sampler.engine(capacity=64)
    rows = mixed_rows(n=12, seed=4)
    eng.start()
    try:
        futures = [None] * len(rows)

        def client(i):
            futures[i] = eng.submit([rows[i]])[0]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(rows))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [f.result(timeout=300) for f in futures]
    finally:
        eng.stop()
    assert_same_rows(results, sampler.generate_rows(rows), atol=2e-5)
