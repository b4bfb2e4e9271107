"""Runs one snippet of model-written Python; executed as ``python -I -S -c``.

Not imported by rljax: ``rljax.envs.python_tool`` passes this file's text to
a fresh interpreter inside the sandbox of ``rljax.envs.isolation``.
Protocol: argv = [ready_fd, max_output_chars, cpu_seconds, memory_bytes,
output_bytes, audit_hook, nproc_limit] (the last two "1" or "0"; "0" only in
the tests that check the other layers alone); the code arrives on stdin; the
last line written to stdout is a JSON object {"ok": true, "output": str} or
{"ok": false, "error": "ExceptionName: message"}.

Order matters: limits first, then everything this script needs is imported,
then one byte on ready_fd tells the parent the sandbox started, then the
audit hook goes in, and only then does the snippet run.
"""

import ast
import builtins
import io
import json
import os
import resource
import sys

# Modules whose import is refused: network, processes, raw C calls, and
# C-level file access that raises no "open" event.
_BLOCKED_MODULES = frozenset((
    "_ctypes", "ctypes", "_socket", "socket", "_ssl", "ssl",
    "_posixsubprocess", "subprocess", "multiprocessing", "_multiprocessing",
    "_posixshmem", "pty", "_dbm", "dbm", "_gdbm", "_sqlite3", "sqlite3",
    "readline", "_tkinter"))
# Audit events refused outright, by prefix (an exact name also matches).
_BLOCKED_PREFIXES = (
    "socket.", "subprocess.", "ctypes.", "gc.", "shutil.", "sqlite3.",
    "resource.", "pty.", "syslog.", "webbrowser.", "signal.pthread_kill",
    "setopencodehook", "http.client.", "ftplib.", "smtplib.", "poplib.",
    "imaplib.", "nntplib.", "telnetlib.", "urllib.", "sys.remote_exec",
    "sys._current_frames", "os.")
# "os.*" events that stay allowed: environment edits of this process only.
_ALLOWED_OS_EVENTS = frozenset(("os.putenv", "os.unsetenv"))


def _set_limits(cpu_seconds, memory_bytes, output_bytes, nproc_limit):
    """Hard limits: the snippet cannot raise them (soft = hard, no caps)."""
    limits = [(resource.RLIMIT_CPU, cpu_seconds),
              (resource.RLIMIT_AS, memory_bytes),
              (resource.RLIMIT_CORE, 0),
              (resource.RLIMIT_FSIZE, output_bytes),
              (resource.RLIMIT_NOFILE, 32)]
    if nproc_limit:
        # No new task at all, threads included. Enforced: the sandbox's uid
        # outside its user namespace is never root (see isolation.py).
        limits.append((resource.RLIMIT_NPROC, 0))
    for limit, value in limits:
        resource.setrlimit(limit, (value, value))


def _read_roots():
    """The interpreter's own stdlib locations: the only readable paths."""
    roots = set()
    for entry in sys.path:
        if entry:
            roots.add(os.path.abspath(entry))
            roots.add(os.path.realpath(entry))
    return tuple(sorted(roots))


def _make_hook(read_roots):
    """The audit hook; refuses by raising PermissionError.

    Everything the hook uses is bound here as a closure variable. The snippet
    cannot reach these cells (no gc, no reference to the hook), so
    monkeypatching builtins, ``os.path`` or ``str`` subclasses cannot change
    what the hook decides.
    """
    _type, _str, _bytes, _int = type, str, bytes, int
    _split, _join, _startswith = str.split, str.join, str.startswith
    _decode = bytes.decode
    _denied = PermissionError
    write_flags = (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT
                   | os.O_TRUNC)
    blocked_modules, blocked_prefixes = _BLOCKED_MODULES, _BLOCKED_PREFIXES
    allowed_os = _ALLOWED_OS_EVENTS

    def readable(path):
        # Only exact str/bytes: a PathLike or str subclass could answer the
        # check with one path and the open() with another.
        if _type(path) is _bytes:
            path = _decode(path, "utf-8", "surrogateescape")
        if _type(path) is not _str or not _startswith(path, "/"):
            return False
        parts = []
        for part in _split(path, "/"):
            if part == "" or part == ".":
                continue
            if part == "..":
                if parts:
                    parts.pop()
                continue
            if part == "site-packages" or part == "dist-packages":
                return False
            parts.append(part)
        norm = "/" + _join("/", parts)
        for root in read_roots:
            if norm == root or _startswith(norm, root + "/"):
                return True
        return False

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if mode is not None and (_type(mode) is not _str or "w" in mode or
                                     "a" in mode or "x" in mode or "+" in mode):
                raise _denied(f"sandbox: no file writes ({event})")
            if _type(flags) is not _int or flags & write_flags:
                raise _denied(f"sandbox: no file writes ({event})")
            if not readable(path):
                raise _denied("sandbox: no file access outside the standard "
                              "library")
            return
        if event == "os.listdir" or event == "os.scandir":
            if not readable(args[0]):
                raise _denied("sandbox: no file access outside the standard "
                              "library")
            return
        if event == "import":
            # Every dotted part, and the file's own name: loading a blocked
            # C module from its file under another dotted name
            # (importlib.util.spec_from_file_location) must fail too.
            names = _split(args[0], ".") if _type(args[0]) is _str else [""]
            if _type(args[1]) is _str:
                names.append(_split(_split(args[1], "/")[-1], ".")[0])
            for name in names:
                if name in blocked_modules:
                    raise _denied(f"sandbox: module {args[0]!r} is not "
                                  f"available")
            return
        if event in allowed_os:
            return
        for prefix in blocked_prefixes:
            if _startswith(event, prefix):
                raise _denied(f"sandbox: {event} is not allowed")

    return hook


def _run(code, namespace):
    """Executes ``code``; returns the repr of a final expression, or None."""
    tree = ast.parse(code, "<python>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<python>", "exec"), namespace)
    if last is None:
        return None
    value = eval(compile(last, "<python>", "eval"), namespace)
    return None if value is None else repr(value)


def _describe(error):
    try:
        message = str(error)
    except BaseException:  # A hostile __str__ must not lose the result.
        message = "<unprintable>"
    name = type(error).__name__
    return f"{name}: {message}" if message else name


def main():
    (ready_fd, max_chars, cpu_seconds, memory_bytes, output_bytes, audit_hook,
     nproc_limit) = map(int, sys.argv[1:8])
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    _set_limits(cpu_seconds, memory_bytes, output_bytes, nproc_limit)
    sys.dont_write_bytecode = True
    real_stdout = sys.stdout
    captured = io.StringIO()
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    if audit_hook:
        sys.addaudithook(_make_hook(_read_roots()))
    sys.stdout = sys.stderr = captured
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    # One character past the limit survives, so the parent can mark the cut.
    keep = max_chars + 1
    try:
        value = _run(code, namespace)
        output = captured.getvalue()[:keep]
        if value is not None:
            output = (output + "\n" if output and not output.endswith("\n")
                      else output) + value[:keep]
        result = {"ok": True, "output": output[:keep]}
    except BaseException as error:  # SystemExit and KeyboardInterrupt too.
        result = {"ok": False, "error": _describe(error)[:keep]}
    real_stdout.write("\n" + json.dumps(result) + "\n")
    real_stdout.flush()


main()
