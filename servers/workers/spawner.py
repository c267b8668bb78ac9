"""A server's spawner: a process that has imported the workers' code and forks each worker from it.

A worker started as a fresh interpreter holds about 25 MB of its own (the imports); one forked from
a process that has them already shares those pages copy-on-write and starts in milliseconds. The
spawner is that process: it holds nothing secret (it is forked from the farm's zygote before the
server learns its token, or started as an interpreter of its own with a clean environment), so what
it forks holds nothing secret either. Each worker it forks confines itself before it runs anything
of the environment's (``envscaler.confine``: the sandbox that bubblewrap would have made), and joins
its control group first.

It is a forking process (``servers.forking``): the server sends a :class:`ForkRequest` with the
worker's channel, the write end of its output pipe and the descriptors it must have (its socket
first), and gets a :class:`SpawnedWorker`, which stands in for a ``subprocess.Popen``.

``python -m servers.workers.spawner CONTROL_FD`` runs one; a server finds its own with :func:`spawner`.
"""

from __future__ import annotations

import fcntl
import functools
import gc
import importlib
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import NoReturn

from pydantic import BaseModel

from envscaler.confine import HAND_OVER_TIMEOUT_S, become_subreaper, confine, taken_over
from envscaler.sandbox import SandboxPlan, clean_environment, die_with_parent, name_process
from envscaler.seccomp import seccomp_bpf, seccomp_problem
from servers.forking import MESSAGE_BYTES, ExitReport, Forked, SpawnReply, exit_with, fork_available, refuse, reply, serve_forks

# What every worker runs, imported before the first fork.
PRELOAD = ("servers.workers.env_worker", "servers.workers.check_worker")
# The channel, the output pipe's write end, then up to this many descriptors the worker must have.
_MAX_FDS = 2 + 4
_SPAWN_TIMEOUT_S = 30.0


class ForkRequest(BaseModel):
    """Fork a worker that runs ``python -m module FD`` without the interpreter's start-up.

    The descriptors that come after the channel and the output pipe go at ``fds`` (the worker's socket
    first: its number is the module's FD). ``groups``: the control-group files it writes itself into
    first. ``sandbox``: the sandbox it confines itself in, under the seccomp policy that
    ``new_processes`` and ``memfd`` say. ``environment``: its environment variables, all of them.
    """

    module: str
    fds: list[int]
    groups: list[str] = []
    sandbox: SandboxPlan | None = None
    new_processes: bool = False
    memfd: bool = True
    environment: dict[str, str] = {}


class SpawnError(OSError):
    """The spawner could not fork the worker (it died with the request in hand, or fork() failed in it)."""


