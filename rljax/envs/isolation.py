"""OS isolation for running untrusted Python: bubblewrap + seccomp + rlimits.

``run_in_sandbox(source, args, ...)`` runs ``INTERPRETER -I -S -B -c SOURCE
READY_FD ARGS...`` inside a bubblewrap (``bwrap``) sandbox, one per call:

  * namespaces: user (uid/gid 65534 inside), pid (the program is pid 1),
    network (only the sandbox's own loopback; the host's 127.0.0.1 is not
    reachable), ipc, uts (hostname "sandbox"), cgroup, mount; no further
    user namespaces (``--disable-userns``);
  * outside the namespace the sandbox runs as an unprivileged uid, so that
    RLIMIT_NPROC is enforced: the caller's uid, or 65534 when the caller is
    root (``nsenter --setuid``, see ``_stage_for_root``);
  * files: a read-only tmpfs root holding only the interpreter, its
    standard library (site-packages masked by an empty directory), the
    shared libraries these link, ``/etc/ld.so.cache``, a fresh ``/proc`` and
    ``/dev/{null,zero,random,urandom}``; the working directory ``/tmp`` is
    the only writable place, a private tmpfs of ``tmpfs_bytes``;
  * an empty environment, a new session (no TIOCSTI on the caller's
    terminal), no capabilities, no_new_privs, and the seccomp deny list of
    ``rljax.envs.seccomp``;
  * the whole tree dies with the call: after every call (normal return,
    timeout or an exception in the caller) bwrap and the sandbox's pid 1
    get SIGKILL, and the call returns only once a pidfd of pid 1 says it
    has exited, which the kernel reports after it has killed and reaped
    every other process of the pid namespace; ``--die-with-parent`` covers
    a caller that dies.

The program does its trusted setup (limits, audit hook), writes one byte to
the file descriptor named by ``sys.argv[1]`` and closes it, and only then
runs untrusted code. A call that ends without that byte failed in bwrap's
setup, before any untrusted code ran: that raises ``SandboxError`` instead
of passing for a tool result.

``probe()`` (cached) builds the launch plan and runs a self-test that every
guarantee above holds on this machine; it raises ``SandboxUnavailable``,
naming what is missing and how to install it, and nothing here ever runs
code without the sandbox.
"""

from __future__ import annotations

import atexit
import dataclasses
import glob
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple, Optional, Sequence

from rljax.envs import seccomp

SANDBOX_UID = 65534
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install -y "
                "bubblewrap)")
TMPFS_BYTES = 8 << 20
MIN_BWRAP_VERSION = (0, 8)
_STDERR_BYTES = 4096
_REAP_TIMEOUT_S = 10.0
# bwrap writes its child's pid within milliseconds of starting.
_INFO_TIMEOUT_S = 30.0
# Extension modules whose libraries are left out: Tk needs a display.
_SKIPPED_EXTENSIONS = ("_tkinter",)
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")


class SandboxUnavailable(RuntimeError):
    """This machine cannot provide the sandbox; the tool refuses to run."""


class SandboxError(RuntimeError):
    """bwrap failed before the sandboxed program started."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to launch one sandbox (built once by ``probe``).

    Attributes:
      bwrap: path of the bwrap executable.
      interpreter: the interpreter run inside (same path inside and out).
      binds: (source as bwrap sees it, destination inside) read-only binds.
      masked: directories inside a bound one that are hidden by an empty,
        read-only tmpfs (site-packages).
      nsenter: for a root caller, nsenter, which enters ``mount_ns`` and
        switches to uid/gid 65534 before it executes bwrap; else None.
      mount_ns: descriptor of the staging mount namespace (root), or None.
      arch: CPU architecture, for the seccomp program.
      outer_uid: the uid the sandbox has outside its user namespace.
    """

    bwrap: str
    interpreter: str
    binds: tuple[tuple[str, str], ...]
    masked: tuple[str, ...]
    nsenter: Optional[str]
    mount_ns: Optional[int]
    arch: str
    outer_uid: int


class Completed(NamedTuple):
    """One sandboxed run: exit status (negative: signal), output, timeout."""

    returncode: int
    stdout: bytes
    timed_out: bool


def _unavailable(what: str) -> SandboxUnavailable:
    return SandboxUnavailable(
        f"the Python tool's sandbox is unavailable: {what}. The tool never "
        f"runs code without it.")


