"""The sandbox of ``envscaler.sandbox``, made by a forked child around itself instead of by bubblewrap.

A worker forked from a process that has imported everything shares those pages with its siblings;
one started through bubblewrap is a fresh interpreter, about 25 MB of its own. So a forked child
confines itself the way bubblewrap confines what it starts (and as browsers' and nsjail's children
do): the same :class:`~envscaler.sandbox.SandboxPlan`, the same seccomp program, the same user.

:func:`confine` runs in a single-threaded child, as root or not:

1. as root: the paths to show are bound at the staging place and the child becomes a user of its own
   (``envscaler.sandbox.become_unprivileged``), so no step below is root's on the host;
2. new user, mount, PID, network, IPC and UTS namespaces, the user mapped to itself;
3. a fork: the new process is the first of the new PID namespace (killing it kills all in there). The
   child hands it over to its own parent and exits: it writes the new process's pid to a pipe the
   parent gave it, and the parent, a child subreaper (:func:`become_subreaper`), adopts the new process
   when the child ends (:func:`taken_over`). No process stays outside to watch the sandbox: a monitor,
   bubblewrap's kind, would be a copy of this Python process, and hold about 2 MB of pages of its own;
4. in the new process, once adopted: it dies with its new parent; the plan's file system built under a
   new root, which replaces the old one (``pivot_root``), the loopback up, every capability dropped, no
   new privileges, and the seccomp program loaded.

It returns in the new process, confined. The child that handed it over stays a zombie of the parent's
until the parent reaps the sandbox: the sandbox's user is numbered after that child's pid
(``envscaler.sandbox.confined_uid``), which no other process may get while the sandbox lives.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import platform
import re
import select
import signal
import socket
import struct
import time
from collections.abc import Callable, Sequence

from envscaler.sandbox import (
    Mount,
    SandboxPlan,
    become_unprivileged,
    check_libc,
    die_with_parent,
    libc,
    name_process,
    sandbox_plan,
    switched_off,
)
from envscaler.seccomp import LoadableProgram, seccomp_bpf, seccomp_problem

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND = 0x20, 0x400, 0x800, 0x1000
_MS_REC, _MS_PRIVATE, _MS_RELATIME = 0x4000, 0x40000, 0x200000
_MNT_DETACH = 2
# statvfs's flags of a mount, and mount(2)'s: a bind mount made in a user namespace keeps those it
# came with (the kernel locks them), so remounting it read-only must repeat them.
_KEPT_FLAGS = ((os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV), (os.ST_NOEXEC, _MS_NOEXEC),
               (os.ST_NOATIME, _MS_NOATIME), (os.ST_NODIRATIME, _MS_NODIRATIME), (os.ST_RELATIME, _MS_RELATIME))
_PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 4, 24, 38, 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_CAPSET = {"x86_64": 126, "aarch64": 91}
# Where the new root is assembled: a tmpfs over /tmp, which becomes the root for a while, so that the
# old root (with the staged paths under its /tmp, where the caller is root) is at /oldroot.
_BASE = "/tmp"
_OLD = "/oldroot"
_NEW = "/newroot"


HANDED_OVER_NAME = "sandbox-uid"
"""What ``ps`` calls the zombie that holds a sandbox's pid (and so its uid) once it has handed the sandbox over."""
HAND_OVER_TIMEOUT_S = 10.0
"""How long a parent waits for its child to hand over the sandbox (the steps before are the kernel's: milliseconds)."""
_PR_SET_CHILD_SUBREAPER = 36
_PID = struct.Struct("=i")


@functools.cache
def confine_problem() -> str | None:
    """Why a forked worker cannot confine itself here (what failed, or what turned it off), or None when
    it can: a child forked now tries, with nothing to show but Python. Once per process; call it while
    the process has one thread (a forked child of a threaded one must not need a lock another thread held)."""
    problem = switched_off() or seccomp_problem()
    if problem is not None:
        return problem
    if platform.machine() not in _PIVOT_ROOT or not hasattr(os, "fork"):
        return f"a forked child cannot confine itself on {platform.system()} {platform.machine()}"
    code, said = run_confined(sandbox_plan(readable=()), seccomp_bpf(), str)
    if code == 0:
        return None
    return f"a forked worker cannot confine itself here: {said or f'exit status {code}'}"


def run_confined(plan: SandboxPlan, seccomp_program: bytes, probe: Callable[[], str]) -> tuple[int, str]:
    """Run ``probe`` in a child forked now and confined in ``plan``: its exit status, and what ``probe``
    returned (status 0) or the error that stopped it (status 1). Call it while the process has one thread.

    The sandbox is adopted by a child forked for that (a subreaper), never by this process, which may
    have other descendants to leave alone."""
    told, tell = os.pipe()
    adopter = os.fork()
    if adopter == 0:
        code = 1
        try:
            os.close(told)
            code = _adopt_and_wait(plan, seccomp_program, probe, tell)
        finally:
            os._exit(code)
    os.close(tell)
    with os.fdopen(told, "rb") as said:
        text = said.read().decode(errors="replace")
    return os.waitstatus_to_exitcode(os.waitpid(adopter, 0)[1]), text


