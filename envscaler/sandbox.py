"""Run untrusted work in a child Python process with resource limits and no inherited secrets.

Where bubblewrap (``bwrap``) works, the child also runs in a sandbox (:func:`sandboxed`): new
user, network, PID, IPC and UTS namespaces (the network has only its own loopback: nothing of the
host's can be reached), a read-only filesystem that holds Python, this project's packages and the
paths the caller names (a bundle), a private ``/tmp`` and ``/dev/shm`` of bounded size, no
capabilities, no new privileges, and a seccomp filter (``envscaler.seccomp``) that refuses every new
process (fork, vfork, clone without ``CLONE_THREAD``) and namespace: threads still work, a fork bomb
does not. ``ENVSCALER_SANDBOX=off`` turns it off.

Never host root: where the caller is root, the child becomes an unprivileged user of its own
(``CONFINED_UID_BASE`` plus its pid: no other process has it, so ``RLIMIT_NPROC`` bounds its
threads) before it starts bubblewrap, and bubblewrap maps only that user into the sandbox. A kernel
knob (``/proc/sys``, ``/proc/sysrq-trigger``) belongs to the host's root, so the child cannot write
one. That user may not be able to reach what the sandbox shows (Python under ``/root``, a bundle
under a private folder), so the child, still root, first binds those paths in a mount namespace of
its own at a place it can reach (:func:`become_unprivileged`), and bubblewrap binds them from there.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from envscaler.seccomp import seccomp_bpf, seccomp_problem

# Variables a child needs to run Python and nothing else: no tokens, keys or proxies leak in.
# A farm's processes carry its id in this variable: ``farm down`` finds every one by it, descendants included.
FARM_ID_VARIABLE = "ENVSCALER_FARM_ID"
# MALLOC_ARENA_MAX: without it each thread may reserve a 64 MB arena, and a process under an
# address-space limit runs out of it with a few dozen threads.
_KEPT_ENV = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "TMPDIR", "HOME", "MALLOC_ARENA_MAX", FARM_ID_VARIABLE)
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38

log = logging.getLogger("envscaler.sandbox")

SANDBOX_VARIABLE = "ENVSCALER_SANDBOX"
UNPROTECTED = ("environment code runs without a sandbox: unless a container holds it, it can read every file this "
               "user can (a farm's catalog, with every token, included), connect to local services and start processes")
# The private /tmp of a sandboxed process: tmpfs is memory that no address-space limit counts (a memory
# cgroup does, where there is one); /dev/shm is only for what POSIX semaphores and the like need.
TMPFS_BYTES = 64 * 1024 * 1024
SHM_BYTES = 1024 * 1024
SANDBOX_ENVIRONMENT = {"TMPDIR": "/tmp", "HOME": "/tmp"}
"""What a sandboxed process's environment says of where it may write: its private /tmp."""
CONFINED_UID_BASE = 0x70000000
"""Where the caller is root, a sandboxed child runs as this uid plus its pid (the same for its gid).
pids stay below 2**22, so these ids are no one else's: the range ends below 2**31."""
# Where the child stages the paths the sandbox shows, in its own mount namespace: it always exists,
# and covering it there hides nothing bubblewrap needs (it builds its own /tmp).
_VIEW = "/tmp"
# Top-level packages of this project that sandboxed code imports, wherever they are installed.
_PROJECT_PACKAGES = ("envscaler", "servers", "synth", "agent_client")
_HOST_FILES = ("/etc/ld.so.cache", "/etc/localtime")
_DEVICES = ("null", "zero", "full", "random", "urandom")


def clean_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The parent's environment reduced to what a Python child needs, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k in _KEPT_ENV}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    return env


def limit_resources(memory_mb: int, cpu_s: int | None = None) -> None:
    """Apply limits to the current process (a ``preexec_fn``): address space, CPU, no core dumps."""
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cpu_s is not None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 5))


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``signum`` to the current process when its parent (thread) dies; Linux only.

    Usable as a ``preexec_fn``.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's own stop is all there is


def name_process(name: str) -> None:
    """Name the calling thread, the main one of a forked process included, as ``ps`` and /proc/PID/comm
    show it (Linux: at most 15 bytes); a forked process is otherwise named after its parent's command."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: ps shows the command


def adopt_orphans() -> None:
    """Make the current process the reaper of its descendants' orphans (Linux only), so that it can reap
    a killed sandbox's init itself instead of leaving a zombie for pid 1 to collect when it gets round to it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: orphans go to init, as everywhere