def _interpreter_layout(interpreter: str) -> tuple[list[str], list[str]]:
    """The interpreter's own ``-I -S`` path entries and its shared libraries.

    Asks the interpreter itself (``sys.path`` under the flags the sandbox
    uses) and ``ldd`` (the libraries the executable and the standard
    library's extension modules link, as the loader resolves them).
    """
    query = ("import json, sys; print(json.dumps([p for p in sys.path "
             "if p]))")
    out = subprocess.run([interpreter, "-I", "-S", "-c", query], env={},
                         capture_output=True, check=True, timeout=60).stdout
    path_dirs = [p for p in json.loads(out) if os.path.isdir(p)]
    ldd = shutil.which("ldd")
    if ldd is None:
        raise _unavailable("ldd (Debian package libc-bin) was not found, so "
                           "the interpreter's libraries cannot be listed")
    objects = [interpreter]
    for directory in path_dirs:
        objects += sorted(
            f for f in glob.glob(os.path.join(directory, "*.so"))
            if not os.path.basename(f).startswith(_SKIPPED_EXTENSIONS))
    listing = subprocess.run([ldd, *objects], env={"LC_ALL": "C"},
                             capture_output=True, text=True, timeout=60).stdout
    libraries = set()
    for line in listing.splitlines():
        found = (re.search(r"=> (/\S+) \(0x", line)
                 or re.match(r"\s+(/\S+) \(0x", line))
        if found:
            libraries.add(found.group(1))
    if not libraries:
        raise _unavailable(f"ldd listed no libraries for {interpreter}")
    return path_dirs, sorted(libraries)


def _bind_list(interpreter: str) -> tuple[list[str], list[str]]:
    """Host paths to expose (deduplicated: none inside another) and masks."""
    path_dirs, libraries = _interpreter_layout(interpreter)
    paths = [interpreter, *path_dirs, *libraries]
    if os.path.isfile("/etc/ld.so.cache"):
        paths.append("/etc/ld.so.cache")
    paths = sorted(set(paths))
    kept = []
    for path in paths:  # Sorted, so a directory precedes what it holds.
        if not any(path.startswith(d + "/") for d in kept):
            kept.append(path)
    masked = [os.path.join(d, name) for d in path_dirs
              for name in ("site-packages", "dist-packages")
              if os.path.isdir(os.path.join(d, name))]
    return kept, masked


# Run by root's interpreter in a child: a private mount namespace whose
# tmpfs at STAGE holds read-only binds of the sandbox's files at STAGE+PATH,
# traversable by uid 65534 even where the host path is not (a Python
# installed under /root, mode 0700). The namespace outlives the helper
# through the descriptor the parent opens on /proc/PID/ns/mnt.
_STAGE_HELPER = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
MS_REC, MS_PRIVATE, CLONE_NEWNS = 16384, 1 << 18, 0x20000

def check(result, what):
    if result != 0:
        raise OSError(ctypes.get_errno(), what)

def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
          f"mount {source} {target}")

stage, paths = json.loads(sys.stdin.readline())
check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
mount(None, "/", None, MS_REC | MS_PRIVATE)
mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
for path in paths:
    target = stage + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if os.path.isdir(path):
        os.mkdir(target, 0o755)
    else:
        open(target, "x").close()
    mount(path, target, None, MS_BIND)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
          | MS_NODEV)
mount(None, stage, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV,
      "mode=0755")
