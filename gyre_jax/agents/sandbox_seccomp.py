"""No user namespaces inside a root trainer's bubblewrap sandbox: a seccomp filter.

bwrap's ``--disable-userns`` only works together with a user namespace of bwrap's own,
which, run by root, would map the sandbox to kernel uid 0 (RLIMIT_NPROC exempts it; see
``sandbox.bwrap_argv``). So a root trainer's sandbox gets this classic-BPF filter through
``bwrap --seccomp FD`` instead: ``unshare`` and ``clone`` with CLONE_NEWUSER fail with
EPERM, ``setns`` fails with EPERM, and ``clone3`` (whose flags a filter cannot read) with
ENOSYS, so libc falls back to ``clone``, as in Docker's default profile. x86_64 only;
elsewhere ``filter_path`` returns None and the sandbox goes without (the cgroup still caps
what a namespace of its own could mount).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import platform
import struct
import tempfile

_AUDIT_ARCH_X86_64 = 0xC000003E
_NR = {"clone": 56, "unshare": 272, "setns": 308, "clone3": 435}
_CLONE_NEWUSER = 0x10000000
_EPERM, _ENOSYS = 1, 38
# BPF opcodes
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_X32_BIT = 0x40000000
_ALLOW, _ERRNO, _KILL = 0x7FFF0000, 0x00050000, 0x80000000  # SECCOMP_RET_{ALLOW,ERRNO,KILL_PROCESS}


def _program() -> bytes:
    ins = [
        (_LD_W_ABS, 0, 0, 4),                       # 0: A = arch
        (_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),         # 1: x86_64 -> 3
        (_RET_K, 0, 0, _KILL),                      # 2: i386 entry: kill
        (_LD_W_ABS, 0, 0, 0),                       # 3: A = syscall nr
        (_JGE_K, 10, 0, _X32_BIT),                  # 4: x32 numbering -> 15 (kill)
        (_JEQ_K, 4, 0, _NR["clone"]),               # 5: -> 10
        (_JEQ_K, 3, 0, _NR["unshare"]),             # 6: -> 10
        (_JEQ_K, 5, 0, _NR["setns"]),               # 7: -> 13
        (_JEQ_K, 5, 0, _NR["clone3"]),              # 8: -> 14
        (_RET_K, 0, 0, _ALLOW),                     # 9
        (_LD_W_ABS, 0, 0, 16),                      # 10: A = low word of args[0] (flags)
        (_JSET_K, 1, 0, _CLONE_NEWUSER),            # 11: -> 13
        (_RET_K, 0, 0, _ALLOW),                     # 12
        (_RET_K, 0, 0, _ERRNO | _EPERM),            # 13
        (_RET_K, 0, 0, _ERRNO | _ENOSYS),           # 14
        (_RET_K, 0, 0, _KILL),                      # 15
    ]
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


_path: str | None = None


def filter_path() -> str | None:
    """A file holding the filter (written once per process), or None where it does not apply."""
    global _path
    if platform.machine() != "x86_64":
        return None
    if _path is None or not os.path.exists(_path):
        fd, path = tempfile.mkstemp(prefix="gyre-seccomp-", suffix=".bpf")
        with os.fdopen(fd, "wb") as f:
            f.write(_program())
        os.chmod(path, 0o644)
        atexit.register(_remove, path)
        _path = path
    return _path


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
