"""Scoring calls with a wall-clock bound that holds on any thread.

Third-party scorers (math-verify's sympy parsing, reasoning-gym's
``score_answer``) can take superlinear time on adversarial text: math-verify
spends 20 s on 2,000 "(" characters. math-verify's own timeouts use
``signal.alarm``, which only works on the main thread, but the trainer scores
from a sampler thread when rollouts run ahead; and a Python thread cannot be
interrupted. So the calls run in a child process (``_scoring_worker.py``) that
is killed when a call exceeds its bound, and started again on the next call.
The child also has an address-space limit, so a parse cannot take the
machine's memory.

    worker = bounded.shared_worker()
    ok = worker.call("math_verify", ("42", "\\boxed{42}", False), timeout_s=2.0)

``call`` raises ``ScoreTimeout`` after ``timeout_s`` (the child is gone by
then) and ``ScoreError`` when the scorer raised; callers score 0 and count.
"""

from __future__ import annotations

import atexit
import os
import pathlib
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Optional, Sequence

_SCRIPT = pathlib.Path(__file__).with_name("_scoring_worker.py")
_HEADER = struct.Struct(">I")
# Importing sympy / reasoning-gym on a loaded 2-core machine takes seconds;
# start-up is bounded separately from (and much more loosely than) a call.
STARTUP_TIMEOUT_S = 180.0
MEMORY_LIMIT_BYTES = 2 << 30


class ScoreTimeout(Exception):
    """A scoring call ran past its bound; its process was killed."""


class ScoreError(Exception):
    """The scorer raised (the message is the child's ``Type: message``)."""


class BoundedWorker:
    """One child process running scoring calls in order, each under a bound.

    Thread-safe: calls from several threads are serialised by a lock. The
    child starts on the first call and after every kill.
    """

    def __init__(self, memory_limit_bytes: int = MEMORY_LIMIT_BYTES):
        self._memory = int(memory_limit_bytes)
        self._proc: Optional[subprocess.Popen] = None
        self._loaded: set[str] = set()
        self._lock = threading.Lock()
        self.starts = 0  # child processes started so far

    def call(self, handler: str, args: tuple, timeout_s: float,
             needs: Sequence[str] = ()) -> Any:
        """Runs ``handler(*args)`` in the child; see the module docstring.

        ``needs``: modules the handler imports; they are imported first under
        the start-up bound, so a slow import never counts as a slow call.
        """
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            missing = tuple(m for m in needs if m not in self._loaded)
            if missing:
                self._request("preload", (missing,), STARTUP_TIMEOUT_S)
                self._loaded.update(missing)
            return self._request(handler, args, timeout_s)

    def close(self) -> None:
        """Stops the child (it also exits by itself when this process does)."""
        with self._lock:
            self._kill()

    # --- internals (called with the lock held) -------------------------------

    def _start(self) -> None:
        env = dict(os.environ)
        # The child imports whatever this process can: same interpreter,
        # same search path (a test's or a user's additions included).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._proc = subprocess.Popen(
            [sys.executable, str(_SCRIPT), str(self._memory)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env)
        self._loaded = set()
        self.starts += 1

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                pipe.close()

    def _request(self, handler: str, args: tuple, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        data = pickle.dumps((handler, args))
        try:
            self._proc.stdin.write(_HEADER.pack(len(data)) + data)
            (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
            status, value = pickle.loads(self._read(size, deadline))
        except ScoreTimeout:
            self._kill()
            raise ScoreTimeout(
                f"{handler} took more than {timeout_s:g} s; its process was "
                f"killed") from None
        except (BrokenPipeError, EOFError) as err:
            code = self._proc.poll() if self._proc else None
            self._kill()
            raise ScoreError(f"{handler}: the scoring process died (exit code "
                             f"{code})") from err
        if status != "ok":
            raise ScoreError(f"{handler}: {value}")
        return value

    def _read(self, n: int, deadline: float) -> bytes:
        fd = self._proc.stdout.fileno()
        out = bytearray()
        while len(out) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ScoreTimeout
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise ScoreTimeout
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
        return bytes(out)


_shared: Optional[BoundedWorker] = None
_shared_lock = threading.Lock()


def shared_worker() -> BoundedWorker:
    """The process-wide worker every task's scorer uses (started lazily)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = BoundedWorker()
            atexit.register(_shared.close)
        return _shared
