"""Escape attempts against the Python tool's OS sandbox, each with a control.

Every attempt prints "ESCAPED" if it works. It runs inside the sandbox with
the audit hook switched off (the OS layers alone must hold: seccomp,
RLIMIT_NPROC and namespaces, or namespaces alone where the guarantee is
theirs), and the same code runs outside the sandbox as a control that shows
the attempt does work on this machine, so each test can fail.
"""

import ast
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from rljax.envs import python_tool
from rljax.envs import seccomp

REPO = pathlib.Path(__file__).resolve().parents[2]
WITH_HOOK = python_tool._Layers()
OS_LAYERS = python_tool._Layers(audit_hook=False)
NAMESPACES_ONLY = python_tool._Layers(audit_hook=False, seccomp=False,
                                      nproc_limit=False)


def inside(code, layers, timeout_s=10.0):
    return python_tool._run_python(code, timeout_s=timeout_s,
                                   memory_bytes=512 << 20,
                                   max_output_chars=4000, layers=layers)


def outside(code, cwd, env=None):
    """The control: the same code in a plain interpreter, no sandbox."""
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=cwd,
                          env={} if env is None else env, capture_output=True,
                          text=True, timeout=60)
    return done.stdout + done.stderr


def assert_contained(code, layers, cwd, expected_error=None):
    outcome = inside(code, layers)
    assert "ESCAPED" not in outcome.text, outcome.text
    assert not outcome.timeout
    if expected_error is not None:
        assert not outcome.ok and outcome.text.startswith(expected_error), \
            outcome.text
    assert "ESCAPED" in outside(code, cwd)
    return outcome


# ---- the exploit: blocked C modules loaded from their files ----

LOAD_FROM_FILE = """
import importlib.util, os, sys
lib = [p for p in sys.path if p.endswith("lib-dynload")][0]
name = [f for f in os.listdir(lib) if f.startswith("{module}.")][0]
spec = importlib.util.spec_from_file_location("x.{module}", lib + "/" + name)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("ESCAPED", module)
"""


@pytest.mark.parametrize("module", ["_posixsubprocess", "_posixshmem",
                                    "_ctypes", "_socket"])
def test_loading_a_blocked_module_from_its_file_is_refused(module, tmp_path):
    assert_contained(LOAD_FROM_FILE.format(module=module), WITH_HOOK,
                     tmp_path, "PermissionError: sandbox: module")


def test_posixshmem_cannot_write_without_the_hook(tmp_path):
    code = ("import _posixshmem, os\n"
            "fd = _posixshmem.shm_open('/rljax-test-' + str(os.getpid()), "
            "os.O_CREAT | os.O_RDWR, 0o600)\n"
            "os.write(fd, b'x')\n"
            "_posixshmem.shm_unlink('/rljax-test-' + str(os.getpid()))\n"
            "print('ESCAPED')")
    assert_contained(code, OS_LAYERS, tmp_path, "FileNotFoundError")


# ---- processes ----

SPAWN = ("import subprocess, sys\n"
         "print(subprocess.run([sys.executable, '-c', 'print(\"ESCAPED\")'],"
         " capture_output=True, text=True).stdout)")
SHELL = ("import subprocess\n"
         "print(subprocess.run(['/bin/sh', '-c', 'echo ESCAPED'],"
         " capture_output=True, text=True).stdout)")


@pytest.mark.parametrize("code", [
    SPAWN, SHELL,
    "import os\nif os.fork() == 0:\n    os._exit(0)\nprint('ESCAPED')",
    "import os, sys\n"
    "pid = os.posix_spawn(sys.executable, [sys.executable, '-c', '0'], {})\n"
    "print('ESCAPED', os.waitpid(pid, 0))",
])
def test_no_new_process(code, tmp_path):
    assert_contained(code, OS_LAYERS, tmp_path, "PermissionError: [Errno 1]")


def test_fork_bomb_is_refused_by_rlimit_nproc_alone(tmp_path):
    # seccomp off: RLIMIT_NPROC = 0 is really enforced (EAGAIN), because
    # the sandbox is not root outside its user namespace.
    bomb = ("import os\nfor _ in range(64):\n    if os.fork() == 0:\n"
            "        os._exit(0)\nprint('ESCAPED')")
    layers = python_tool._Layers(audit_hook=False, seccomp=False)
    outcome = inside(bomb, layers)
    assert outcome.text.startswith("BlockingIOError: [Errno 11]"), outcome.text
    assert "ESCAPED" in outside(bomb, tmp_path)