print("ready", flush=True)
sys.stdin.read()
"""


def _stage_for_root(paths: list[str]) -> tuple[str, int]:
    """(staging root, mount-namespace fd) for a root caller; see the helper.

    Root's own uid would make RLIMIT_NPROC a no-op (the kernel exempts uid
    0), and uid 65534 cannot read a Python installed under /root; so the
    sandbox's files are staged in a private mount namespace that bwrap,
    started by ``nsenter --mount --setuid 65534``, binds from.
    """
    stage = tempfile.mkdtemp(prefix="rljax-sandbox-stage-")
    owner = os.getpid()
    # Only the creator removes it: a forked child that exits must not
    # detach the mounts its parent still uses.
    atexit.register(lambda: os.getpid() == owner and os.rmdir(stage))
    helper = subprocess.Popen(
        [os.path.realpath(sys.executable), "-I", "-S", "-c", _STAGE_HELPER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={})
    try:
        helper.stdin.write((json.dumps([stage, paths]) + "\n").encode())
        helper.stdin.flush()
        if helper.stdout.readline().strip() != b"ready":
            helper.stdin.close()
            error = helper.stderr.read().decode(errors="replace").strip()
            last_line = (error.splitlines() or ["no error output"])[-1]
            raise _unavailable(
                "could not build the private mount namespace a root caller "
                f"needs (CAP_SYS_ADMIN is required): {last_line}")
        mount_ns = os.open(f"/proc/{helper.pid}/ns/mnt",
                           os.O_RDONLY | os.O_CLOEXEC)
    finally:
        if helper.stdin and not helper.stdin.closed:
            helper.stdin.close()
        helper.wait()
    return stage, mount_ns


def build_plan(bwrap: Optional[str]) -> Plan:
    """The launch plan for this process, or SandboxUnavailable."""
    if not sys.platform.startswith("linux"):
        raise _unavailable(f"it needs Linux namespaces, this is "
                           f"{sys.platform}")
    if bwrap is None or not os.access(bwrap, os.X_OK):
        raise _unavailable(f"bubblewrap (bwrap) was not found; {INSTALL_HINT}")
    version = subprocess.run([bwrap, "--version"], capture_output=True,
                             text=True, timeout=30).stdout
    found = re.search(r"(\d+)\.(\d+)", version)
    if not found or tuple(map(int, found.groups())) < MIN_BWRAP_VERSION:
        raise _unavailable(
            f"bubblewrap >= {'.'.join(map(str, MIN_BWRAP_VERSION))} is needed "
            f"(--disable-userns, --size), found {version.strip()!r}; "
            f"{INSTALL_HINT}")
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        raise _unavailable("it needs pidfd_open (Linux >= 5.3, Python >= "
                           "3.9) to know when every sandboxed process is "
                           "gone") from None
    arch = seccomp.machine()
    if arch not in seccomp.SUPPORTED_ARCHS:
        raise _unavailable(f"no seccomp filter for CPU architecture {arch!r} "
                           f"(supported: {', '.join(seccomp.SUPPORTED_ARCHS)})")
    interpreter = os.path.realpath(sys.executable)
    paths, masked = _bind_list(interpreter)
    if os.getuid() != 0:
        return Plan(bwrap, interpreter, tuple((p, p) for p in paths),
                    tuple(masked), None, None, arch, os.getuid())
    nsenter = shutil.which("nsenter")
    if nsenter is None:
        raise _unavailable("a root caller needs nsenter (Debian package "
                           "util-linux) to run the sandbox as uid 65534")
    stage, mount_ns = _stage_for_root(paths)
    return Plan(bwrap, interpreter, tuple((stage + p, p) for p in paths),
                tuple(masked), nsenter, mount_ns, arch, SANDBOX_UID)


def _launcher(plan: Plan) -> list[str]:
    """What runs bwrap: nothing, or nsenter for a root caller.

    nsenter opens the namespace through this process's descriptor table
    (``/proc/PID/fd/N``, the descriptor stays close-on-exec), so the
    sandbox never inherits a descriptor of the staging namespace.
    """
    if plan.nsenter is None:
        return []
    return [plan.nsenter, f"--mount=/proc/{os.getpid()}/fd/{plan.mount_ns}",
            f"--setuid={SANDBOX_UID}", f"--setgid={SANDBOX_UID}", "--"]


def bwrap_argv(plan: Plan, *, tmpfs_bytes: int,
               seccomp_fd: Optional[int]) -> list[str]:
    """The launcher + bwrap part of the command line (up to ``--``)."""
    argv = [*_launcher(plan), plan.bwrap,
            "--unshare-user", "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
            "--disable-userns", "--uid", str(SANDBOX_UID),
            "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
            "--die-with-parent", "--new-session", "--clearenv",
            # The program itself is pid 1: no other process (bwrap's reaper
            # would be one, outside the program's rlimits) shares its uid
            # and namespaces, where /proc/1/mem could be written.
            "--as-pid-1"]
    for source, destination in plan.binds:
        argv += ["--ro-bind", source, destination]
    for directory in plan.masked:
        argv += ["--perms", "0555", "--size", "4096", "--tmpfs", directory,
                 "--remount-ro", directory]
    for device in _DEVICES:
        argv += ["--dev-bind", device, device]
    argv += ["--proc", "/proc", "--perms", "1777", "--size",
             str(tmpfs_bytes), "--tmpfs", "/tmp", "--chdir", "/tmp",
             "--remount-ro", "/"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv


def _read_until_eof(fd: int, timeout_s: float) -> bytes:
    """What bwrap writes on its info descriptor (it closes it right after)."""
    deadline = time.monotonic() + timeout_s
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""  # bwrap is stuck before its child exists.
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _open_init(info: bytes) -> Optional[int]:
    """A pidfd on the sandbox's pid 1, from bwrap's info JSON, or None.

    Opened while bwrap (its parent, which alone reaps it) still runs, so the
    pid cannot have been reused; the pidfd then names that process only.
    """
    try:
        return os.pidfd_open(int(json.loads(info)["child-pid"]))
    except (ValueError, KeyError, TypeError, ProcessLookupError):
        return None  # bwrap failed before it started a child.


def _kill_tree(process: subprocess.Popen, init_pidfd: Optional[int]) -> None:
    """SIGKILL to bwrap and the sandbox's pid 1; returns once all are gone.

    When pid 1 of a pid namespace exits, the kernel kills every process in
    the namespace and reaps them before pid 1's own exit is reported, so a
    readable pidfd of pid 1 means nothing in the sandbox is left.
    """
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # Already gone.
    process.wait()
    if process.stdin is not None:
        process.stdin.close()
    if init_pidfd is None:
        return
    try:
        signal.pidfd_send_signal(init_pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass  # It has exited (after a normal return it has).
    if not select.select([init_pidfd], [], [], _REAP_TIMEOUT_S)[0]:
        raise SandboxError(f"the sandbox's pid 1 was still alive "
                           f"{_REAP_TIMEOUT_S} s after SIGKILL")


def _read_nonblocking(fd: int, limit: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, limit)
    except BlockingIOError:
        return b""


def run_in_sandbox(plan: Plan, source: str, args: Sequence[str], *,
                   stdin: bytes, timeout_s: float, output_bytes: int,
                   tmpfs_bytes: int = TMPFS_BYTES,
                   use_seccomp: bool = True) -> Completed:
    """Runs the program ``source`` in a fresh sandbox (see module doc).

    Returns after every process of the sandbox is gone, on every path.
    ``use_seccomp=False`` exists for the tests that check each layer alone.
    Raises SandboxError when bwrap fails before the program starts.
    """
    deadline = time.monotonic() + timeout_s
    fds = {}
    try:
        fds["ready_r"], fds["ready_w"] = os.pipe()
        fds["info_r"], fds["info_w"] = os.pipe()
        if use_seccomp:  # bwrap reads the program, then closes the pipe.
            fds["seccomp_r"], seccomp_w = os.pipe()
            os.write(seccomp_w, seccomp.build_filter(plan.arch))
            os.close(seccomp_w)
        argv = [*bwrap_argv(plan, tmpfs_bytes=tmpfs_bytes,
                            seccomp_fd=fds.get("seccomp_r")),
                "--info-fd", str(fds["info_w"]),
                "--", plan.interpreter, "-I", "-S", "-B", "-c", source,
                str(fds["ready_w"]), *args]
        with tempfile.TemporaryFile() as stdout, \
                tempfile.TemporaryFile() as stderr:
            process = subprocess.Popen(
                argv, env={}, stdin=subprocess.PIPE, stdout=stdout,
                stderr=stderr, start_new_session=True, close_fds=True,
                pass_fds=tuple(fds[name] for name in
                               ("ready_w", "info_w", "seccomp_r")
                               if name in fds))
            init_pidfd = None
            timed_out = False
            try:
                for name in ("ready_w", "info_w"):
                    os.close(fds.pop(name))
                init_pidfd = _open_init(_read_until_eof(fds["info_r"],
                                                        _INFO_TIMEOUT_S))
                if init_pidfd is not None:
                    fds["init"] = init_pidfd
                    # The code goes only to a sandbox whose pid 1 we hold.
                    process.communicate(
                        stdin, timeout=max(deadline - time.monotonic(), 1e-3))
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_tree(process, init_pidfd)  # On every path.
            started = _read_nonblocking(fds["ready_r"], 1) == b"1"
            if init_pidfd is None or not (started or timed_out):
                stderr.seek(0)
                raise SandboxError(
                    "bwrap failed before the sandboxed program started "
                    f"(exit status {process.returncode}): "
                    + stderr.read(_STDERR_BYTES).decode(errors="replace"))
            stdout.seek(0)
            return Completed(process.returncode, stdout.read(output_bytes + 1),
                             timed_out)
    finally:
        for fd in fds.values():
            os.close(fd)


# Checks, from inside, what the plan promises; prints one JSON line. Runs
# without the audit hook, so the OS layers alone must refuse.
_SELF_TEST = r"""
import _thread, json, os, resource, sys, time
os.write(int(sys.argv[1]), b"1")
os.close(int(sys.argv[1]))
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
report = {"uid": os.getuid(), "uid_map": open("/proc/self/uid_map").read(),
          "status": open("/proc/self/status").read(), "root": os.listdir("/")}
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    report["fork"] = "allowed"
except OSError as error:
    report["fork"] = error.errno