def _adopt_and_wait(plan: SandboxPlan, seccomp_program: bytes, probe: Callable[[], str], tell: int) -> int:
    """In :func:`run_confined`'s child: fork the child that confines ``probe``, adopt the sandbox, return its exit status."""
    become_subreaper()
    handed, hand_over = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(handed)
            try:
                confine(plan, seccomp_program, hand_over)
                said, code = probe(), 0
            except BaseException as e:  # noqa: BLE001 - whatever stopped it is what the caller is told
                said = str(e)
            os.write(tell, said.encode())
        finally:
            os._exit(code)
    os.close(hand_over)
    os.close(tell)
    sandbox = taken_over(pid, handed, HAND_OVER_TIMEOUT_S)
    os.close(handed)
    code = os.waitstatus_to_exitcode(os.waitpid(sandbox or pid, 0)[1])
    if sandbox is not None:
        os.waitpid(pid, 0)
    return code


def become_subreaper() -> None:
    """Adopt the orphans of this process's descendants (PR_SET_CHILD_SUBREAPER): the sandboxes its children
    hand over (:func:`confine`) become its own children, to wait for and reap."""
    check_libc(libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "becoming a child subreaper")


def taken_over(child: int, handed: int, timeout_s: float) -> int | None:
    """In a subreaper that forked ``child`` to confine itself: the pid of the sandbox ``child`` handed over on
    ``handed`` (the read end of the pipe it was given), adopted by now; or None when ``child`` ended, or let
    ``timeout_s`` pass, without one (it failed before it forked: it is the process to wait for).

    ``child`` is a zombie by then, and must be reaped only after the sandbox: its pid numbers the sandbox's user.
    """
    data = b""
    deadline = time.monotonic() + timeout_s
    while len(data) < _PID.size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([handed], [], [], left)[0]:
            return None
        chunk = os.read(handed, _PID.size - len(data))
        if not chunk:
            return None
        data += chunk
    # Adopted once the child has ended: the kernel hands its children on before it marks it ended.
    os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)
    return _PID.unpack(data)[0]


def confine(plan: SandboxPlan, seccomp_program: bytes, hand_over: int) -> None:
    """Confine the calling process's work (a forked child, single-threaded) in ``plan``'s sandbox under
    ``seccomp_program`` (``envscaler.seccomp.seccomp_bpf``'s): see the module's doc. The calling process
    forks the sandbox, writes its pid to ``hand_over`` (a pipe to its parent, which must be a child
    subreaper and reads it with :func:`taken_over`) and exits 0; this returns in the sandbox, adopted by
    that parent, confined. Raises OSError (the step the kernel refused) before the fork."""
    library = libc()
    if plan.view:
        parent = os.getppid()
        become_unprivileged(plan.view, plan.tasks, library)
        # Changing user cleared the signal it gets when its parent dies: armed again, or it would outlive its spawner.
        die_with_parent(signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)  # the parent died meanwhile
        # It also made the process undumpable, which gives its /proc files to root: it could not map itself.
        check_libc(library.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "owning its /proc files")
    uid, gid = os.geteuid(), os.getegid()
    check_libc(library.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS),
           "unshare (user namespaces may be turned off here)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    # For the sandbox: when this process has ended (it is adopted then), and whether its adopter still lives.
    handing, adopter = os.pidfd_open(os.getpid()), os.pidfd_open(os.getppid())
    # The C library's fork, not os.fork: Python's hooks after a fork (locks, threads, handlers) touch objects
    # all over the heap, and each page they write would be the sandbox's own; this process is single-threaded.
    pid = library.fork()
    if pid < 0:
        check_libc(pid, "fork")
    if pid != 0:
        try:
            name_process(HANDED_OVER_NAME)
            os.write(hand_over, _PID.pack(pid))  # a parent gone meanwhile: the sandbox sees that too, and ends
        finally:
            library._exit(0)
    os.close(hand_over)
    _await_adoption(handing, adopter)
    _build_root(plan.mounts, library)
    _loopback_up()
    _drop_capabilities(library)
    LoadableProgram(seccomp_program, library.prctl).load()
    os.chdir("/tmp")


def _await_adoption(handing: int, adopter: int) -> None:
    """In the sandbox: wait until the process that forked it has ended (the adopter is its parent then), and
    die with the adopter from then on; end now if the adopter has ended already. Armed before, the signal
    would come when the forking process ends: the kernel counts that as the parent's death."""
    select.select([handing], [], [])
    die_with_parent(signal.SIGKILL)
    if select.select([adopter], [], [], 0)[0]:
        os._exit(1)  # the adopter ended before the signal was armed
    os.close(handing)
    os.close(adopter)