class SpawnedWorker:
    """A worker the spawner forked, as much of a ``subprocess.Popen`` as a server uses: ``pid``,
    ``stdout`` (its output, stdout and stderr together), ``poll``, ``wait`` and ``kill``.

    Its pid is the spawner's child: where it is sandboxed, the first process of the sandbox's PID
    namespace, which the spawner adopted, and killing it kills all inside (``envscaler.confine``)."""

    def __init__(self, pid: int, pidfd: int, channel: socket.socket, stdout: int) -> None:
        self.pid = pid
        self._pidfd: int | None = pidfd
        self._channel = channel
        self.stdout = os.fdopen(stdout, "rb", buffering=0)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit status if it has ended and been reaped, else None."""
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status (Popen's convention), once the spawner has reaped it; TimeoutExpired after ``timeout``."""
        if self.returncode is not None:
            return self.returncode
        if not select.select([self._channel], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0)
        try:
            data = self._channel.recv(MESSAGE_BYTES)
        except OSError:
            data = b""
        if data:
            self.returncode = ExitReport.model_validate_json(data).status
        else:
            # The spawner died before it reaped the worker; PDEATHSIG kills the worker: wait until it is gone.
            if self._pidfd is not None:
                select.select([self._pidfd], [], [], timeout)
            self.returncode = -signal.SIGKILL
        self._close()
        return self.returncode

    def kill(self) -> None:
        """SIGKILL it (through its pidfd: its pid may be another's once it has been reaped)."""
        if self._pidfd is not None and self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _close(self) -> None:
        self._channel.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class Spawner:
    """This server's side of its spawner's control socket: ``process`` when it runs as an interpreter of
    its own, else ``pid``, a child forked from this process."""

    def __init__(self, control: socket.socket, process: subprocess.Popen[bytes] | None = None, pid: int | None = None) -> None:
        self.control = control
        self.process = process
        self.pid = pid
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        """Whether it still runs (a forked one is reaped here once it has ended)."""
        if self.process is not None:
            return self.process.poll() is None
        try:
            return self.pid is not None and os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

    def spawn(self, request: ForkRequest, fds: list[int]) -> SpawnedWorker:
        """Fork a worker (``fds``: the descriptors that go at ``request.fds``, in order). Blocks for the fork only."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        output, output_end = os.pipe()
        try:
            with self._lock:
                try:
                    socket.send_fds(self.control, [request.model_dump_json().encode()], [theirs.fileno(), output_end, *fds])
                except OSError as e:
                    raise SpawnError(f"the spawner is gone ({e})") from None
            ours.settimeout(_SPAWN_TIMEOUT_S)
            try:
                data, received, _, _ = socket.recv_fds(ours, MESSAGE_BYTES, 1)
            except OSError as e:
                raise SpawnError(f"the spawner did not answer ({e})") from None
        except BaseException:
            ours.close()
            os.close(output)
            raise
        finally:
            theirs.close()
            os.close(output_end)
        answer = SpawnReply.model_validate_json(data) if data else SpawnReply(error="the spawner stopped with the request in hand")
        if answer.pid is None or len(received) != 1:
            for fd in received:
                os.close(fd)
            ours.close()
            os.close(output)
            raise SpawnError(f"the spawner could not fork the worker: {answer.error}")
        ours.setblocking(True)
        return SpawnedWorker(answer.pid, received[0], ours, output)


_SPAWNER: Spawner | None = None


def spawner() -> Spawner | None:
    """This process's spawner: the one forked for it at its start (:func:`fork_spawner`), else (or once that
    one has ended) one started now as an interpreter of its own; None where this platform cannot fork one."""
    global _SPAWNER
    if _SPAWNER is None or not _SPAWNER.alive:
        if not fork_available():
            return None
        control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            process = subprocess.Popen([sys.executable, "-m", "servers.workers.spawner", str(theirs.fileno())],
                                       pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=clean_environment(),
                                       preexec_fn=functools.partial(die_with_parent, signal.SIGKILL))
        _SPAWNER = Spawner(control, process)
    return _SPAWNER


def fork_spawner() -> None:
    """Fork this process's spawner now, while it holds nothing secret (a server forked from the farm's
    zygote, before it reads its environment): it shares the zygote's imports, the workers' among them.
    The spawner keeps stdout and stderr; every other descriptor of this process is closed in it."""
    global _SPAWNER
    control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            control.close()
            keep = fcntl.fcntl(theirs.fileno(), fcntl.F_DUPFD_CLOEXEC, 3)
            os.closerange(3, keep)
            os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
            _serve(socket.socket(fileno=keep), parent=os.getppid())
        finally:
            os._exit(0)
    theirs.close()
    _SPAWNER = Spawner(control, pid=pid)


def _serve(control: socket.socket, parent: int) -> None:
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        return  # the server died before PDEATHSIG was armed
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)  # sent to the server's group: the server stops us by going
    name_process("spawner")
    become_subreaper()  # each sandboxed worker is handed over to this process (envscaler.confine)
    for module in PRELOAD:
        importlib.import_module(module)
    if seccomp_problem() is None:
        for new_processes in (False, True):
            for memfd in (False, True):
                seccomp_bpf(new_processes=new_processes, memfd=memfd)
    gc.freeze()  # what the imports built moves out of the collector's reach: its pages stay shared
    serve_forks(control, _fork_worker, _MAX_FDS)


def _fork_worker(data: bytes, fds: list[int]) -> Forked | None:
    if len(fds) < 2:
        for fd in fds:
            os.close(fd)
        return None
    channel = socket.socket(fileno=fds[0])
    passed = fds[1:]
    handed = hand_over = None
    try:
        request = ForkRequest.model_validate_json(data)
        if len(request.fds) != len(passed) - 1:
            raise ValueError(f"the request places {len(request.fds)} descriptors and {len(passed) - 1} came with it")
        if request.sandbox is not None:
            handed, hand_over = os.pipe()
        pid = os.fork()
        if pid == 0:
            _become_worker(request, passed[0], passed[1:], hand_over)
    except Exception as e:
        if handed is not None:
            os.close(handed)
        refuse(channel, e)
        return None
    finally:
        for fd in [*passed, *([] if hand_over is None else [hand_over])]:
            os.close(fd)
    if handed is None:
        return reply(channel, pid)
    try:
        sandbox = taken_over(pid, handed, HAND_OVER_TIMEOUT_S)
    finally:
        os.close(handed)
    # Without a sandbox handed over, the child failed before it forked one: its exit says how.
    return reply(channel, pid) if sandbox is None else reply(channel, sandbox, handed_by=pid)


def _become_worker(request: ForkRequest, output: int, fds: list[int], hand_over: int | None) -> NoReturn:
    """In the forked child: take the descriptors, join the control groups, confine (handing the sandbox over
    on ``hand_over``, ``envscaler.confine``), run the worker. Never returns."""

    def run() -> int:
        die_with_parent(signal.SIGKILL)
        name_process(worker_name(request.module))
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        # Out of the way first: a descriptor passed may sit where another must go.
        above = max(16, *fds, *request.fds, hand_over or 0) + 1
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]
        handing = None if hand_over is None else fcntl.fcntl(hand_over, fcntl.F_DUPFD_CLOEXEC, above)
        for fd, target in zip(moved, request.fds):
            os.dup2(fd, target, inheritable=False)
        _close_all_but([*request.fds, *([] if handing is None else [handing])])
        for procs in request.groups:
            descriptor = os.open(procs, os.O_WRONLY)
            try:
                os.write(descriptor, b"0")
            finally:
                os.close(descriptor)
        if request.sandbox is not None and handing is not None:
            confine(request.sandbox, seccomp_bpf(new_processes=request.new_processes, memfd=request.memfd), handing)
        # After a fork, Python keeps the parent's thread id as the main thread's (3.11): the worker tells its
        # own threads from those environment code starts by it.
        threading.main_thread()._set_native_id()  # type: ignore[attr-defined]
        os.environ.clear()
        os.environ.update(request.environment)
        random.seed()
        return importlib.import_module(request.module).main([str(request.fds[0])])

    exit_with(run)


def worker_name(module: str) -> str:
    """What ``ps`` calls a worker that runs ``module``: ``env-worker``, ``check-worker``."""
    return module.rsplit(".", 1)[-1].replace("_", "-")


def _close_all_but(keep: list[int]) -> None:
    """Close every descriptor from 3 up but ``keep``: the spawner's, its other workers' and the server's."""
    low = 3
    for fd in sorted(set(keep)):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m servers.workers.spawner CONTROL_FD`` (started by a server, not by hand)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m servers.workers.spawner CONTROL_FD  (started by an environment server, not by hand)", file=sys.stderr)
        return 2
    _serve(socket.socket(fileno=int(args[0])), parent=os.getppid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
