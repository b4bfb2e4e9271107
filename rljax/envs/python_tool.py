"""A Python tool: ``<python>CODE</python>`` runs CODE in a sandboxed process.

Each call gets a fresh interpreter (``sys.executable -I -S -B``: isolated
mode, no site-packages, no bytecode writes) running ``_sandbox_child.py``:

  * wall timeout (default 2 s): the whole process group is killed with
    SIGKILL, the observation is "Tool error: timed out after 2 s" and
    ``info["tool_timeout"]`` is True;
  * hard resource limits: address space (default 512 MiB), CPU seconds
    (timeout rounded up, plus 1), no core files, at most 1 MiB written to
    stdout, 32 open files, no new processes (RLIMIT_NPROC; not enforced for
    root, hence the audit hook);
  * cwd an empty temporary directory (removed afterwards), an empty
    environment, stdin closed after the code is read;
  * an audit hook (``sys.addaudithook``) installed before the code runs,
    refusing with PermissionError: importing socket, ssl, subprocess,
    ctypes, multiprocessing, pty, sqlite3, dbm and their C modules; socket,
    subprocess, ctypes, gc, shutil, resource (setrlimit) events; every
    ``os.*`` event except putenv/unsetenv, so os.system, exec, spawn,
    posix_spawn, fork, kill, remove, rename, mkdir, chmod, listdir outside
    the standard library, ...; any ``open`` for writing (by mode or flags);
    any ``open`` of a path outside the interpreter's own standard library
    directories (``sys.path`` of ``-I -S``, site-packages excluded), or of a
    file descriptor or path object rather than a plain string.

The audit hook is defense in depth, not a security boundary against a
determined adversary (CPython's documentation says as much); the process
limits and the empty directory are the other layers. Run untrusted models
inside a container as well.

Observation: the captured stdout and stderr, then the repr of the last
statement's value if it is an expression other than None, trailing
whitespace removed, truncated to ``max_output_chars`` ("(no output)" when
both are empty); or
"Tool error: ExceptionName: message". A tool process that dies without a
result (memory limit, os._exit) gives "Tool error: ..." with its exit status.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
from typing import Optional

from rljax.envs.tools import ToolEnvironment, ToolOutcome
from rljax.tasks.base import Task

_CHILD_SOURCE = (pathlib.Path(__file__).with_name("_sandbox_child.py")
                 .read_text())
# The child's stdout is a file capped by RLIMIT_FSIZE, so a snippet that
# prints in a loop cannot fill the trainer's memory.
_OUTPUT_BYTES = 1 << 20
_MAX_CODE_CHARS = 20_000
_CODE_FENCE = "```"

SYSTEM_PROMPT = (
    "You can run Python. Write <python>CODE</python> and stop; the next "
    "message gives 'Tool result: ' followed by what the code printed and "
    "the value of its last expression, or 'Tool error: ' and the exception. "
    "The code runs without files, network or other processes, for at most "
    "a few seconds. When you know the answer, reply without any <python> "
    "tag: that reply is your final answer.")


def _strip_fence(code: str) -> str:
    """Drops a Markdown code fence (```python ... ```) around the code."""
    text = code.strip()
    if text.startswith(_CODE_FENCE):
        first_newline = text.find("\n")
        text = "" if first_newline < 0 else text[first_newline + 1:]
        if text.rstrip().endswith(_CODE_FENCE):
            text = text.rstrip()[:-len(_CODE_FENCE)]
    return text


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + "... [truncated]"


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the child's whole process group (its own session)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # Already gone.
    process.wait()


def _parse_child_output(raw: bytes, returncode: int,
                        max_chars: int) -> ToolOutcome:
    """The outcome from the child's last stdout line (see the child's doc)."""
    lines = raw.decode("utf-8", "replace").strip().splitlines()
    result = None
    if lines:
        try:
            result = json.loads(lines[-1])
        except ValueError:
            result = None
    if not isinstance(result, dict) or not isinstance(
            result.get("output", result.get("error")), str):
        if returncode < 0:
            how = f"killed by signal {signal.Signals(-returncode).name}"
        else:
            how = f"exited with status {returncode}"
        return ToolOutcome(f"the Python process {how} without a result "
                           f"(memory or output limit?)", ok=False)
    if result.get("ok") is True and "output" in result:
        # The trailing newline of print() carries nothing for the model.
        output = _truncate(result["output"].rstrip(), max_chars)
        return ToolOutcome(output or "(no output)", ok=True)
    return ToolOutcome(_truncate(str(result.get("error")), max_chars),
                       ok=False)


def run_python(code: str, *, timeout_s: float = 2.0,
               memory_bytes: int = 512 << 20,
               max_output_chars: int = 1000) -> ToolOutcome:
    """Runs ``code`` in the sandbox described in the module docstring."""
    if len(code) > _MAX_CODE_CHARS:
        return ToolOutcome(f"code longer than {_MAX_CODE_CHARS} characters",
                           ok=False)
    cpu_seconds = math.ceil(timeout_s) + 1
    argv = [sys.executable, "-I", "-S", "-B", "-c", _CHILD_SOURCE,
            str(max_output_chars), str(cpu_seconds), str(memory_bytes),
            str(_OUTPUT_BYTES)]
    with tempfile.TemporaryDirectory(prefix="rljax-python-") as workdir, \
            tempfile.TemporaryFile() as stdout:
        process = subprocess.Popen(
            argv, cwd=workdir, env={}, stdin=subprocess.PIPE, stdout=stdout,
            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        try:
            process.communicate(code.encode("utf-8", "replace"),
                                timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            return ToolOutcome(f"timed out after {timeout_s:g} s", ok=False,
                               timeout=True)
        except BaseException:
            _kill_group(process)  # Never leave a child behind.
            raise
        stdout.seek(0)
        raw = stdout.read(_OUTPUT_BYTES + 1)
    return _parse_child_output(raw, process.returncode, max_output_chars)


class PythonEnv(ToolEnvironment):
    """Solve a task with a sandboxed Python tool.

    Rules: see ``rljax.envs.tools`` (turns, final answer, rewards) and this
    module's docstring (the sandbox and the observation). A Markdown code
    fence inside the tags is dropped.

    Attributes (besides ``ToolEnvironment``'s):
      timeout_s: wall-clock limit per call.
      memory_bytes: address-space limit of the tool process.
      max_output_chars: observation text is cut to this length.
    """

    name = "python"
    tag = "python"
    default_system_prompt = SYSTEM_PROMPT

    def __init__(self, task: Task, *, max_turns: int = 4,
                 over_budget_reward: float = 0.0, tool_bonus: float = 0.0,
                 system_prompt: Optional[str] = None, timeout_s: float = 2.0,
                 memory_bytes: int = 512 << 20, max_output_chars: int = 1000):
        super().__init__(task, max_turns=max_turns,
                         over_budget_reward=over_budget_reward,
                         tool_bonus=tool_bonus, system_prompt=system_prompt)
        if not timeout_s > 0:
            raise ValueError(f"python: timeout_s must be > 0, got {timeout_s}")
        if memory_bytes < 64 << 20:
            raise ValueError(f"python: memory_bytes must be >= 64 MiB, got "
                             f"{memory_bytes}")
        if max_output_chars < 1:
            raise ValueError(f"python: max_output_chars must be >= 1, got "
                             f"{max_output_chars}")
        self.timeout_s = float(timeout_s)
        self.memory_bytes = int(memory_bytes)
        self.max_output_chars = int(max_output_chars)

    def run_tool(self, content: str) -> ToolOutcome:
        return run_python(_strip_fence(content), timeout_s=self.timeout_s,
                          memory_bytes=self.memory_bytes,
                          max_output_chars=self.max_output_chars)
