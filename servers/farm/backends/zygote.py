"""The zygote: one process per farm that imports a server's code once and forks every server from it.

A server started as ``python -m servers.cli`` spends about a second of CPU importing and holds
about 30 MB of its own memory. Forked from a parent that has already imported everything, it starts
in milliseconds and shares the imported code and objects copy-on-write with its siblings.

It is a forking process (``servers.forking``): the daemon sends one ``SpawnRequest`` per server on
its control socket, with four descriptors: the server's channel, its log file, its ready pipe's
write end and its environment pipe's read end; then the listening sockets the daemon holds for it,
if any (the server serves them from descriptor 4 on). A request with several command lines forks one
server that serves all their environments (``farm up --envs-per-server``). Each server, before anything
secret reaches it, forks its own spawner (``servers.workers.spawner``), which forks its workers from
the same imports.

The server's environment (its token among it) travels in a pipe that only the forked child reads,
so the zygote never holds one server's secrets in memory that the next server is forked from.

``python -m servers.farm.backends.zygote CONTROL_FD DAEMON_PID [MODULE ...]`` runs the zygote itself; the
daemon uses ``ZygoteSpawner``.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import anyio
from pydantic import BaseModel

from envscaler.annotations import read_ahead
from envscaler.bundle import ENV_FILE
from envscaler.cgroups import remove_stale_groups
from envscaler.confine import confine_problem
from envscaler.loader import compile_ahead
from envscaler.sandbox import FARM_ID_VARIABLE, clean_environment, die_with_parent, limit_resources, name_process
from envscaler.seccomp import seccomp_bpf, seccomp_problem
from servers.farm.backends.ports import Listeners
from servers.farm.backends.spawning import ADDRESS_SPACE_FACTOR, read_ready_line, server_command
from servers.farm.models import MAX_ENVS_PER_SERVER, EnvPlan, FarmPlan
from servers.forking import MESSAGE_BYTES, ExitReport, Forked, SpawnReply, exit_with, fork_available, refuse, reply, serve_forks
from servers.workers.spawner import PRELOAD as WORKER_PRELOAD
from servers.workers.spawner import fork_spawner

# Imported before the first fork: what ``servers.cli`` needs to serve a bundle, and its event loop.
PRELOAD = (
    "servers.cli", "servers.serve", "servers.app", "servers.transport.http_server", "servers.protocols.mcp", "uvloop",
    "anyio._backends._asyncio", "anyio.to_thread", "encodings.idna", *WORKER_PRELOAD,
)
# Also preloaded when a server of the farm serves OpenEnv (``farm up --openenv``).
OPENENV_PRELOAD = "servers.protocols.openenv.app"
# ``ENVSCALER_SPAWNER=popen`` makes the process backend start each server as its own interpreter.
SPAWNER_VARIABLE = "ENVSCALER_SPAWNER"

_PASSED_FDS = 4
# Where a forked server finds the listening sockets the daemon passed with its request: each environment's
# main socket, then its OpenEnv one if it has one, environment after environment.
_FIRST_LISTEN_FD = 4
_MAX_LISTENERS = MAX_ENVS_PER_SERVER
# Where a server that serves several environments finds the i-th one's token in its environment.
HOSTED_TOKEN_VARIABLE = "ENVSCALER_TOKEN_{}"
# What the zygote reports when it died before it could report an exit: its children got this signal.
_DEATH_SIGNAL = signal.SIGKILL
_ZYGOTE_STOP_S = 5.0


class ZygoteError(OSError):
    """The zygote could not start a server: it died with the request in hand, or fork() failed in it.

    An OSError, as a failed fork or exec of the Popen path is: the backend counts it as a failed start."""


class SpawnRequest(BaseModel):
    """Fork one server: ``python -m servers.cli ARGV`` without the interpreter's start-up; with several
    command lines, one server process that serves all their environments (``servers.cli.host_main``)."""

    argvs: list[list[str]]
    address_space_mb: int
    # Listening sockets that follow the four descriptors (at ``_FIRST_LISTEN_FD`` on, in order).
    listeners: int = 0
    # The bundles the server serves: the zygote compiles their classes before it forks (once per distinct
    # code), so that no worker forked below compiles one again.
    bundles: list[str] = []


def zygote_spawner(plan: FarmPlan) -> ZygoteSpawner | None:
    """The plan's zygote (OpenEnv preloaded when its servers serve it); None where fork is not
    available or ``ENVSCALER_SPAWNER=popen`` asks for an interpreter per server."""
    if not fork_available() or os.environ.get(SPAWNER_VARIABLE, "zygote") == "popen":
        return None
    openenv = any(env.openenv_port is not None for env in plan.envs)
    environment = clean_environment({FARM_ID_VARIABLE: plan.farm_id, "MALLOC_ARENA_MAX": "2"})
    return ZygoteSpawner(environment, plan.server_flags(), preload=PRELOAD + ((OPENENV_PRELOAD,) if openenv else ()))


# --- the daemon's side ---------------------------------------------------------------------------


class ZygoteServer:
    """One server forked by the zygote; a ``ServerProcess``."""

    def __init__(self, pid: int, pidfd: int, channel: socket.socket, ready_fd: int) -> None:
        self.pid = pid
        self.unserved: dict[str, str] = {}
        self._pidfd: int | None = pidfd
        self._channel = channel
        self._ready_fd: int | None = ready_fd
        self._ready: bool | None = None
        self._exit: int | None = None
        self._exit_lock = anyio.Lock()
        self._ready_lock = anyio.Lock()

    async def wait_ready(self) -> bool:
        """True once the server listens (its ready pipe said so); False if it exited first."""
        async with self._ready_lock:
            if self._ready is None:
                # Taken, not shared: read_ready_line closes it, and wait_exit no longer can.
                fd, self._ready_fd = self._ready_fd, None
                line = await read_ready_line(fd) if fd is not None else None
                self._ready = line is not None
                self.unserved = {str(env_id): str(why) for env_id, why in (line or {}).get("unserved", {}).items()}
            return self._ready

    async def wait_exit(self) -> int:
        """Its exit status, in Popen.returncode's convention (negative: killed by that signal)."""
        async with self._exit_lock:
            if self._exit is None:
                report = await _receive(self._channel)
                if report is None:
                    # The zygote died before it reaped the server; PDEATHSIG kills the server: wait until it is gone.
                    if self._pidfd is not None:
                        await anyio.wait_readable(self._pidfd)
                    self._exit = -_DEATH_SIGNAL
                else:
                    self._exit = ExitReport.model_validate_json(report[0]).status
                self._channel.close()
                if self._pidfd is not None:
                    os.close(self._pidfd)
                    self._pidfd = None
                self._close_ready()
            return self._exit

    def send_signal(self, signum: int) -> None:
        """Signal the server's whole process group (it is a group leader): what it forked dies with it."""
        try:
            os.killpg(self.pid, signum)
            return
        except ProcessLookupError:
            pass
        # Not a group leader yet (its setsid() is the first thing the child does) or gone: signal it alone.
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signum)
            except ProcessLookupError:
                pass

    def _close_ready(self) -> None:
        if self._ready_fd is not None:
            os.close(self._ready_fd)
            self._ready_fd = None


