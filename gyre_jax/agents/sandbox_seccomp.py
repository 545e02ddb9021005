"""Seccomp filters for bubblewrap sandboxes (``bwrap --seccomp FD``): two rule sets.

* ``userns``: no user namespaces inside a root trainer's sandbox. bwrap's ``--disable-userns``
  only works together with a user namespace of bwrap's own, which, run by root, would map
  the sandbox to kernel uid 0 (RLIMIT_NPROC exempts it; see ``sandbox.bwrap_argv``). So
  ``unshare`` and ``clone`` with CLONE_NEWUSER fail with EPERM, ``setns`` fails with EPERM,
  and ``clone3`` (whose flags a filter cannot read) with ENOSYS, so libc falls back to
  ``clone``, as in Docker's default profile.
* ``shared_memory``: no memory outside the per-process rlimits, for a sandbox that has no
  cgroup to count it (``sandbox_cgroup.make_cap`` found none). RLIMIT_AS does not count the
  pages of a memfd or of a SysV shared-memory segment once unmapped: a command held 600 MiB
  in memfds past its limit. So ``memfd_create``, ``memfd_secret`` and ``shmget`` fail with
  EPERM; the tmpfs mounts a command can write (/tmp, /dev/shm, the workspace) have sizes.

x86_64 only; elsewhere ``filter_path`` returns None and the sandbox goes without (the cgroup
still caps what a namespace of its own could mount, and what shared memory holds).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import platform
import struct
import tempfile

_AUDIT_ARCH_X86_64 = 0xC000003E
_NR = {"clone": 56, "unshare": 272, "setns": 308, "clone3": 435, "memfd_create": 319, "memfd_secret": 447,
       "shmget": 29}
_CLONE_NEWUSER = 0x10000000
_EPERM, _ENOSYS = 1, 38
# BPF opcodes
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_X32_BIT = 0x40000000
_ALLOW, _ERRNO, _KILL = 0x7FFF0000, 0x00050000, 0x80000000  # SECCOMP_RET_{ALLOW,ERRNO,KILL_PROCESS}
RULE_SETS = ("userns", "shared_memory")


def _rules(sets: frozenset[str]) -> list[tuple[str, str]]:
    """(syscall, action) in the order they are tested; action: 'eperm', 'enosys' or 'eperm_if_newuser'."""
    out = []
    if "userns" in sets:
        out += [("clone", "eperm_if_newuser"), ("unshare", "eperm_if_newuser"), ("setns", "eperm"),
                ("clone3", "enosys")]
    if "shared_memory" in sets:
        out += [("memfd_create", "eperm"), ("memfd_secret", "eperm"), ("shmget", "eperm")]
    return out


def _program(sets: frozenset[str]) -> bytes:
    """Classic BPF: kill other architectures and x32, then each rule's syscall jumps to its action."""
    rules = _rules(sets)
    actions = {"eperm": (_RET_K, 0, 0, _ERRNO | _EPERM), "enosys": (_RET_K, 0, 0, _ERRNO | _ENOSYS)}
    # Layout: header (5), one JEQ per rule, ALLOW, then per rule its action block.
    head = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64), (_RET_K, 0, 0, _KILL), (_LD_W_ABS, 0, 0, 0)]
    n_checks = len(rules)
    blocks: list[list[tuple[int, int, int, int]]] = []
    for _, action in rules:
        if action == "eperm_if_newuser":  # A = low word of args[0] (the flags)
            blocks.append([(_LD_W_ABS, 0, 0, 16), (_JSET_K, 1, 0, _CLONE_NEWUSER), (_RET_K, 0, 0, _ALLOW),
                           actions["eperm"]])
        else:
            blocks.append([actions[action]])
    # index after head: 4 = the x32 check, 5.. = the rule checks, then ALLOW, then the blocks, then KILL
    first_check = len(head) + 1
    allow = first_check + n_checks
    starts, pos = [], allow + 1
    for b in blocks:
        starts.append(pos)
        pos += len(b)
    kill = pos
    ins = head + [(_JGE_K, kill - (len(head) + 1), 0, _X32_BIT)]
    for i, (name, _) in enumerate(rules):
        here = first_check + i
        ins.append((_JEQ_K, starts[i] - (here + 1), 0, _NR[name]))
    ins.append((_RET_K, 0, 0, _ALLOW))
    for b in blocks:
        ins += b
    ins.append((_RET_K, 0, 0, _KILL))
    assert len(ins) == kill + 1 and all(0 <= jt < 256 for _, jt, _, _ in ins)
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


_paths: dict[frozenset[str], str] = {}


def filter_path(*sets: str) -> str | None:
    """A file holding the filter of these rule sets (written once per process), or None where it does not
    apply (not x86_64, or no set)."""
    if platform.machine() != "x86_64" or not sets:
        return None
    key = frozenset(sets)
    unknown = key - set(RULE_SETS)
    if unknown:
        raise ValueError(f"sandbox_seccomp: unknown rule sets {sorted(unknown)}; known: {RULE_SETS}")
    path = _paths.get(key)
    if path is None or not os.path.exists(path):
        fd, path = tempfile.mkstemp(prefix="gyre-seccomp-", suffix=".bpf")
        with os.fdopen(fd, "wb") as f:
            f.write(_program(key))
        os.chmod(path, 0o644)
        atexit.register(_remove, path)
        _paths[key] = path
    return path


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