def test_the_program_is_the_only_process_in_the_sandbox():
    # Another process there (bwrap's reaper, say) would have the same uid
    # but not the program's rlimits, and its /proc/PID/mem is writable.
    code = ("import os\n"
            "[p for p in os.listdir('/proc') if p.isdigit()], os.getpid()")
    assert inside(code, OS_LAYERS).text == "(['1'], 1)"


def test_threads_are_refused_by_rlimit_nproc():
    code = ("import threading\nt = threading.Thread(target=lambda: None)\n"
            "t.start()\nt.join()\n'started'")
    refused = "RuntimeError: can't start new thread"
    assert inside(code, OS_LAYERS).text == refused
    # Control: the same sandbox without RLIMIT_NPROC starts the thread.
    without = python_tool._Layers(audit_hook=False, nproc_limit=False)
    assert inside(code, without).text == "'started'"


def test_limits_cannot_be_raised(tmp_path):
    # Inside, the hard limit is 0 and 64 would raise it; outside (and in a
    # sandbox without RLIMIT_NPROC) the same call only lowers a limit.
    code = ("import resource\n"
            "resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))\n"
            "print('ESCAPED')")
    assert_contained(code, OS_LAYERS, tmp_path,
                     "ValueError: not allowed to raise maximum limit")
    without = python_tool._Layers(audit_hook=False, nproc_limit=False)
    assert inside(code, without).text == "ESCAPED"


def test_exec_keeps_every_os_layer():
    # execve stays allowed (bwrap needs it); the new interpreter has no
    # audit hook but keeps the uid, the seccomp filter and the limits.
    probe = ("import json, os, resource\n"
             "s = open('/proc/self/status').read()\n"
             "print(json.dumps({'ok': True, 'output': repr((os.getuid(), "
             "'Seccomp:\\t2' in s, resource.getrlimit(resource.RLIMIT_NPROC), "
             "os.path.exists('/etc/passwd')))}))")
    code = (f"import os, sys\nos.execv(sys.executable, [sys.executable, "
            f"'-I', '-S', '-c', {probe!r}])")
    assert inside(code, OS_LAYERS).text == "(65534, True, (0, 0), False)"


def test_seccomp_refuses_every_listed_syscall():
    denied = seccomp.denied_syscalls(seccomp.machine())
    code = (
        "import ctypes, json\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "out = {}\n"
        f"for name, nr in {denied!r}.items():\n"
        "    if name in ('clone', 'fork', 'vfork'):\n"
        "        continue  # The fork tests cover these.\n"
        "    ctypes.set_errno(0)\n"
        "    arg = ctypes.c_long(-1)  # Harmless for each when allowed.\n"
        "    result = libc.syscall(ctypes.c_long(nr), arg, arg, arg, arg, "
        "arg, arg)\n"
        "    out[name] = (result, ctypes.get_errno())\n"
        "print(json.dumps(out))")
    with_filter = json.loads(inside(code, OS_LAYERS).text)
    errors = {name: errno for name, (_, errno) in with_filter.items()}
    assert errors.pop("clone3") == 38  # ENOSYS: libc falls back to clone.
    assert set(errors.values()) == {1}, errors  # EPERM for all others.
    # Control: without the filter the same calls reach the kernel.
    without = python_tool._Layers(audit_hook=False, seccomp=False)
    plain = json.loads(inside(code, without).text)
    assert plain["personality"][0] >= 0  # A query; it succeeds.
    assert plain["socket"][1] != 1 and plain["unshare"][1] != 1


def test_x32_calls_are_refused():
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "r = libc.syscall(ctypes.c_long(0x40000000 | 39))\n"  # getpid
            "(r, ctypes.get_errno())")
    if seccomp.machine() != "x86_64":
        pytest.skip("x32 exists on x86_64 only")
    assert inside(code, OS_LAYERS).text == "(-1, 1)"
    without = python_tool._Layers(audit_hook=False, seccomp=False)
    assert inside(code, without).text != "(-1, 1)"


# ---- nothing outlives the call ----

DAEMON = """
import os, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open("/proc/self/comm", "w") as f:
            f.write("{marker}")
        os.write(w, b"1")
        time.sleep(120)
    os._exit(0)
os.read(r, 1)
time.sleep({linger})
"""


