"""Run untrusted work in a child Python process with resource limits and no inherited secrets.

Where bubblewrap (``bwrap``) works, the child also runs in a sandbox (:func:`sandboxed`): new
network, PID, IPC and UTS namespaces (the network has only its own loopback: nothing of the host's
can be reached), a read-only filesystem that holds Python, this project's packages and the paths
the caller names (a bundle), a private ``/tmp`` of bounded size, no capabilities, no new privileges,
and a seccomp filter (``envscaler.seccomp``) that refuses every new process (fork, vfork, clone
without ``CLONE_THREAD``) and namespace: threads still work, a fork bomb does not. ``ENVSCALER_SANDBOX=off`` turns it off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
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
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_DUMPABLE = 4

log = logging.getLogger("envscaler.sandbox")

SANDBOX_VARIABLE = "ENVSCALER_SANDBOX"
UNPROTECTED = ("environment code runs without a sandbox: unless a container holds it, it can read every file this "
               "user can (a farm's catalog, with every token, included), connect to local services and start processes")
# The private /tmp of a sandboxed process: tmpfs is memory that no address-space limit counts.
TMPFS_BYTES = 64 * 1024 * 1024
# Top-level packages of this project that sandboxed code imports, wherever they are installed.
_PROJECT_PACKAGES = ("envscaler", "servers", "synth", "agent_client")
_HOST_FILES = ("/etc/ld.so.cache", "/etc/localtime")


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


def start_module(
    module: str, args: list[str], *, memory_mb: int, cpu_s: int, stderr: Any, readable: Sequence[str | Path] = ()
) -> subprocess.Popen[bytes]:
    """``python -m module args`` started in a limited child, sandboxed where possible (``readable``: the
    paths it reads), its stdout a pipe for the caller to read."""
    with _maybe_sandboxed([sys.executable, "-m", module, *args], readable) as (argv, fds):
        return subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            env=clean_environment(),
            pass_fds=fds,
            preexec_fn=lambda: limit_resources(memory_mb, cpu_s),
        )


def run_module(
    module: str, args: list[str], *, timeout_s: float, memory_mb: int = 2048, readable: Sequence[str | Path] = ()
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` in a limited child, sandboxed where possible (``readable``: the paths it
    reads); TimeoutExpired when it runs past ``timeout_s``."""
    with _maybe_sandboxed([sys.executable, "-m", module, *args], readable) as (argv, fds):
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=clean_environment(),
            pass_fds=fds,
            preexec_fn=lambda: limit_resources(memory_mb, int(timeout_s) + 1),
            stdin=subprocess.DEVNULL,
        )


@contextlib.contextmanager
def _maybe_sandboxed(command: list[str], readable: Sequence[str | Path]) -> Iterator[tuple[list[str], tuple[int, ...]]]:
    problem = sandbox_problem()
    if problem is not None:
        warn_unprotected(problem)
        yield command, ()
        return
    with sandboxed(command, readable=readable) as wrapped:
        yield wrapped


def sandbox_problem() -> str | None:
    """Why processes cannot be sandboxed here (what to install, or what failed), or None when they can."""
    if os.environ.get(SANDBOX_VARIABLE, "").lower() in ("off", "0", "no", "false"):
        return f"{SANDBOX_VARIABLE}={os.environ[SANDBOX_VARIABLE]} turned it off"
    return _bwrap_problem()


@functools.cache
def _bwrap_problem() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    problem = seccomp_problem()
    if problem is not None:
        return problem
    try:
        with sandboxed(["true"], readable=()) as (argv, fds):
            done = subprocess.run(argv, pass_fds=fds, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap could not run: {e}"
    if done.returncode != 0:
        return f"bwrap cannot make a sandbox here: {done.stderr.strip() or f'exit {done.returncode}'}"
    return None


@functools.cache
def warn_unprotected(problem: str) -> None:
    """Log, once per process, that environment code runs unsandboxed and why."""
    log.warning(f"{UNPROTECTED} ({problem})")


@contextlib.contextmanager
def sandboxed(command: Sequence[str], *, readable: Sequence[str | Path],
              new_processes: bool = False) -> Iterator[tuple[list[str], tuple[int, ...]]]:
    """``command`` wrapped in a bubblewrap sandbox: (argv, fds the child must inherit).

    The fds (the seccomp program, which bwrap reads at start) are closed when the block ends: start
    the child inside it. ``readable`` paths are visible read-only at the same place; so are Python and
    this project's packages (without the bundled catalog, unless it is named). ``new_processes`` lets
    the command fork (``envscaler.seccomp``): only for a command that runs no untrusted code itself and
    loads ``seccomp_policy()`` into each child before the child runs any.
    """
    seccomp = os.memfd_create("envscaler-seccomp", 0)
    try:
        os.write(seccomp, seccomp_bpf(new_processes=new_processes))
        os.lseek(seccomp, 0, os.SEEK_SET)
        argv = ["bwrap", "--unshare-all", "--die-with-parent", "--cap-drop", "ALL"]
        argv += _filesystem([Path(p) for p in readable])
        argv += ["--setenv", "TMPDIR", "/tmp", "--setenv", "HOME", "/tmp", "--chdir", "/tmp", "--seccomp", str(seccomp), "--", *command]
        yield argv, (seccomp,)
    finally:
        os.close(seccomp)


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


def _filesystem(readable: list[Path]) -> list[str]:
    # /tmp first: Python or a bundle may live under the host's /tmp, and binds made before would be hidden.
    args = ["--proc", "/proc", "--dev", "/dev", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp"]
    for top in ("/usr", "/bin", "/lib", "/lib64", "/sbin"):
        path = Path(top)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), top]
        elif path.is_dir():
            args += ["--ro-bind", top, top]
    for file in _HOST_FILES:
        args += ["--ro-bind-try", file, file]
    python = [Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable).resolve().parent]
    packages = [_package_dir(name) for name in _PROJECT_PACKAGES]
    needed = sorted({path.resolve() for path in python + [p for p in packages if p is not None]})
    for path in needed:
        inside_another = any(other != path and path.is_relative_to(other) for other in needed)
        if not inside_another and not path.is_relative_to("/usr"):
            args += ["--ro-bind", str(path), str(path)]
    catalog = Path(__file__).resolve().parent / "catalog"
    if catalog.is_dir():
        args += ["--tmpfs", str(catalog)]  # bundles are visible only when named
    for path in readable:
        resolved = str(path.resolve())
        args += ["--ro-bind", resolved, resolved]
    if catalog.is_dir():
        args += ["--remount-ro", str(catalog)]
    args += ["--remount-ro", "/"]
    return args


def _package_dir(name: str) -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()