try:
    _thread.start_new_thread(time.sleep, (0,))
    report["thread"] = "allowed"
except RuntimeError:
    report["thread"] = "refused"
print(json.dumps(report))
"""


def _self_test(plan: Plan) -> None:
    """Raises SandboxUnavailable unless the sandbox holds on this machine."""
    try:
        done = run_in_sandbox(plan, _SELF_TEST, (), stdin=b"", timeout_s=30,
                              output_bytes=1 << 16)
    except SandboxError as error:
        hint = ""
        if "namespace" in str(error) or "Operation not permitted" in str(error):
            hint = ("; user namespaces look unavailable: enable them "
                    "(sysctl user.max_user_namespaces > 0, Debian "
                    "kernel.unprivileged_userns_clone=1, Ubuntu "
                    "kernel.apparmor_restrict_unprivileged_userns=0) or run "
                    "outside a container that blocks them")
        raise _unavailable(f"bwrap could not start a sandbox{hint}. "
                           f"{str(error).strip()}") from error
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise _unavailable(f"the sandbox self-test printed no report (exit "
                           f"status {done.returncode})") from None
    status = dict(line.split(":\t", 1) for line in report["status"].splitlines()
                  if ":\t" in line)
    outer_uid = int(report["uid_map"].split()[1])
    problems = []
    if report["uid"] != SANDBOX_UID:
        problems.append(f"uid inside is {report['uid']}, not {SANDBOX_UID}")
    if outer_uid == 0 or outer_uid != plan.outer_uid:
        problems.append(f"uid outside is {outer_uid} (RLIMIT_NPROC is not "
                        f"enforced for root)")
    if status.get("Seccomp", "").strip() != "2":
        problems.append("no seccomp filter")
    if status.get("NoNewPrivs", "").strip() != "1":
        problems.append("no_new_privs is not set")
    if int(status.get("CapEff", "1"), 16) != 0:
        problems.append("capabilities are not dropped")
    if report["fork"] == "allowed":
        problems.append("fork was allowed")
    if report["thread"] == "allowed":
        problems.append("RLIMIT_NPROC=0 did not stop a new thread")
    if problems:
        raise _unavailable("the sandbox self-test failed: "
                           + "; ".join(problems))


_PLAN: Optional[Plan] = None
_PLAN_ERROR: Optional[SandboxUnavailable] = None
_PLAN_LOCK = threading.Lock()


def probe() -> Plan:
    """The checked launch plan, built once per process; else raises.

    Raises:
      SandboxUnavailable: naming what is missing (bwrap, user namespaces,
        nsenter for root, a supported CPU) and how to get it. The outcome
        is cached, so the first call costs one sandbox start and later
        calls nothing.
    """
    global _PLAN, _PLAN_ERROR
    with _PLAN_LOCK:
        if _PLAN is None and _PLAN_ERROR is None:
            try:
                plan = build_plan(shutil.which("bwrap"))
                _self_test(plan)
                _PLAN = plan
            except SandboxUnavailable as error:
                _PLAN_ERROR = error
        if _PLAN_ERROR is not None:
            raise _PLAN_ERROR
        return _PLAN


def sandbox_available() -> bool:
    """True when ``probe()`` succeeds (cached): for tests and diagnostics."""
    try:
        probe()
    except SandboxUnavailable:
        return False
    return True