def _host_pids_named(marker):
    pids = []
    for comm in pathlib.Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == marker:
                pids.append(int(comm.parent.name))
        except OSError:
            pass  # The process ended while we looked.
    return pids


@pytest.mark.parametrize("linger,timeout_s", [(1.0, 10.0), (60.0, 2.0)],
                         ids=["normal-return", "timeout"])
def test_double_forked_daemon_dies_with_the_call(linger, timeout_s):
    # All layers but the namespaces off, so the daemon can be created.
    marker = "rljax" + uuid.uuid4().hex[:10]
    code = DAEMON.format(marker=marker, linger=linger)
    outcome = {}
    call = threading.Thread(target=lambda: outcome.update(
        result=inside(code, NAMESPACES_ONLY, timeout_s=timeout_s)))
    call.start()
    seen = []
    deadline = time.monotonic() + 30
    while not seen and call.is_alive() and time.monotonic() < deadline:
        seen = _host_pids_named(marker)
        time.sleep(0.02)
    call.join()
    assert seen, "control: the daemon was never visible from the host"
    assert outcome["result"].timeout == (linger > timeout_s)
    assert _host_pids_named(marker) == []


# ---- files ----

@pytest.mark.parametrize("path", [
    "'/etc/shadow'", "'/etc/passwd'", repr(str(REPO / "setup.py")),
    "'/proc/self/root/etc/shadow'", "'/proc/thread-self/root/etc/shadow'",
    "'/tmp/../../etc/shadow'",
    # The parent's root: none inside (the program is pid 1), the test
    # process's outside.
    "f'/proc/{os.getppid()}/root/etc/shadow'",
])
def test_host_files_are_not_readable(path, tmp_path):
    code = f"import os\nprint('ESCAPED', open({path}).read()[:20])"
    assert_contained(code, NAMESPACES_ONLY, tmp_path, "FileNotFoundError")


def test_a_secret_file_of_the_host_is_not_readable(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    code = f"print('ESCAPED', open({str(secret)!r}).read())"
    assert_contained(code, NAMESPACES_ONLY, tmp_path, "FileNotFoundError")


def test_the_test_process_is_invisible_in_proc(tmp_path):
    pid = os.getpid()
    code = f"print('ESCAPED', open('/proc/{pid}/environ').read()[:20])"
    assert_contained(code, NAMESPACES_ONLY, tmp_path, "FileNotFoundError")


def test_symlink_out_of_the_tmpfs_leads_nowhere(tmp_path):
    code = ("import os\nos.symlink('/etc/shadow', 'link')\n"
            "print('ESCAPED', open('link').read()[:20])")
    assert_contained(code, NAMESPACES_ONLY, tmp_path, "FileNotFoundError")


def test_only_interpreter_files_are_visible(tmp_path):
    code = ("import os, sys\n"
            "site = os.path.join(os.path.dirname(os.__file__), "
            "'site-packages')\n"
            "print('ESCAPED' if os.listdir(site) or os.path.exists('/home') "
            "or os.path.exists('/usr/bin') else 'none', "
            "sorted(os.listdir('/')))")
    outcome = assert_contained(code, NAMESPACES_ONLY, tmp_path)
    top = {"dev", "etc", "lib", "lib64", "proc", "tmp", "usr", "root"}
    listed = ast.literal_eval(outcome.text.split(" ", 1)[1])
    assert set(listed) <= top, listed


@pytest.mark.parametrize("layers", [NAMESPACES_ONLY, OS_LAYERS],
                         ids=["namespaces", "os-layers"])
def test_only_stdio_descriptors_are_inherited(layers, tmp_path):
    # No descriptor of the host (a directory would allow openat() outside,
    # a namespace one setns()) reaches the program: only 0, 1 and 2.
    code = ("import os\nopen_fds = []\nfor fd in range(1024):\n"
            "    try:\n        os.fstat(fd)\n        open_fds.append(fd)\n"
            "    except OSError:\n        pass\n"
            "print('ESCAPED' if open_fds != [0, 1, 2] else 'none', open_fds)")
    assert inside(code, layers).text == "none [0, 1, 2]"
    # Control: a process started with a directory descriptor does see it.
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", code],
                              pass_fds=[fd], capture_output=True, text=True)
    finally:
        os.close(fd)
    assert "ESCAPED" in done.stdout


