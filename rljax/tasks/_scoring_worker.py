"""The child process of ``rljax.tasks.bounded``: scoring calls, one at a time.

Run as a script (``python _scoring_worker.py MEMORY_BYTES``), never imported
by the trainer: it imports nothing from rljax (so starting it does not import
JAX) and only the scoring libraries a call needs. Frames on stdin/stdout are a
4-byte big-endian length and a pickle: ``(handler, args)`` in,
``("ok", result)`` or ``("error", "Type: message")`` out. The parent enforces
the wall-clock bound by killing this process, which works from any thread,
unlike math-verify's own ``signal.alarm`` timeouts (main thread only), which
are switched off here.
"""

import os
import pickle
import struct
import sys

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(
        os.path.abspath(__file__)):
    # The script's own folder must not shadow the libraries it imports.
    sys.path.pop(0)

_HEADER = struct.Struct(">I")
_CACHE_SIZE = 4096
_gold_cache: dict = {}
_datasets: dict = {}


def _math_parse(text, wrap):
    """math-verify's parse, without its signal-based timeout.

    ``wrap``: the text is an answer on its own (a data set's gold, or an
    extracted answer), so it is read as LaTeX math first ("$x^2+1$"; bare,
    "x^2+1" would parse as just "1"), then as it is.
    """
    from math_verify import parse
    attempts = [text]
    if wrap and "$" not in text:
        attempts.insert(0, f"${text}$")
    for attempt in attempts:
        parsed = parse(attempt, parsing_timeout=None)
        if parsed:
            return parsed
    return []


def _gold(text):
    if text not in _gold_cache:
        if len(_gold_cache) >= _CACHE_SIZE:
            _gold_cache.clear()
        _gold_cache[text] = _math_parse(text, wrap=True)
    return _gold_cache[text]


def math_golds(golds):
    """For each gold answer: does math-verify parse it?"""
    return [bool(_gold(g)) for g in golds]


def math_verify(gold, answer, wrap):
    """math-verify's verdict on ``answer`` against ``gold`` (False if unparsed)."""
    from math_verify import verify
    gold_parsed = _gold(gold)
    answer_parsed = _math_parse(answer, wrap)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _dataset(spec):
    if spec not in _datasets:
        import reasoning_gym
        name, kwargs, seed, size = pickle.loads(spec)
        _datasets[spec] = reasoning_gym.create_dataset(
            name, seed=seed, size=size, **kwargs)
    return _datasets[spec]


def rg_score(spec, answer, entry):
    """reasoning-gym's ``score_answer`` of ``answer`` for ``entry``."""
    return float(_dataset(spec).score_answer(answer, entry))


def preload(modules):
    import importlib
    for module in modules:
        importlib.import_module(module)
    return True


_HANDLERS = {"math_golds": math_golds, "math_verify": math_verify,
             "rg_score": rg_score, "preload": preload}


def _read(stream, n):
    data = stream.read(n)
    if len(data) < n:
        raise EOFError
    return data


def main():
    import logging
    import resource
    # Bounds a pathological parse's memory too (sympy can grow to GBs).
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # "Timeout is disabled ...": we disabled it on purpose (the parent kills).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # The frames get private copies of fds 0 and 1; the scorers' own prints
    # (Python or C) go to stderr and their reads see an empty stdin, so
    # neither can corrupt the protocol.
    stdin = os.fdopen(os.dup(0), "rb")
    stdout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    while True:
        try:
            (size,) = _HEADER.unpack(_read(stdin, _HEADER.size))
            handler, args = pickle.loads(_read(stdin, size))
        except (EOFError, KeyboardInterrupt):
            return  # The parent closed the pipe or is stopping.
        try:
            reply = ("ok", _HANDLERS[handler](*args))
        except KeyboardInterrupt:
            return
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            reply = ("error", f"{type(err).__name__}: {err}"[:2000])
        data = pickle.dumps(reply)
        stdout.write(_HEADER.pack(len(data)) + data)
        stdout.flush()


if __name__ == "__main__":
    main()
