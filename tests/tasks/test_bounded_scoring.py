"""Bounded scoring: math-verify off the main thread, killed past its bound."""

import json
import os
import threading

import pytest

from rljax import tasks
from rljax.tasks import bounded

# math-verify spends tens of seconds on this (sympy on 2,000 nested
# parentheses): measured 20 s for the parse alone on the 2-core machine.
PATHOLOGICAL = "\\boxed{" + "(" * 2000 + "}"


def _in_thread(fn):
    """fn() on a fresh (non-main) thread; returns its result or raises its error."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised below
            out["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def task(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": "42"})
                            + "\n" for i in range(20)))
    return tasks.get_task("dataset", path=str(path), score_timeout_s=0.5)


def test_math_verify_own_timeouts_fail_off_the_main_thread():
    # Why the bound is ours: math-verify's signal.alarm needs the main thread.
    import math_verify
    with pytest.raises(ValueError, match="threaded environment"):
        _in_thread(lambda: math_verify.parse("42"))


def test_math_reward_off_the_main_thread_is_bounded_and_recovers(task):
    example = task.train_example(0)
    worker = bounded.shared_worker()
    assert _in_thread(lambda: task.reward("\\boxed{42}", example)) == 1.0
    pid, starts = worker._proc.pid, worker.starts
    assert _in_thread(lambda: task.reward(PATHOLOGICAL, example)) == 0.0
    assert task.stats()["reward_timeouts"] == 1
    # The hung process was killed (and reaped), not left running.
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # The next call starts a fresh process and scores normally.
    assert _in_thread(lambda: task.reward("so it is 42", example)) == 1.0
    assert worker.starts == starts + 1
    assert task.stats() == {"data_skipped_rows": 0, "reward_timeouts": 1,
                            "reward_errors": 0}


def test_concurrent_callers_are_serialised(task):
    example = task.train_example(0)
    results = [None] * 8

    def score(i):
        results[i] = task.reward(str(40 + i % 3), example)

    threads = [threading.Thread(target=score, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1.0 if (40 + i % 3) == 42 else 0.0 for i in range(8)]


def test_scorer_errors_are_reported_and_the_process_survives():
    worker = bounded.BoundedWorker()
    try:
        with pytest.raises(bounded.ScoreError, match="TypeError"):
            worker.call("math_golds", (None,), 60.0, needs=("math_verify",))
        assert worker.starts == 1 and worker._proc.poll() is None
        assert worker.call("math_golds", (["1/2", "\\"],), 60.0) == [True, False]
        with pytest.raises(bounded.ScoreError, match="KeyError"):
            worker.call("no_such_handler", (), 60.0)
    finally:
        worker.close()
    assert worker._proc is None


def test_prints_in_the_scoring_process_cannot_corrupt_replies(tmp_path,
                                                               monkeypatch):
    # A scorer library that writes to stdout (Python and C level) or reads
    # stdin while it is imported: the replies must still arrive intact.
    (tmp_path / "noisy_scorer_lib.py").write_text(
        "import os, sys\n"
        "print('hello ' * 1000)\n"
        "sys.stdout.flush()\n"
        "os.write(1, b'\\x00\\x00\\x00\\x05junk')\n"
        "sys.stdin.read()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    worker = bounded.BoundedWorker()
    try:
        assert worker.call("preload", (("noisy_scorer_lib",),), 60.0) is True
        assert worker.call("math_golds", (["3"],), 60.0,
                           needs=("math_verify",)) == [True]
        assert worker.starts == 1
    finally:
        worker.close()