@pytest.mark.parametrize("target", [
    "/pwned", "/etc/pwned", "/proc/pwned", "/proc/sysrq-trigger",
    "/proc/sys/kernel/core_pattern", "/dev/shm/pwned",
])
def test_nothing_outside_the_tmpfs_is_writable(target):
    code = f"open({target!r}, 'w').write('x')\nprint('ESCAPED')"
    outcome = inside(code, NAMESPACES_ONLY)
    assert not outcome.ok and "ESCAPED" not in outcome.text
    assert outcome.text.startswith(("OSError: [Errno 30]",
                                    "PermissionError", "FileNotFoundError"))


def test_host_path_is_not_writable(tmp_path):
    target = tmp_path / "pwned"
    code = f"open({str(target)!r}, 'w').write('x')\nprint('ESCAPED')"
    outcome = inside(code, NAMESPACES_ONLY)
    assert outcome.text.startswith("FileNotFoundError") and not target.exists()
    assert "ESCAPED" in outside(code, tmp_path) and target.exists()


def test_standard_library_is_read_only():
    code = ("import os\nopen(os.path.join(os.path.dirname(os.__file__), "
            "'pwned.py'), 'w')\nprint('ESCAPED')")
    assert inside(code, NAMESPACES_ONLY).text.startswith(
        "OSError: [Errno 30] Read-only file system")
    # Control: outside, the caller could write there.
    assert os.access(os.path.dirname(os.__file__), os.W_OK)


FILL = """
import errno
written = 0
try:
    for i in range(12):
        with open(f"fill{i}", "wb") as f:
            for _ in range(16):
                f.write(b"x" * 65536)
                written += 65536
    print("ESCAPED", written)
except OSError as error:
    print(errno.errorcode[error.errno], written)
"""


def test_tmpfs_is_size_capped(tmp_path):
    outcome = inside(FILL, NAMESPACES_ONLY)
    code, written = outcome.text.split()
    assert code == "ENOSPC" and int(written) <= 8 << 20
    assert "ESCAPED" in outside(FILL, tmp_path)  # 12 MiB fit on the host.


def test_a_file_is_capped_at_one_mib(tmp_path):
    code = "open('big', 'wb').write(b'x' * (2 << 20))\nprint('ESCAPED')"
    assert_contained(code, OS_LAYERS, tmp_path, "OSError: [Errno 27]")


@pytest.mark.parametrize("grow", [
    "os.ftruncate(1, 1 << 40)", "os.posix_fallocate(1, 0, 1 << 40)",
    "os.pwrite(1, b'x', 1 << 40)",
])
def test_the_output_file_cannot_grow_past_one_mib(grow):
    # stdout is a file on the host: RLIMIT_FSIZE caps it however it grows.
    outcome = inside(f"import os\n{grow}\nprint('ESCAPED')", OS_LAYERS)
    assert outcome.text.startswith("OSError: [Errno 27] File too large")


def test_tmpfs_is_private_to_one_call():
    assert inside("open('keep', 'w').write('x')\nimport os\nos.listdir('.')",
                  NAMESPACES_ONLY).text == "['keep']"
    assert inside("import os\nos.listdir('.')", NAMESPACES_ONLY).text == "[]"


# ---- network ----

@pytest.fixture
def tcp_listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted = []

    def serve():
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    server.close()
    for connection in accepted:
        connection.close()


def test_host_loopback_tcp_is_unreachable(tcp_listener, tmp_path):
    port, accepted = tcp_listener
    code = ("import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
            "print('ESCAPED')")
    assert inside(code, NAMESPACES_ONLY).text.startswith(
        "ConnectionRefusedError")
    assert inside(code, OS_LAYERS).text.startswith("PermissionError")
    assert accepted == []
    assert "ESCAPED" in outside(code, tmp_path)


def test_host_udp_receives_nothing(tmp_path):
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(2.0)
    port = receiver.getsockname()[1]
    code = ("import socket\ns = socket.socket(socket.AF_INET, "
            f"socket.SOCK_DGRAM)\ns.sendto(b'ESCAPED', ('127.0.0.1', {port}))")
    try:
        inside(code, NAMESPACES_ONLY)
        with pytest.raises(TimeoutError):
            receiver.recv(64)
        outside(code, tmp_path)
        assert receiver.recv(64) == b"ESCAPED"
    finally:
        receiver.close()


