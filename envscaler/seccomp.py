"""The seccomp policy of sandboxed processes, built with libseccomp (through ``pyseccomp``).

One policy, applied as classic BPF (:func:`seccomp_bpf`): given to bubblewrap's ``--seccomp FD``, or
loaded by a process into itself (:class:`LoadableProgram`), which is how a forked child confines
itself, and how a process that the sandbox lets fork (a check zygote) takes new processes away from
each child before the child runs untrusted code. Filters stack: a child's filter adds to its
parent's, and nothing can remove one.

What every policy refuses:

- new namespaces (``unshare``, ``setns``, and ``clone`` with any ``CLONE_NEW*`` flag) with EPERM:
  code must not make a user namespace and hold capabilities in it;
- ``clone3`` with ENOSYS, so that the C library falls back to ``clone``, whose flags a filter can read
  (``clone3`` passes them in memory);
- the ioctls that push input into a terminal (TIOCSTI, TIOCLINUX) with EPERM, which lets a sandbox
  share its caller's terminal and process group;
- system calls of another ABI (32-bit, x32) with EPERM.

Unless ``new_processes``: fork, vfork and ``clone`` without ``CLONE_THREAD`` (a new process rather
than a thread) with EPERM; threads still work. Unless ``memfd``: ``memfd_create`` with EPERM (memory
that no address-space limit counts). Unless ``others``: every system call that acts on another process
(signals, ptrace, another's memory) with EPERM: a check's process shares its user with its zygote and
with the processes of other validations, which it must not end or read (its own time limit comes from a
timer, not a signal it sends).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
from collections.abc import Callable
from typing import Any

# clone's flags that make a new namespace (CLONE_NEWTIME, CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS,
# CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET).
_CLONE_NEW_NAMESPACES = (0x80, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
_CLONE_THREAD = 0x00010000
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C
# ioctl's request is an unsigned int: the kernel ignores the upper half of the register, so must the filter.
_LOW_HALF = 0xFFFFFFFF
INSTALL = ("libseccomp cannot be loaded, so no sandbox can be built: install libseccomp "
           "(Debian/Ubuntu: apt-get install libseccomp2) and its binding (pip install pyseccomp)")


def seccomp_problem() -> str | None:
    """Why no seccomp policy can be built here (what to install), or None when one can."""
    try:
        _library()
    except OSError as e:
        return str(e)
    return None


# What acts on another process: its signals, its tracing, its memory.
_ON_OTHERS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_send_signal", "pidfd_getfd", "ptrace",
              "process_vm_readv", "process_vm_writev")


def seccomp_policy(*, new_processes: bool = False, memfd: bool = True, others: bool = True) -> Any:
    """The policy (see the module's doc) as a ``pyseccomp.SyscallFilter``: ``.load()`` applies it to the
    calling process (every thread of it) and to all it starts. Raises OSError when libseccomp is missing."""
    seccomp = _library()
    deny = seccomp.ERRNO(errno.EPERM)
    policy = seccomp.SyscallFilter(seccomp.ALLOW)
    policy.set_attr(seccomp.Attr.ACT_BADARCH, deny)
    policy.set_attr(seccomp.Attr.CTL_TSYNC, 1)
    native = seccomp.Arch.NATIVE
    refused = ["unshare", "setns", *(() if memfd else ("memfd_create",)), *(() if new_processes else ("fork", "vfork")),
               *(() if others else _ON_OTHERS)]
    for name in refused:
        if seccomp.resolve_syscall(native, name) >= 0:  # fork and vfork do not exist everywhere (aarch64)
            policy.add_rule(deny, name)
    policy.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NEW_NAMESPACES:
        policy.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    if not new_processes:
        policy.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_THREAD, 0))
    for request in (_TIOCSTI, _TIOCLINUX):
        policy.add_rule(deny, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, _LOW_HALF, request))
    return policy


@functools.cache
def seccomp_bpf(*, new_processes: bool = False, memfd: bool = True, others: bool = True) -> bytes:
    """The policy as classic BPF, as bubblewrap's ``--seccomp FD`` reads it (and :class:`LoadableProgram`).
    Raises OSError when libseccomp is missing."""
    # Through a pipe, not a memfd: a check zygote builds its children's program inside a sandbox that may refuse
    # memfds. The program (a few hundred instructions) fits in the pipe's buffer, so writing it all first cannot block.
    read_end, write_end = os.pipe()
    with open(read_end, "rb") as program:
        with open(write_end, "wb") as sink:
            seccomp_policy(new_processes=new_processes, memfd=memfd, others=others).export_bpf(sink)
        return program.read()


_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


class LoadableProgram:
    """A classic BPF program (:func:`seccomp_bpf`'s) laid out in memory as the kernel takes it, so that
    loading it is two system calls: made once before a process forks, loaded by each child (a check
    zygote's), where a policy's ``.load()`` builds the program again in every one (about 50 pages
    written, a third of a millisecond). ``prctl`` is the C library's, looked up already: a forked child
    of a threaded process must not take the loader's lock."""

    def __init__(self, program: bytes, prctl: Callable[..., int]) -> None:
        self._instructions = ctypes.create_string_buffer(program, len(program))
        self._fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxP", len(program) // 8, ctypes.addressof(self._instructions)))
        self._prctl = prctl

    def load(self) -> None:
        """Apply the program to the calling thread and to all it starts (in a process of one thread, the
        whole process), after taking away new privileges, which loading it asks for. Raises OSError when
        the kernel refuses."""
        for arguments, what in (((_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "taking away new privileges"),
                                ((_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, self._fprog, 0, 0), "loading the seccomp filter")):
            if self._prctl(*arguments) != 0:
                number = ctypes.get_errno()
                raise OSError(number, f"{what}: {os.strerror(number)}")


@functools.cache
def _library() -> Any:
    # Imported on first use: pyseccomp loads libseccomp when imported, and fails there when it is missing.
    try:
        import pyseccomp
    except (ImportError, RuntimeError, OSError) as e:
        raise OSError(f"{INSTALL} ({e})") from None
    return pyseccomp
