"""A Python tool: ``<python>CODE</python>`` runs CODE in an OS sandbox.

Each call gets a fresh interpreter (``-I -S -B``: isolated mode, no
site-packages, no bytecode writes) running ``_sandbox_child.py`` inside a
new bubblewrap sandbox (``rljax.envs.isolation``). Guaranteed, by the
kernel, whatever the code does:

  * no network: a network namespace with only its own loopback, so the
    host's services (127.0.0.1 included) are unreachable; socket() is also
    refused by seccomp;
  * no host files: a read-only root holding only the interpreter, its
    standard library (no site-packages) and the libraries it links; no
    /home, /root, /etc (but ld.so.cache), project files or host /proc;
  * writes only to ``/tmp``, a private tmpfs of 8 MiB discarded after the
    call, each file at most 1 MiB (RLIMIT_FSIZE);
  * no new processes or threads: seccomp refuses fork/vfork/clone, and
    RLIMIT_NPROC = 0 is enforced because the sandbox's uid outside its user
    namespace is never root (65534 for a root caller); the interpreter is
    pid 1 and the only process of its pid namespace, so no host process
    can be seen or signalled; exec is allowed, but the interpreter is the
    only program there and keeps every limit;
  * nothing outlives the call: the call returns only after every process
    of the sandbox is gone (normal return, timeout or error);
  * an empty environment (no secrets from the trainer's), uid/gid 65534,
    no capabilities, no_new_privs, new session, own hostname and IPC;
  * limits: wall timeout (default 2 s; the whole sandbox is killed, the
    observation is "Tool error: timed out after 2 s" and
    ``info["tool_timeout"]`` is True), address space (default 512 MiB), CPU
    seconds (timeout rounded up, plus 1), no core files, 1 MiB of stdout,
    32 open files.

Inside, an audit hook (``sys.addaudithook``) is a second layer that turns
most attempts into a clear "PermissionError: sandbox: ..." observation:
importing socket, ssl, subprocess, ctypes, multiprocessing, pty, sqlite3,
dbm and their C modules (by any dotted part of the name or the file's
name); socket, subprocess, ctypes, gc, shutil, resource events; every
``os.*`` event except putenv/unsetenv; any ``open`` for writing; any
``open`` outside the standard library directories.

Needs: Linux >= 5.3 on x86_64 or aarch64, bubblewrap >= 0.8 (``apt-get
install -y bubblewrap``), user namespaces, and for a root caller
``nsenter`` (util-linux) and CAP_SYS_ADMIN. Without them ``PythonEnv`` (at
construction) and ``run_python`` raise ``isolation.SandboxUnavailable``
saying what is missing; the tool never runs code unsandboxed. The first
use in a process costs about a second (``isolation.probe``: listing the
interpreter's libraries and a self-test of every guarantee); each call
then costs one bwrap start on top of the interpreter's. Not covered: CPU
contention while a call runs, kernel bugs reachable through the allowed
system calls, and side channels.

Observation: the captured stdout and stderr, then the repr of the last
statement's value if it is an expression other than None, trailing
whitespace removed, truncated to ``max_output_chars`` ("(no output)" when
both are empty); or
"Tool error: ExceptionName: message". A tool process that dies without a
result (memory limit, os._exit) gives "Tool error: ..." with its exit status.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import signal
from typing import Optional

from rljax.envs import isolation
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


@dataclasses.dataclass(frozen=True)
class _Layers:
    """Which defences run; all of them outside the tests of one layer alone."""

    audit_hook: bool = True
    seccomp: bool = True
    nproc_limit: bool = True


def _describe_exit(returncode: int) -> str:
    # bwrap reports a child killed by signal N as exit status 128 + N.
    signum = -returncode if returncode < 0 else returncode - 128
    if returncode < 0 or 0 < signum < signal.NSIG:
        try:
            return f"killed by signal {signal.Signals(signum).name}"
        except ValueError:
            pass
    return f"exited with status {returncode}"


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
        how = _describe_exit(returncode)
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
    """Runs ``code`` in the sandbox described in the module docstring.

    Raises:
      isolation.SandboxUnavailable: this machine cannot sandbox the code.
      isolation.SandboxError: bwrap failed to start (before any code ran).
    """
    return _run_python(code, timeout_s=timeout_s, memory_bytes=memory_bytes,
                       max_output_chars=max_output_chars, layers=_Layers())


def _run_python(code: str, *, timeout_s: float, memory_bytes: int,
                max_output_chars: int, layers: _Layers) -> ToolOutcome:
    plan = isolation.probe()
    if len(code) > _MAX_CODE_CHARS:
        return ToolOutcome(f"code longer than {_MAX_CODE_CHARS} characters",
                           ok=False)
    cpu_seconds = math.ceil(timeout_s) + 1
    args = [str(max_output_chars), str(cpu_seconds), str(memory_bytes),
            str(_OUTPUT_BYTES), str(int(layers.audit_hook)),
            str(int(layers.nproc_limit))]
    done = isolation.run_in_sandbox(
        plan, _CHILD_SOURCE, args, stdin=code.encode("utf-8", "replace"),
        timeout_s=timeout_s, output_bytes=_OUTPUT_BYTES,
        use_seccomp=layers.seccomp)
    if done.timed_out:
        return ToolOutcome(f"timed out after {timeout_s:g} s", ok=False,
                           timeout=True)
    return _parse_child_output(done.stdout, done.returncode, max_output_chars)


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
        isolation.probe()  # Refuse now, not at the first tool call.
        self.timeout_s = float(timeout_s)
        self.memory_bytes = int(memory_bytes)
        self.max_output_chars = int(max_output_chars)

    def run_tool(self, content: str) -> ToolOutcome:
        return run_python(_strip_fence(content), timeout_s=self.timeout_s,
                          memory_bytes=self.memory_bytes,
                          max_output_chars=self.max_output_chars)