def test_host_abstract_unix_socket_is_unreachable(tmp_path):
    name = "\0rljax-test-" + uuid.uuid4().hex
    server = socket.socket(socket.AF_UNIX)
    server.bind(name)
    server.listen(1)
    code = (f"import socket\ns = socket.socket(socket.AF_UNIX)\n"
            f"s.connect({name!r})\nprint('ESCAPED')")
    try:
        assert inside(code, NAMESPACES_ONLY).text.startswith(
            "ConnectionRefusedError")
        assert "ESCAPED" in outside(code, tmp_path)
    finally:
        server.close()


def test_only_an_isolated_loopback_interface():
    assert inside("import socket\nsocket.if_nameindex()",
                  NAMESPACES_ONLY).text == "[(1, 'lo')]"


# ---- environment, identity, signals ----

def test_environment_secrets_are_not_visible(monkeypatch, tmp_path):
    monkeypatch.setenv("RLJAX_TEST_SECRET", "s3cr3t-value")
    code = ("import os\nseen = [str(dict(os.environ))]\n"
            "paths = ['/proc/self/environ', '/proc/1/environ']\n"
            "if os.getppid():  # 0 inside: the program is pid 1 there.\n"
            "    paths.append(f'/proc/{os.getppid()}/environ')\n"
            "for path in paths:\n"
            "    try:\n        seen.append(open(path).read())\n"
            "    except OSError:\n        seen.append('unreadable')\n"
            "print('ESCAPED' if any('s3cr3t' in s for s in seen) else 'none',"
            " seen.count('unreadable'))")
    # Inside, every one of them was readable, and none held the secret.
    assert inside(code, NAMESPACES_ONLY).text == "none 0"
    assert "ESCAPED" in outside(code, tmp_path, env=dict(os.environ))


def test_identity_inside_is_unprivileged():
    code = ("import os\ns = open('/proc/self/status').read()\n"
            "f = lambda k: s.split(k + ':')[1].split()[0]\n"
            "(os.getuid(), os.getgid(), "
            "open('/proc/self/uid_map').read().split(), f('CapEff'), "
            "f('NoNewPrivs'), os.uname().nodename)")
    uid, gid, uid_map, caps, no_new_privs, host = ast.literal_eval(
        inside(code, NAMESPACES_ONLY).text)
    assert (uid, gid, caps, no_new_privs, host) == (
        65534, 65534, "0000000000000000", "1", "sandbox")
    assert uid_map[0] == "65534" and uid_map[1] != "0"  # Never root outside.
    assert socket.gethostname() != "sandbox"


def test_the_parent_cannot_be_signalled(tmp_path):
    pid = os.getpid()
    code = f"import os\nos.kill({pid}, 0)\nprint('ESCAPED')"
    assert_contained(code, NAMESPACES_ONLY, tmp_path, "ProcessLookupError")
    # kill(-1) reaches nothing outside; SIGKILL to the sandbox's own pid 1
    # is ignored by the kernel (a namespace init), and the call completes.
    outcome = inside("import os, signal\nos.kill(1, signal.SIGKILL)\n"
                     "try:\n    os.kill(-1, signal.SIGKILL)\n"
                     "except ProcessLookupError:\n    print('none')",
                     NAMESPACES_ONLY)
    assert outcome.text == "none"


def test_memory_is_capped(tmp_path):
    code = "print('ESCAPED', len(bytes(1 << 30)))"
    assert_contained(code, WITH_HOOK, tmp_path, "MemoryError")


def test_killing_bwrap_kills_the_sandbox():
    # As if the caller died: bwrap's child has --die-with-parent, and the
    # pid namespace takes every process with it.
    marker = "rljax" + uuid.uuid4().hex[:10]
    code = DAEMON.format(marker=marker, linger=60)
    result = {}

    def call():
        try:
            inside(code, NAMESPACES_ONLY, timeout_s=120)
        except BaseException as error:  # noqa: BLE001 - recorded for assert
            result["error"] = error

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 30
    pids = []
    while not pids and time.monotonic() < deadline:
        pids = _host_pids_named(marker)
        time.sleep(0.02)
    assert pids
    bwraps = [int(p.parent.name) for p in pathlib.Path("/proc").glob(
        "[0-9]*/comm") if _safe_read(p) == "bwrap"
        and _safe_read(p.parent / "stat").split()[3] == str(os.getpid())]
    assert bwraps
    for bwrap_pid in bwraps:
        os.kill(bwrap_pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive()
    deadline = time.monotonic() + 10
    while _host_pids_named(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _host_pids_named(marker) == []


def _safe_read(path):
    try:
        return path.read_text().strip()
    except OSError:
        return ""
