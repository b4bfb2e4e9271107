"""The sandbox's setup: seccomp program, probe, refusals, non-root callers."""

import dataclasses
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys

import pytest

from rljax import envs
from rljax import tasks
from rljax.envs import isolation
from rljax.envs import python_tool
from rljax.envs import seccomp

REPO = pathlib.Path(__file__).resolve().parents[2]
HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h",
           "aarch64": "/usr/include/asm-generic/unistd.h"}
ALLOW, KILL = 0x7FFF0000, 0x80000000
EPERM, ENOSYS = 0x00050000 | 1, 0x00050000 | 38
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
READ = {"x86_64": 0, "aarch64": 63}  # Allowed syscalls' numbers.
CLONE_THREAD, SIGCHLD = 0x00010000, 17

# ---- the seccomp program ----


def run_filter(program, arch_value, nr, arg0=0):
    """A classic-BPF interpreter for the opcodes seccomp.py emits."""
    data = struct.pack("=iIQ6Q", nr, arch_value, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack_from("=HBBI", program, i)
             for i in range(0, len(program), 8)]
    pc = accumulator = 0
    for _ in range(len(insns)):  # No backward jumps: at most one pass.
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            accumulator = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35, 0x45):
            taken = {0x15: accumulator == k, 0x35: accumulator >= k,
                     0x45: bool(accumulator & k)}[code]
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
    raise AssertionError("program ran off its end")


@pytest.mark.parametrize("arch", seccomp.SUPPORTED_ARCHS)
def test_filter_decisions(arch):
    program = seccomp.build_filter(arch)
    assert len(program) % 8 == 0 and len(program) // 8 < 4096
    here = AUDIT_ARCH[arch]
    for name, nr in seccomp.denied_syscalls(arch).items():
        expected = ENOSYS if name == "clone3" else EPERM
        if name == "clone":
            # A thread passes, a new process does not.
            assert run_filter(program, here, nr, CLONE_THREAD | 0x100) == ALLOW
            assert run_filter(program, here, nr, SIGCHLD) == EPERM
        else:
            assert run_filter(program, here, nr) == expected, name
    assert run_filter(program, here, READ[arch]) == ALLOW
    other = AUDIT_ARCH["aarch64" if arch == "x86_64" else "x86_64"]
    assert run_filter(program, other, READ[arch]) == KILL
    if arch == "x86_64":  # The x32 ABI: same numbers with bit 30 set.
        assert run_filter(program, here, 0x40000000 | READ[arch]) == EPERM


@pytest.mark.parametrize("arch", seccomp.SUPPORTED_ARCHS)
def test_syscall_numbers_match_the_kernel_headers(arch):
    if not os.path.exists(HEADERS[arch]):
        pytest.skip(f"{HEADERS[arch]} is not installed (linux-libc-dev)")
    text = pathlib.Path(HEADERS[arch]).read_text()
    numbers = dict(re.findall(r"#define __NR_(\w+)\s+(\d+)\b", text))
    for name, nr in seccomp.denied_syscalls(arch).items():
        assert int(numbers[name]) == nr, name
    if arch == "aarch64":  # These do not exist there; nothing to deny.
        assert not {"fork", "vfork", "iopl", "ioperm"} & set(numbers)


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="riscv64.*aarch64, x86_64"):
        seccomp.build_filter("riscv64")


# ---- refusing to run without the sandbox ----

def test_missing_bwrap_is_named_with_the_install_command():
    with pytest.raises(isolation.SandboxUnavailable,
                       match="bwrap.*apt-get install -y bubblewrap"):
        isolation.build_plan(None)
    with pytest.raises(isolation.SandboxUnavailable, match="bubblewrap"):
        isolation.build_plan("/nonexistent/bwrap")