@dataclass
class _Zygote:
    process: subprocess.Popen[bytes]
    pidfd: int
    control: socket.socket


class ZygoteSpawner:
    """Starts environment servers by forking them from one zygote per farm; a ``Spawner``.

    The zygote is started on the first ``spawn`` (and again on the next one after it died) with
    ``environment`` as its own environment: that is what /proc/PID/environ shows for every server it
    forks, so it carries the farm id that ``farm down`` finds them by, and nothing secret. It writes
    to the daemon's own stdout and stderr (the daemon's log).

    ``spawn`` must run on the daemon's main thread: the zygote dies when the thread that started it
    exits (PR_SET_PDEATHSIG follows the thread, not the process).
    """

    # A forked server's start costs 0.1-0.2 s of CPU, much of a start is waiting: 200 servers on 2 cores
    # were healthy in 49-51 s with 1 start per core and 31-33 s with 3-4.
    starts_per_core = 4

    def __init__(self, environment: dict[str, str], flags: list[str], *, preload: tuple[str, ...] = PRELOAD) -> None:
        self.environment = environment
        # The serve flags every server gets (FarmPlan.server_flags).
        self.flags = flags
        self.preload = preload
        self._zygote: _Zygote | None = None
        self._send_lock = anyio.Lock()

    async def spawn(self, env: EnvPlan, environment: dict[str, str], log_path: Path, memory_mb: int,
                    listeners: Listeners | None = None) -> ZygoteServer:
        """Fork ``env``'s server with exactly ``environment`` as its environment variables, stdout and
        stderr appended to ``log_path``, its address space limited from ``memory_mb``, no core dumps,
        its own process group, and death when the zygote (and so the farm) goes away. With ``listeners``,
        it serves those sockets instead of binding its ports."""
        return await self.spawn_host([env], environment, log_path, memory_mb, [listeners] if listeners is not None else None)

    async def spawn_host(self, envs: list[EnvPlan], environment: dict[str, str], log_path: Path, memory_mb: int,
                         listeners: list[Listeners] | None = None) -> ZygoteServer:
        """Fork one server process for all of ``envs`` (as ``spawn`` does for one): each keeps its port,
        its workers and its token, the i-th found in ``environment`` as ``HOSTED_TOKEN_VARIABLE`` (i) when
        there are several. ``memory_mb`` is the whole process's; ``listeners``: one per environment."""
        if len(envs) > MAX_ENVS_PER_SERVER:
            raise ValueError(f"a server process serves {MAX_ENVS_PER_SERVER} environments at most, not {len(envs)}")
        argvs, sockets = [], []
        for env, held in zip(envs, listeners or [None] * len(envs)):
            own = held.sockets if held is not None else []
            fds = list(range(_FIRST_LISTEN_FD + len(sockets), _FIRST_LISTEN_FD + len(sockets) + len(own)))
            argvs.append(server_command(env, self.flags, fds)[3:])
            sockets += own
        request = SpawnRequest(argvs=argvs, address_space_mb=memory_mb * ADDRESS_SPACE_FACTOR, listeners=len(sockets),
                               bundles=[env.bundle_dir for env in envs])
        for attempt in range(2):
            server = await self._spawn_once(request, environment, log_path, [sock.fileno() for sock in sockets])
            if server is not None:
                return server
            # The zygote died with our request in hand: the next attempt starts a new one.
        names = ", ".join(env.env_id for env in envs)
        raise ZygoteError(f"{names}: the zygote stopped before it could start the server (its errors are in the daemon's log)")

    async def aclose(self) -> None:
        """Stop the zygote (the backend has stopped the servers): EOF on its control socket, then SIGKILL after 5 s."""
        zygote, self._zygote = self._zygote, None
        if zygote is None:
            return
        zygote.control.close()
        with anyio.move_on_after(_ZYGOTE_STOP_S):
            await anyio.wait_readable(zygote.pidfd)
        if zygote.process.poll() is None:
            zygote.process.kill()
        zygote.process.wait()
        os.close(zygote.pidfd)

    async def _spawn_once(self, request: SpawnRequest, environment: dict[str, str], log_path: Path,
                          listen_fds: list[int]) -> ZygoteServer | None:
        zygote = self._running_zygote()
        log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        ready_read, ready_write = os.pipe()
        environ_read, environ_write = os.pipe()
        server = None
        try:
            try:
                _write_environment(environ_write, environment)
                sent = await self._send(zygote, request.model_dump_json().encode(), [theirs.fileno(), log_fd, ready_write, environ_read, *listen_fds])
            finally:
                for fd in (log_fd, ready_write, environ_read, environ_write):
                    os.close(fd)
                theirs.close()
            message = await _receive(ours) if sent else None
            if message is None:
                return None  # the zygote died with our request in hand
            server = _server_from_reply(message, ours, ready_read)
            return server
        finally:
            if server is None:
                ours.close()
                os.close(ready_read)

    def _running_zygote(self) -> _Zygote:
        if self._zygote is not None and self._zygote.process.poll() is None:
            return self._zygote
        if self._zygote is not None:
            self._zygote.control.close()
            os.close(self._zygote.pidfd)
        self._zygote = self._start()
        return self._zygote

    def _start(self) -> _Zygote:
        _raise_open_files_limit()
        control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        control.setblocking(False)
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-m", "servers.farm.backends.zygote", str(theirs.fileno()), str(os.getpid()), *self.preload],
                stdin=subprocess.DEVNULL, env=self.environment, pass_fds=[theirs.fileno()],
            )
        return _Zygote(process, os.pidfd_open(process.pid), control)

    async def _send(self, zygote: _Zygote, data: bytes, fds: list[int]) -> bool:
        """Send one request; False when the zygote is gone."""
        async with self._send_lock:
            while True:
                try:
                    socket.send_fds(zygote.control, [data], fds)
                    return True
                except BlockingIOError:
                    await anyio.wait_writable(zygote.control)
                except (BrokenPipeError, ConnectionResetError):
                    return False


