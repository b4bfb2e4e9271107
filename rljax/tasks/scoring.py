"""Answer scorers chosen by name: ``math``, ``exact``, ``regex``, ``module:function``.

Each compares an extracted answer (``rljax.tasks.extract``) with a gold
answer and returns 1.0 or 0.0:

  math:   HF math-verify's ``parse`` + ``verify`` (``\\boxed{}``, fractions,
          LaTeX, sets, ``1,000`` == ``1000``), run in a bounded child process
          (``rljax.tasks.bounded``) so a pathological parse costs at most
          ``timeout_s`` and works from any thread.
  exact:  the answer, stripped, equals the gold, stripped.
  regex:  the answer, stripped, fully matches the gold taken as an RE2
          pattern. RE2 (google-re2) matches in time linear in the text for any
          pattern, where Python's backtracking ``re`` can take exponential time
          on a model's output.
  module:function: a user's ``fn(answer, example) -> float``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, Optional

from rljax.tasks import bounded

BUILTIN = ("math", "exact", "regex")
DEFAULT_MATH_TIMEOUT_S = 2.0
_GOLD_CHUNK = 256

log = logging.getLogger("rljax.tasks")


def check_scorer(field: str, scorer: str) -> Optional[Callable]:
    """Validates ``scorer``; returns the user's function for ``module:function``."""
    if scorer in BUILTIN:
        if scorer == "regex":
            _re2()
        if scorer == "math":
            _require("math_verify", "math-verify")
        return None
    if isinstance(scorer, str) and ":" in scorer:
        from rljax.tasks.base import load_reward_fn
        return load_reward_fn(scorer)
    raise ValueError(f"{field}={scorer!r} is not a scorer; valid: "
                     f"{', '.join(BUILTIN)} or 'package.module:function'")


def _require(module: str, package: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ValueError(
            f"this scorer needs the {package!r} package: pip install "
            f"'rljax[data]' (or pip install {package})") from err


def _re2():
    return _require("re2", "google-re2")


_patterns: dict = {}
_patterns_lock = threading.Lock()


def compile_regex(pattern: str):
    """The compiled RE2 pattern; ValueError with RE2's reason if it is invalid."""
    with _patterns_lock:
        if pattern in _patterns:
            return _patterns[pattern]
    re2 = _re2()
    options = re2.Options()
    options.log_errors = False  # Reported in our error instead of on stderr.
    try:
        compiled = re2.compile(pattern, options)
    except re2.error as err:
        reason = err.args[0] if err.args else err
        if isinstance(reason, bytes):
            reason = reason.decode(errors="replace")
        raise ValueError(f"not a valid RE2 pattern ({reason})") from None
    with _patterns_lock:
        if len(_patterns) > 4096:
            _patterns.clear()
        _patterns[pattern] = compiled
    return compiled


def exact_score(answer: str, gold: str) -> float:
    return 1.0 if answer.strip() == gold.strip() else 0.0


def regex_score(answer: str, pattern: str) -> float:
    return 1.0 if compile_regex(pattern).fullmatch(answer.strip()) else 0.0


@dataclasses.dataclass
class ScoreStats:
    """Counts of scoring calls that did not finish; each scored 0.0.

    ``timeouts``: calls killed at their bound; ``errors``: the scorer raised.
    """

    timeouts: int = 0
    errors: int = 0

    def __post_init__(self):
        self._lock = threading.Lock()

    def count(self, kind: str, task: str, message: str) -> None:
        with self._lock:
            setattr(self, kind, getattr(self, kind) + 1)
            first = getattr(self, kind) == 1
        # The first of each kind is logged; the counts go into the metrics.
        if first:
            log.warning("%s: scoring %s (scored 0.0; further ones are only "
                        "counted): %s", task, kind[:-1], message)


def bounded_call(handler: str, args: tuple, *, timeout_s: float,
                 needs: tuple, stats: ScoreStats, task: str):
    """``bounded.shared_worker().call``; None (counted in ``stats``) on failure."""
    try:
        return bounded.shared_worker().call(handler, args, timeout_s,
                                            needs=needs)
    except bounded.ScoreTimeout as err:
        stats.count("timeouts", task, str(err))
    except bounded.ScoreError as err:
        stats.count("errors", task, str(err))
    return None


def math_score(answer: str, gold: str, *, whole_completion: bool,
               timeout_s: float, stats: ScoreStats, task: str) -> float:
    """math-verify's verdict, bounded; 0.0 if it timed out or failed.

    ``whole_completion``: the text is a whole completion, parsed by
    math-verify's own extraction (last ``\\boxed{}``, "final answer is", last
    expression); otherwise it is an extracted answer, read as LaTeX math first.
    """
    verdict = bounded_call("math_verify", (gold, answer, not whole_completion),
                           timeout_s=timeout_s, needs=("math_verify",),
                           stats=stats, task=task)
    return 1.0 if verdict else 0.0


def math_gold_problems(golds: list[str], timeout_s: float) -> list[Optional[str]]:
    """For each gold answer: None if math-verify parses it, else the problem.

    Golds go to the child in chunks (one round trip each); a chunk that runs
    past ``timeout_s`` per answer is retried one answer at a time, so the
    answer that hangs is the one reported.
    """
    worker = bounded.shared_worker()
    out: list[Optional[str]] = []
    for lo in range(0, len(golds), _GOLD_CHUNK):
        chunk = list(golds[lo:lo + _GOLD_CHUNK])
        try:
            parsed = worker.call("math_golds", (chunk,), timeout_s * len(chunk),
                                 needs=("math_verify",))
        except (bounded.ScoreTimeout, bounded.ScoreError):
            parsed = []
            for gold in chunk:
                try:
                    parsed += worker.call("math_golds", ([gold],), timeout_s,
                                          needs=("math_verify",))
                except bounded.ScoreTimeout:
                    parsed.append(f"math-verify did not parse it within "
                                  f"{timeout_s:g} s")
                except bounded.ScoreError as err:
                    parsed.append(f"math-verify failed on it ({err})")
        out += [None if p is True else (p or "math-verify cannot parse it")
                for p in parsed]
    return out