def test_python_env_refuses_at_construction_without_bwrap(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(isolation, "_PLAN", None)
    monkeypatch.setattr(isolation, "_PLAN_ERROR", None)
    monkeypatch.setattr(isolation.shutil, "which", lambda name, *a, **k: (
        None if name == "bwrap" else real_which(name, *a, **k)))
    assert not isolation.sandbox_available()
    with pytest.raises(isolation.SandboxUnavailable, match="never runs code"):
        envs.get_env("python", tasks.get_task("arithmetic"))
    with pytest.raises(isolation.SandboxUnavailable):
        envs.run_python("1 + 1")


def test_probe_is_cached():
    assert isolation.sandbox_available()
    assert isolation.probe() is isolation.probe()


def test_bwrap_setup_failure_raises_but_the_snippet_cannot_fake_one():
    plan = isolation.probe()
    broken = dataclasses.replace(
        plan, binds=plan.binds + (("/nonexistent-source", "/x"),))
    with pytest.raises(isolation.SandboxError, match="nonexistent-source"):
        isolation.run_in_sandbox(
            broken, python_tool._CHILD_SOURCE, ["100", "3", str(512 << 20),
                                                "4096", "1", "1"],
            stdin=b"1", timeout_s=10, output_bytes=4096)
    # The same words from the snippet are only its own failure.
    outcome = envs.run_python(
        "import os, sys\nsys.__stderr__.write('bwrap: Can\\'t find source "
        "path /x')\nsys.__stderr__.flush()\nos._exit(1)")
    assert outcome.text.startswith("the Python process exited with status 1")


# ---- other callers: unprivileged, and without user namespaces ----

# Loads isolation.py from the worktree without the rljax package (and so
# without JAX), then prints the probe's outcome as JSON.
PROBE_SCRIPT = """
import importlib.util, json, sys, types
for name in ("rljax", "rljax.envs"):
    package = types.ModuleType(name)
    package.__path__ = []
    sys.modules[name] = package
def load(name):
    spec = importlib.util.spec_from_file_location(
        "rljax.envs." + name, sys.argv[1] + "/rljax/envs/" + name + ".py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
load("seccomp")
isolation = load("isolation")
try:
    plan = isolation.probe()
    print(json.dumps({"outer_uid": plan.outer_uid,
                      "nsenter": plan.nsenter}))
except isolation.SandboxUnavailable as error:
    print(json.dumps({"error": str(error)}))
"""


def _world_readable_interpreter():
    """A system Python that uid 65534 can run, or None."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        path = os.path.realpath(candidate)
        if os.path.exists(path) and os.stat(path).st_mode & 0o005 == 0o005:
            return path
    return None


def test_an_unprivileged_caller_gets_the_same_sandbox():
    if os.getuid() != 0:
        report = {"outer_uid": isolation.probe().outer_uid}
        assert report["outer_uid"] == os.getuid()
        return
    interpreter = _world_readable_interpreter()
    if interpreter is None:
        pytest.skip("no interpreter that uid 65534 may run")
    done = subprocess.run(
        [interpreter, "-I", "-c", PROBE_SCRIPT, str(REPO)], user=65534,
        group=65534, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    # The self-test inside probe() passed: uid 65534 inside and out,
    # seccomp on, fork refused, RLIMIT_NPROC enforced; no nsenter needed.
    assert report == {"outer_uid": 65534, "nsenter": None}, done.stderr


def test_no_user_namespaces_is_a_clear_refusal():
    # An outer sandbox forbids new user namespaces; the probe inside must
    # refuse and say why.
    bwrap = shutil.which("bwrap")
    done = subprocess.run(
        [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
         "--tmpfs", "/tmp", "--unshare-user", "--disable-userns",
         "--uid", "65534", "--gid", "65534", "--",
         os.path.realpath(sys.executable), "-I", "-c", PROBE_SCRIPT,
         str(REPO)],
        env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=120)
    error = json.loads(done.stdout)["error"]
    assert "user namespaces look unavailable" in error, error
    assert "never runs code without it" in error