def _server_from_reply(message: tuple[bytes, list[int]], channel: socket.socket, ready_fd: int) -> ZygoteServer:
    data, fds = message
    reply = SpawnReply.model_validate_json(data)
    if reply.pid is None or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ZygoteError(f"the zygote could not fork a server: {reply.error}")
    return ZygoteServer(reply.pid, fds[0], channel, ready_fd)


async def _receive(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """One message and the descriptors that came with it; None at EOF."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, _PASSED_FDS + _MAX_LISTENERS)
        except BlockingIOError:
            await anyio.wait_readable(sock)
            continue
        except ConnectionResetError:
            return None
        if not data and not fds:
            return None
        return data, fds


def _write_environment(fd: int, environment: dict[str, str]) -> None:
    data = json.dumps(environment).encode()
    # A pipe holds 64 KiB: far more than a server's environment, and the child reads it only after it is forked.
    os.set_blocking(fd, False)
    if os.write(fd, data) != len(data):
        raise ZygoteError(f"a server's environment is too large to pass ({len(data)} bytes)")


def _raise_open_files_limit() -> None:
    """The daemon holds two descriptors per server (its channel and pidfd): 1,000 servers pass a 1,024 soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- the zygote's side ---------------------------------------------------------------------------


def _fork_server(data: bytes, fds: list[int]) -> Forked | None:
    if len(fds) < _PASSED_FDS:
        for fd in fds:
            os.close(fd)
        return None
    channel = socket.socket(fileno=fds[0])
    log_fd, ready_fd, environ_fd = fds[1:_PASSED_FDS]
    listen_fds = fds[_PASSED_FDS:]
    try:
        request = SpawnRequest.model_validate_json(data)
        if request.listeners != len(listen_fds):
            raise ValueError(f"the request names {request.listeners} listening sockets and {len(listen_fds)} came with it")
        if threading.active_count() != 1:
            raise RuntimeError(f"the zygote runs {threading.active_count()} threads; fork needs one")
        for bundle_dir in request.bundles:
            _compile_ahead(bundle_dir)
        gc.freeze()  # what the imports built moves out of the collector's reach: its pages stay shared
        pid = os.fork()
        if pid == 0:
            _become_server(request, log_fd, ready_fd, environ_fd, listen_fds)
    except Exception as e:
        refuse(channel, e)
        return None
    finally:
        for fd in (log_fd, ready_fd, environ_fd, *listen_fds):
            os.close(fd)
    return reply(channel, pid)


def _become_server(request: SpawnRequest, log_fd: int, ready_fd: int, environ_fd: int, listen_fds: list[int]) -> NoReturn:
    """In the forked child: become a fresh server process, run it, and exit with its status. Never returns."""

    def run() -> int:
        zygote = os.getppid()
        os.setsid()
        name_process("server")  # not the zygote's name: ps, and a benchmark's CPU by process, tell them apart
        die_with_parent(_DEATH_SIGNAL)
        if os.getppid() != zygote:
            os._exit(1)  # the zygote died before PDEATHSIG was armed
        _default_signals()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        # Out of the way first: a descriptor passed with the request may sit where another must go.
        above = max(16, ready_fd, environ_fd, *listen_fds) + 1
        ready, environ, *listens = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in (ready_fd, environ_fd, *listen_fds))
        os.dup2(ready, 3, inheritable=False)
        for number, fd in enumerate(listens):
            os.dup2(fd, _FIRST_LISTEN_FD + number, inheritable=False)
        environ = os.dup2(environ, _FIRST_LISTEN_FD + len(listens), inheritable=False)
        # The zygote's sockets, the siblings' pidfds and channels.
        os.closerange(environ + 1, os.sysconf("SC_OPEN_MAX"))
        limit_resources(request.address_space_mb)
        # Before the environment (the token) is read: the spawner, and every worker it forks, never holds it.
        fork_spawner()
        environment = _read_environment(environ)
        hosted = len(request.argvs) > 1
        tokens = [environment.pop(HOSTED_TOKEN_VARIABLE.format(number), "") for number in range(len(request.argvs))] if hosted else []
        os.environ.clear()
        os.environ.update(environment)
        from servers.serve import READY_FD_VARIABLE

        os.environ[READY_FD_VARIABLE] = "3"
        random.seed()
        sys.argv = ["servers.cli", *request.argvs[0]]
        from servers.cli import host_main, main

        return host_main(request.argvs, tokens) if hosted else main(request.argvs[0])

    exit_with(run)


