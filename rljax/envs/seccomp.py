"""A seccomp-BPF deny list for the Python tool's sandbox, as raw bytes.

bubblewrap loads the program (``bwrap --seccomp FD``) into the sandboxed
process just before it executes the interpreter. The program is a list of
classic BPF instructions (``struct sock_filter``: u16 code, u8 jt, u8 jf,
u32 k) over ``struct seccomp_data`` (int nr; u32 arch; u64 ip; u64 args[6]).

Hand-assembled rather than built with libseccomp: the Python bindings are a
Debian package our interpreter cannot import, the PyPI ones need the C
library at run time, and the program is a 60-line table lookup. Its syscall
numbers are checked against the kernel headers in
``tests/envs/test_sandbox_seccomp.py``.

What it refuses, with EPERM unless noted:
  * new processes: fork, vfork, and clone without CLONE_THREAD (threads are
    stopped by RLIMIT_NPROC instead); clone3 gets ENOSYS, because its flags
    sit behind a pointer BPF cannot read and ENOSYS makes libc fall back to
    clone;
  * sockets of any family (socket, socketpair);
  * namespaces and mounts (unshare, setns, mount and the new mount API,
    pivot_root, chroot);
  * other processes' memory (ptrace, process_vm_*, kcmp, pidfd_getfd);
  * kernel attack surface no snippet needs (bpf, perf_event_open,
    userfaultfd, io_uring, keyrings, modules, kexec, handles, acct, swap,
    reboot, syslog, quotactl, iopl/ioperm, personality);
  * any other architecture's calling convention (the process is killed),
    and on x86_64 the x32 ABI.

execve stays allowed: bubblewrap needs it to start the interpreter after the
filter is in place, and the interpreter is the only program in the sandbox.
"""

from __future__ import annotations

import platform
import struct

# Classic BPF opcodes (linux/filter.h) and seccomp return values.
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_EPERM = 1
_ENOSYS = 38
_CLONE_THREAD = 0x00010000
# Offsets in struct seccomp_data; args[0]'s low word on little-endian CPUs.
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0_LOW = 0, 4, 16
_X32_SYSCALL_BIT = 0x40000000

# Syscall numbers: arch/x86/entry/syscalls/syscall_64.tbl and
# include/uapi/asm-generic/unistd.h (aarch64, which has no fork, vfork,
# iopl or ioperm).
_DENIED = {
    "x86_64": dict(
        fork=57, vfork=58, socket=41, socketpair=53, unshare=272, setns=308,
        mount=165, umount2=166, pivot_root=155, chroot=161, fsopen=430,
        fsconfig=431, fsmount=432, fspick=433, move_mount=429, open_tree=428,
        mount_setattr=442, ptrace=101, process_vm_readv=310,
        process_vm_writev=311, kcmp=312, pidfd_getfd=438, bpf=321,
        perf_event_open=298, userfaultfd=323, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, keyctl=250, add_key=248,
        request_key=249, kexec_load=246, kexec_file_load=320,
        init_module=175, finit_module=313, delete_module=176,
        open_by_handle_at=304, name_to_handle_at=303, acct=163, swapon=167,
        swapoff=168, reboot=169, syslog=103, quotactl=179, iopl=172,
        ioperm=173, personality=135),
    "aarch64": dict(
        socket=198, socketpair=199, unshare=97, setns=268, mount=40,
        umount2=39, pivot_root=41, chroot=51, fsopen=430, fsconfig=431,
        fsmount=432, fspick=433, move_mount=429, open_tree=428,
        mount_setattr=442, ptrace=117, process_vm_readv=270,
        process_vm_writev=271, kcmp=272, pidfd_getfd=438, bpf=280,
        perf_event_open=241, userfaultfd=282, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, keyctl=219, add_key=217,
        request_key=218, kexec_load=104, kexec_file_load=294,
        init_module=105, finit_module=273, delete_module=106,
        open_by_handle_at=265, name_to_handle_at=264, acct=89, swapon=224,
        swapoff=225, reboot=142, syslog=116, quotactl=60, personality=92),
}
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435  # The same on both.
# AUDIT_ARCH_* (linux/audit.h): EM_* | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}

SUPPORTED_ARCHS = tuple(sorted(_DENIED))


def machine() -> str:
    """This CPU's architecture name as the tables spell it."""
    name = platform.machine().lower()
    return _MACHINE_ALIASES.get(name, name)


def denied_syscalls(arch: str) -> dict[str, int]:
    """Name -> number of every syscall the filter refuses on ``arch``."""
    _check_arch(arch)
    return {**_DENIED[arch], "clone": _CLONE[arch], "clone3": _CLONE3}


def _check_arch(arch: str) -> None:
    if arch not in _DENIED:
        raise ValueError(f"seccomp filter: unsupported architecture {arch!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHS)}")


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter(arch: str) -> bytes:
    """The deny-list program for ``arch`` (see the module docstring)."""
    _check_arch(arch)
    deny = _RET_ERRNO | _EPERM
    program = [
        _insn(_LD_W_ABS, _OFFSET_ARCH),
        _insn(_JEQ_K, _AUDIT_ARCH[arch], jt=1),
        _insn(_RET_K, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, _OFFSET_NR),
    ]
    if arch == "x86_64":
        program += [_insn(_JGE_K, _X32_SYSCALL_BIT, jf=1), _insn(_RET_K, deny)]
    for number in sorted(_DENIED[arch].values()):
        program += [_insn(_JEQ_K, number, jf=1), _insn(_RET_K, deny)]
    program += [
        _insn(_JEQ_K, _CLONE3, jf=1),
        _insn(_RET_K, _RET_ERRNO | _ENOSYS),
        # clone: a thread (CLONE_THREAD set) passes, a new process does not.
        _insn(_JEQ_K, _CLONE[arch], jf=3),
        _insn(_LD_W_ABS, _OFFSET_ARG0_LOW),
        _insn(_JSET_K, _CLONE_THREAD, jt=1),
        _insn(_RET_K, deny),
        _insn(_RET_K, _RET_ALLOW),
    ]
    return b"".join(program)