def make_undumpable() -> None:
    """Keep other processes of this user (an environment worker among them) from reading this process's
    memory, environment or fds through /proc or ptrace (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the worker's sandbox is all there is


CHILD_TASKS = 256
"""Threads and processes a sandboxed child may have when it runs as a user of its own (``RLIMIT_NPROC``)."""


def no_new_privileges() -> None:
    """Make this process and its children unable to gain privileges (setuid binaries, file capabilities).

    Docker sets this for the docker backend's containers; Swarm before API 1.46 cannot, so a server
    sets it on itself. Without prctl (not Linux) there is nothing to do.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def start_module(
    module: str, args: list[str], *, memory_mb: int, cpu_s: int, stderr: Any, readable: Sequence[str | Path] = ()
) -> subprocess.Popen[bytes]:
    """``python -m module args`` started in a limited child, sandboxed where possible (``readable``: the
    paths it reads), its stdout a pipe for the caller to read."""
    with _maybe_sandboxed([sys.executable, "-m", module, *args], readable) as launch:
        return subprocess.Popen(
            launch.argv,
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            env=clean_environment(),
            pass_fds=launch.fds,
            preexec_fn=lambda: (limit_resources(memory_mb, cpu_s), launch.enter()),
        )


def run_module(
    module: str, args: list[str], *, timeout_s: float, memory_mb: int = 2048, readable: Sequence[str | Path] = ()
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` in a limited child, sandboxed where possible (``readable``: the paths it
    reads); TimeoutExpired when it runs past ``timeout_s``."""
    with _maybe_sandboxed([sys.executable, "-m", module, *args], readable) as launch:
        return subprocess.run(
            launch.argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=clean_environment(),
            pass_fds=launch.fds,
            preexec_fn=lambda: (limit_resources(memory_mb, int(timeout_s) + 1), launch.enter()),
            stdin=subprocess.DEVNULL,
        )


def _stay() -> None:
    """Nothing to do between fork and exec: the child keeps this process's user."""


@dataclasses.dataclass
class Launch:
    """How to start a command, sandboxed or not: its argv, the fds it must inherit, and ``enter``, which
    the child runs on itself between fork and exec (last: it may give up root)."""

    argv: list[str]
    fds: tuple[int, ...] = ()
    enter: Callable[[], None] = _stay


@contextlib.contextmanager
def _maybe_sandboxed(command: list[str], readable: Sequence[str | Path]) -> Iterator[Launch]:
    problem = sandbox_problem()
    if problem is not None:
        warn_unprotected(problem)
        yield Launch(command)
        return
    # No cgroup counts a gate's or a probe's memory: what only a cgroup could count is refused.
    with sandboxed(command, readable=readable, memfd=False) as launch:
        yield launch


def sandbox_problem() -> str | None:
    """Why processes cannot be sandboxed here (what to install, or what failed), or None when they can."""
    return switched_off() or _bwrap_problem()


def switched_off() -> str | None:
    """What says that no sandbox is wanted here (``ENVSCALER_SANDBOX=off``), or None."""
    if os.environ.get(SANDBOX_VARIABLE, "").lower() in ("off", "0", "no", "false"):
        return f"{SANDBOX_VARIABLE}={os.environ[SANDBOX_VARIABLE]} turned it off"
    return None


@functools.cache
def _bwrap_problem() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    problem = seccomp_problem()
    if problem is not None:
        return problem
    try:
        with sandboxed(["true"], readable=()) as launch:
            done = subprocess.run(launch.argv, pass_fds=launch.fds, preexec_fn=launch.enter, capture_output=True, text=True,
                                  timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"bwrap could not run: {e}"
    if done.returncode != 0:
        return f"bwrap cannot make a sandbox here: {done.stderr.strip() or f'exit {done.returncode}'}"
    return None


@functools.cache
def warn_unprotected(problem: str) -> None:
    """Log, once per process, that environment code runs unsandboxed and why."""
    log.warning(f"{UNPROTECTED} ({problem})")


@dataclasses.dataclass(frozen=True)
class Mount:
    """One step of a sandbox's file system, in order: ``kind`` is bubblewrap's option without its dashes
    (``proc``, ``tmpfs`` of ``size`` bytes, ``dev-bind``, ``ro-bind``, ``ro-bind-try``, ``symlink`` to
    ``source``, ``remount-ro``); ``source`` is a path where the sandbox is made (see :class:`SandboxPlan`)."""

    kind: str
    target: str
    source: str = ""
    size: int = 0


@dataclasses.dataclass(frozen=True)
class SandboxPlan:
    """What a sandbox holds, whichever way it is made (bubblewrap's command line, or
    ``envscaler.confine`` in a forked child): its file system, and the paths to stage first.

    ``view``: where the caller is root, the paths (and whether each is a folder) the child binds at
    ``_VIEW/<index>`` before it gives up root (see the module's doc); the ``mounts`` then take them from
    there. ``tasks``: its threads and processes as a user of its own (root callers only)."""

    mounts: tuple[Mount, ...]
    view: tuple[tuple[str, bool], ...] = ()
    tasks: int = CHILD_TASKS


def sandbox_plan(*, readable: Sequence[str | Path], placed: Mapping[str, Path] | None = None,
                 tasks: int = CHILD_TASKS) -> SandboxPlan:
    """The sandbox that shows ``readable`` paths read-only at the same place, and ``placed`` ones (place
    inside -> path here) at their place, besides Python and this project's packages (without the
    bundled catalog, unless it is named)."""
    packages = [(path, str(path)) for path in _project_paths()]
    named = [(Path(path).resolve(), str(Path(path).resolve())) for path in readable]
    named += [(Path(source), inside) for inside, source in (placed or {}).items()]
    shown = packages + named
    sources = [str(path) for path, _ in shown]
    view: tuple[tuple[str, bool], ...] = ()
    if os.geteuid() == 0:
        sources = [f"{_VIEW}/{index}" for index in range(len(shown))]
        view = tuple((str(path), path.is_dir()) for path, _ in shown)
    binds = list(zip(sources, (inside for _, inside in shown)))
    return SandboxPlan(tuple(_filesystem(binds[:len(packages)], binds[len(packages):])), view, tasks)


@contextlib.contextmanager
def sandboxed(command: Sequence[str], *, readable: Sequence[str | Path], placed: Mapping[str, Path] | None = None,
              tasks: int = CHILD_TASKS, new_processes: bool = False, memfd: bool = True) -> Iterator[Launch]:
    """``command`` wrapped in a bubblewrap sandbox (:func:`sandbox_plan`'s), as a :class:`Launch`: start
    it with the fds it names and ``enter`` as (the last step of) its ``preexec_fn``, inside this block.

    The fd (the seccomp program, which bwrap reads at start) is closed when the block ends. Where this
    process is root, ``enter`` makes the child an unprivileged user (see the module's doc) with at most
    ``tasks`` threads and processes. ``new_processes`` lets the command fork (``envscaler.seccomp``):
    only for a command that runs no untrusted code itself and loads ``seccomp_policy()`` into each child
    before the child runs any. ``memfd=False`` refuses memory files: for a child whose memory no cgroup counts.
    """
    plan = sandbox_plan(readable=readable, placed=placed, tasks=tasks)
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--cap-drop", "ALL"]
    enter: Callable[[], None] = _stay
    if plan.view:
        argv.insert(2, "--unshare-user")  # the one user it runs as, and nobody else, inside
        enter = functools.partial(become_unprivileged, plan.view, tasks, libc())
    argv += _bwrap_arguments(plan.mounts)
    seccomp = os.memfd_create("envscaler-seccomp", 0)
    try:
        os.write(seccomp, seccomp_bpf(new_processes=new_processes, memfd=memfd))
        os.lseek(seccomp, 0, os.SEEK_SET)
        for name, value in SANDBOX_ENVIRONMENT.items():
            argv += ["--setenv", name, value]
        argv += ["--chdir", "/tmp", "--seccomp", str(seccomp), "--", *command]
        yield Launch(argv, (seccomp,), enter)
    finally:
        os.close(seccomp)


def _bwrap_arguments(mounts: Sequence[Mount]) -> list[str]:
    args: list[str] = []
    for mount in mounts:
        if mount.size:
            args += ["--size", str(mount.size)]
        if mount.kind in ("proc", "tmpfs", "remount-ro"):
            args += [f"--{mount.kind}", mount.target]
        else:
            args += [f"--{mount.kind}", mount.source, mount.target]
    return args


def confined_uid(pid: int) -> int:
    """The uid (and gid) that a sandboxed child with this pid runs as when its parent is root."""
    return CONFINED_UID_BASE + pid


def process_uid(pid: int) -> int | None:
    """The host uid (the real one) that process ``pid`` runs as; None once it has gone."""
    try:
        # The process's name comes first, and is whatever bytes it chose.
        status = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, with the functions a child calls to confine itself looked up already: a forked
    child of a threaded process must not take the loader's lock."""
    library = ctypes.CDLL(None, use_errno=True)
    for name in ("unshare", "mount", "umount2", "prctl", "syscall", "fork", "waitpid", "_exit"):
        getattr(library, name)
    return library


def check_libc(result: int, what: str) -> None:
    """OSError, its errno and text after ``what``, when a call into :func:`libc` returned non-zero."""
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


_CLONE_NEWNS = 0x00020000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000


def become_unprivileged(shown: Sequence[tuple[str, bool]], tasks: int, library: ctypes.CDLL) -> None:
    """In the child, as root: bind the paths to show (``shown``: path and whether it is a folder, in
    order) at ``_VIEW/<index>`` in a mount namespace of its own, then become ``confined_uid`` with no
    supplementary groups and at most ``tasks`` threads and processes (its user has no others)."""
    check_libc(library.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check_libc(library.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "making / private")
    # Opened before the view covers them (a bundle under /tmp), in this namespace (a bind takes no other's).
    fds = [os.open(source, os.O_PATH | os.O_CLOEXEC) for source, _ in shown]
    check_libc(library.mount(b"tmpfs", _VIEW.encode(), b"tmpfs", 0, b"mode=0755,size=64k"), f"a tmpfs on {_VIEW}")
    for index, ((source, is_dir), fd) in enumerate(zip(shown, fds)):
        target = f"{_VIEW}/{index}"
        if is_dir:
            os.mkdir(target)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        check_libc(library.mount(f"/proc/self/fd/{fd}".encode(), target.encode(), None, _MS_BIND | _MS_REC, None), f"binding {source}")
        os.close(fd)
    uid = confined_uid(os.getpid())
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def innermost_process(pid: int) -> int:
    """The process that a sandbox started as ``pid`` runs (bubblewrap's innermost child), else ``pid``."""
    while True:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return pid
        if not children:
            return pid
        pid = int(children[0])


def _devices() -> list[Mount]:
    """A /dev of the few devices Python uses, and a small /dev/shm. Not bwrap's ``--dev``: its terminals
    (devpts) need a root inside the sandbox, and so a second user namespace whose parent maps that root."""
    mounts = [Mount("tmpfs", "/dev", size=64 * 1024)]
    mounts += [Mount("dev-bind", f"/dev/{device}", f"/dev/{device}") for device in _DEVICES]
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        mounts.append(Mount("symlink", f"/dev/{name}", target))
    return mounts + [Mount("tmpfs", "/dev/shm", size=SHM_BYTES)]


def _project_paths() -> list[Path]:
    """Python and this project's packages, where they are outside /usr (which is shown whole), none
    inside another."""
    python = [Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable).resolve().parent]
    packages = [_package_dir(name) for name in _PROJECT_PACKAGES]
    needed = sorted({path.resolve() for path in python + [p for p in packages if p is not None]})
    return [path for path in needed
            if not path.is_relative_to("/usr") and not any(other != path and path.is_relative_to(other) for other in needed)]


def _filesystem(packages: list[tuple[str, str]], readable: list[tuple[str, str]]) -> list[Mount]:
    """The sandbox's file system; ``packages`` and ``readable`` are (source, place inside) pairs."""
    # /tmp first: Python or a bundle may live under the host's /tmp, and binds made before would be hidden.
    mounts = [Mount("proc", "/proc"), Mount("tmpfs", "/tmp", size=TMPFS_BYTES), *_devices()]
    for top in ("/usr", "/bin", "/lib", "/lib64", "/sbin"):
        path = Path(top)
        if path.is_symlink():
            mounts.append(Mount("symlink", top, os.readlink(path)))
        elif path.is_dir():
            mounts.append(Mount("ro-bind", top, top))
    mounts += [Mount("ro-bind-try", file, file) for file in _HOST_FILES]
    mounts += [Mount("ro-bind", inside, source) for source, inside in packages]
    catalog = Path(__file__).resolve().parent / "catalog"
    if catalog.is_dir():
        mounts.append(Mount("tmpfs", str(catalog)))  # bundles are visible only when named
    mounts += [Mount("ro-bind", inside, source) for source, inside in readable]
    if catalog.is_dir():
        mounts.append(Mount("remount-ro", str(catalog)))
    return mounts + [Mount("remount-ro", "/")]


def _package_dir(name: str) -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()