_COMPILED_BUNDLES: set[str] = set()


def _compile_ahead(bundle_dir: str) -> None:
    """Compile the class of the bundle at ``bundle_dir`` and read its methods for their annotations (once per
    bundle; nothing of it runs): a server forked after this, and every worker its spawner forks, loads it
    without compiling or parsing it, each of which cost a worker 15-40 ms of its start for 1,000 lines. A bundle
    that cannot be read is left to its server to report."""
    if bundle_dir in _COMPILED_BUNDLES:
        return
    _COMPILED_BUNDLES.add(bundle_dir)
    try:
        class_code = json.loads((Path(bundle_dir) / ENV_FILE).read_text(encoding="utf-8")).get("env_class_code")
    except (OSError, ValueError, AttributeError):
        return
    try:
        code = compile_ahead(class_code) if isinstance(class_code, str) else None
        if code is not None:
            read_ahead(code, class_code)  # its tools' annotations: a third of a worker's start
    except Exception:  # noqa: BLE001 - code the compiler refuses oddly (a null byte): its server says why
        return


def _default_signals() -> None:
    """What a fresh interpreter has: Python's SIGINT handler, nothing blocked, the rest as Python sets them."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def _read_environment(fd: int) -> dict[str, str]:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    environment = json.loads(b"".join(chunks))
    return {str(key): str(value) for key, value in environment.items()}


def _settle_sandbox() -> None:
    """Build, once before the first fork, the seccomp programs every server's workers get (libseccomp), find
    whether a forked worker can confine itself here, and clear the control groups of servers gone, rather than
    again in each server."""
    if seccomp_problem() is None:
        for new_processes in (False, True):
            for memfd in (False, True):
                seccomp_bpf(new_processes=new_processes, memfd=memfd)
    confine_problem()
    remove_stale_groups()


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m servers.farm.backends.zygote CONTROL_FD DAEMON_PID [MODULE ...]``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m servers.farm.backends.zygote CONTROL_FD DAEMON_PID [MODULE ...]", file=sys.stderr)
        return 2
    control = socket.socket(fileno=int(args[0]))
    die_with_parent(signal.SIGKILL)
    if os.getppid() != int(args[1]):
        return 1  # the daemon died before PDEATHSIG was armed
    # Ctrl-C in a terminal that runs the daemon in the foreground is for the daemon: it stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    started = time.perf_counter()
    import importlib

    for module in args[2:]:
        importlib.import_module(module)
    _settle_sandbox()
    print(json.dumps({"event": "zygote ready", "pid": os.getpid(), "modules": len(sys.modules),
                      "import_s": round(time.perf_counter() - started, 3)}), file=sys.stderr, flush=True)
    serve_forks(control, _fork_server, _PASSED_FDS + _MAX_LISTENERS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