def _build_root(mounts: Sequence[Mount], libc: ctypes.CDLL) -> None:
    """Make ``mounts`` under a new root and switch to it; the old root is gone from this namespace."""
    check_libc(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "making / private")
    check_libc(libc.mount(b"tmpfs", _BASE.encode(), b"tmpfs", _MS_NODEV | _MS_NOSUID, b"mode=0755,size=64k"), f"a tmpfs on {_BASE}")
    os.chdir(_BASE)
    os.mkdir("newroot", 0o755)
    os.mkdir("oldroot", 0o755)
    _pivot_root(".", "oldroot", libc)
    os.chdir("/")
    check_libc(libc.mount(_NEW.encode(), _NEW.encode(), None, _MS_BIND | _MS_REC, None), "binding the new root")
    for mount in mounts:
        _make(mount, libc)
    check_libc(libc.umount2(_OLD.encode(), _MNT_DETACH), "detaching the old root")
    os.chdir(_NEW)
    _pivot_root(".", ".", libc)
    check_libc(libc.umount2(b".", _MNT_DETACH), "detaching the assembly root")
    os.chdir("/")


def _make(mount: Mount, libc: ctypes.CDLL) -> None:
    target = _NEW + mount.target
    source = _in_old_root(mount.source)
    if mount.kind == "proc":
        os.makedirs(target, exist_ok=True)
        check_libc(libc.mount(b"proc", target.encode(), b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None), "mounting /proc")
    elif mount.kind == "tmpfs":
        os.makedirs(target, exist_ok=True)
        options = f"mode=0755,size={mount.size}" if mount.size else "mode=0755"
        check_libc(libc.mount(b"tmpfs", target.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode()), f"a tmpfs on {mount.target}")
    elif mount.kind == "symlink":
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(mount.source, target)
    elif mount.kind == "remount-ro":
        _remount(target, libc, read_only=True, recursive=False)
    elif mount.kind in ("ro-bind", "ro-bind-try", "dev-bind"):
        if not os.path.exists(source):
            if mount.kind == "ro-bind-try":
                return
            raise OSError(2, f"{mount.source}, to show at {mount.target}, does not exist")
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        check_libc(libc.mount(source.encode(), target.encode(), None, _MS_BIND | _MS_REC, None), f"binding {mount.source}")
        devices = mount.kind == "dev-bind"
        _remount(target, libc, read_only=not devices, recursive=True, devices=devices)
    else:
        raise ValueError(f"unknown mount kind {mount.kind!r}")


def _in_old_root(path: str) -> str:
    """Where ``path`` of the old root is now, its symbolic links followed there (an absolute link, such as
    /etc/localtime's, would otherwise be followed from the assembly root)."""
    place = _OLD + path
    for _ in range(40):  # the kernel's own limit on links followed
        if not os.path.islink(place):
            break
        link = os.readlink(place)
        place = _OLD + link if link.startswith("/") else os.path.join(os.path.dirname(place), link)
    return place


def _remount(target: str, libc: ctypes.CDLL, *, read_only: bool, recursive: bool, devices: bool = False) -> None:
    """Remount ``target`` (and, ``recursive``, every mount below it, which a bind does not change) with no
    setuid programs, no devices unless ``devices``, read-only if asked, and the flags it is locked with."""
    for path in [target, *(_mounts_below(target) if recursive else [])]:
        kept = _MS_NOSUID | (0 if devices else _MS_NODEV) | (_MS_RDONLY if read_only else 0)
        flags = os.statvfs(path).f_flag
        for statvfs_flag, mount_flag in _KEPT_FLAGS:
            if flags & statvfs_flag:
                kept |= mount_flag
        check_libc(libc.mount(None, path.encode(), None, _MS_REMOUNT | _MS_BIND | kept, None), f"making {path} read-only")


def _mounts_below(target: str) -> list[str]:
    below = []
    # While the root is assembled, the new /proc (the plan's first mount) is under it, and the old one under the old root.
    proc = _NEW + "/proc" if os.path.exists(_NEW + "/proc/self") else _OLD + "/proc"
    with open(f"{proc}/self/mountinfo", encoding="utf-8") as mountinfo:
        for line in mountinfo:
            point = re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), line.split(" ")[4])  # \040: a space
            if point.startswith(target.rstrip("/") + "/"):
                below.append(point)
    return below


def _loopback_up() -> None:
    """Bring up the new network namespace's loopback, its only interface: code may serve itself, as it
    can in bubblewrap's sandbox, and reach nothing else."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    """No capability left, none to regain: the bounding set emptied, then the process's own sets."""
    with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as last:  # the new root's /proc
        last_cap = int(last.read())
    for capability in range(last_cap + 1):
        check_libc(libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0), f"dropping capability {capability}")
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = ctypes.create_string_buffer(struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0))
    data = ctypes.create_string_buffer(struct.calcsize("III") * 2)  # zero: effective, permitted, inheritable
    check_libc(libc.syscall(_syscall_number(_CAPSET), header, data), "dropping capabilities")
    check_libc(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")


def _pivot_root(new_root: str, put_old: str, libc: ctypes.CDLL) -> None:
    check_libc(libc.syscall(_syscall_number(_PIVOT_ROOT), new_root.encode(), put_old.encode()), f"pivot_root({new_root}, {put_old})")


def _syscall_number(numbers: dict[str, int]) -> int:
    machine = platform.machine()
    if machine not in numbers:
        raise OSError(38, f"a forked child cannot confine itself on {machine}")
    return numbers[machine]


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
