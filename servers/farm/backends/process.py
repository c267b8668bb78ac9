"""The process backend: one local server process per environment, restarted when it dies.

Every server gets a clean environment (no host secrets), an address-space limit, no core dumps, its
own process group, and death with the daemon (PR_SET_PDEATHSIG). A server runs its environment's
code in worker processes (``servers.workers.store``); with the plan's ``sandbox`` (the default where
bubblewrap works) they run in the sandbox (``envscaler.sandbox``): no network, nothing of the host's
files but Python, no new processes. CPU limits need the docker backend.

Supervision costs nothing per environment while the farm is quiet: a server says it listens over its
ready pipe, its exit wakes the daemon through a pidfd, and only a bounded number of servers start at
once (the machine's cores). Hung servers are found by the daemon's prober (``servers.farm.health``),
which asks the backend to ``kill`` them; the restart then takes the usual path.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import time
from collections.abc import Collection
from pathlib import Path

import anyio

from envscaler.sandbox import FARM_ID_VARIABLE, adopt_orphans, clean_environment, die_with_parent, limit_resources
from servers.farm.backends.ports import Listeners, hold_plan_ports
from servers.farm.backends.spawning import ADDRESS_SPACE_FACTOR, ServerProcess, Spawner, read_ready_line, server_command
from servers.farm.backends.zygote import HOSTED_TOKEN_VARIABLE, ZygoteSpawner, zygote_spawner
from servers.farm.board import Board
from servers.farm.models import EnvPlan, FarmPaths, FarmPlan
from servers.serve import READY_FD_VARIABLE

log = logging.getLogger("envscaler.farm")

# A server that dies this many times before it was ever healthy is broken, not unlucky.
_STARTUP_ATTEMPTS = 3
# A server that neither listens nor exits within this long after its start is stuck in its start-up.
_LISTEN_TIMEOUT_S = 60.0
_STOP_POLL_S = 0.05


def describe_exit(code: int) -> str:
    """``exit 3`` or ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def start_slots(per_core: int) -> int:
    """How many servers may be starting at once: ``per_core`` per core (``ENVSCALER_FARM_START_SLOTS``
    overrides), so that a big farm's start-up does not thrash the machine."""
    override = os.environ.get("ENVSCALER_FARM_START_SLOTS")
    if override and override.isdigit() and int(override) > 0:
        return int(override)
    return max(2, per_core * len(os.sched_getaffinity(0)))


def killed_for_memory(pid: int, since: float) -> bool:
    """Whether the kernel's log says it killed process ``pid`` for memory after ``since`` (time.monotonic()).

    The OOM killer logs ``Killed process PID (...)`` (also for a memory cgroup's limit); reading
    /dev/kmsg needs root or CAP_SYSLOG, and without it the answer is False: a plain "killed by SIGKILL".
    """
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    marker = f"Killed process {pid} (".encode()
    found = False
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                return found
            except OSError:
                continue  # EPIPE: older records were overwritten while we read; go on with the next
            if not record:
                return found
            prefix, _, message = record.partition(b";")
            fields = prefix.split(b",")
            if marker in message and len(fields) > 2 and int(fields[2]) / 1e6 >= since - 1.0:
                found = True
    finally:
        os.close(fd)


def server_preexec(memory_mb: int) -> None:
    """Runs in the child before exec: limits, and die when the daemon dies so nothing is orphaned
    (SIGKILL: a sandboxed server's bubblewrap ignores SIGTERM, see ``servers.serve.serve_in_sandbox``)."""
    limit_resources(memory_mb * ADDRESS_SPACE_FACTOR)
    die_with_parent(signal.SIGKILL)


class PopenServer:
    """A server started by ``subprocess.Popen``; its exit is seen through a pidfd, never polled."""

    def __init__(self, child: subprocess.Popen[bytes], ready_fd: int) -> None:
        self.pid = child.pid
        self.unserved: dict[str, str] = {}
        self._child = child
        self._ready_fd: int | None = ready_fd
        self._pidfd: int | None = os.pidfd_open(child.pid)

    async def wait_ready(self) -> bool:
        """True once the server listens (its ready pipe said so); False if it exited first."""
        if self._ready_fd is None:
            return False
        fd, self._ready_fd = self._ready_fd, None
        return await read_ready_line(fd) is not None

    async def wait_exit(self) -> int:
        """Its exit status, in Popen.returncode's convention (negative: killed by that signal)."""
        while self._child.returncode is None and self._pidfd is not None:
            await anyio.wait_readable(self._pidfd)
            self._child.poll()  # readable means it exited: this reaps it without blocking
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._ready_fd is not None:
            os.close(self._ready_fd)
            self._ready_fd = None
        return self._child.returncode if self._child.returncode is not None else -signal.SIGKILL

    def send_signal(self, signum: int) -> None:
        """Signal the server's whole process group (it is a group leader): what it forked dies with it."""
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already


async def reap_group(pgid: int, timeout_s: float = 5.0) -> None:
    """Reap what is left of a server's process group among our children: when bubblewrap is killed, the
    sandbox's init is orphaned to us (see ``adopt_orphans``), and unreaped it would keep the group alive."""
    with anyio.move_on_after(timeout_s):
        while True:
            try:
                if os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG) is None:
                    await anyio.sleep(_STOP_POLL_S)
            except ChildProcessError:
                return  # none of our children is left in the group


class PopenSpawner:
    """Starts each server as a fresh interpreter (fork + exec): simple, and the fallback of the zygote."""

    # An interpreter's start-up is CPU-bound (imports): more than one per core makes every one slower.
    starts_per_core = 1

    def __init__(self, flags: list[str]) -> None:
        # The serve flags every server gets (FarmPlan.server_flags).
        self.flags = flags

    async def spawn(self, env: EnvPlan, environment: dict[str, str], log_path: Path, memory_mb: int,
                    listeners: Listeners | None = None) -> ServerProcess:
        """Start ``env``'s server (see ``Spawner.spawn``); the ready pipe's write end goes to the child only."""
        read_fd, write_fd = os.pipe()
        listen_fds = [sock.fileno() for sock in listeners.sockets] if listeners is not None else []
        try:
            with open(log_path, "ab") as log_file:
                # Popen runs in the event loop's thread on purpose: PR_SET_PDEATHSIG fires when the
                # thread that forked the child ends, and this one lives as long as the daemon.
                child = subprocess.Popen(
                    server_command(env, self.flags, listen_fds),
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env={**environment, READY_FD_VARIABLE: str(write_fd)},
                    pass_fds=(write_fd, *listen_fds),
                    start_new_session=True,
                    preexec_fn=functools.partial(server_preexec, memory_mb),
                )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return PopenServer(child, read_fd)

    async def aclose(self) -> None:
        """Nothing runs besides the servers."""


def default_spawner(plan: FarmPlan) -> Spawner:
    """The spawner the process backend uses unless it is given one: servers forked from the plan's
    zygote where fork works, unless ``ENVSCALER_SPAWNER=popen``; otherwise an interpreter per server.
    A server runs no environment code (its workers do, in the sandbox when the plan says so), so a
    sandboxed farm forks its servers too."""
    return zygote_spawner(plan) or PopenSpawner(plan.server_flags())


_REAP_PERIOD_S = 2.0


def reap_adopted(known: Collection[int] = ()) -> int:
    """Reap the exited orphans this subreaper adopted from its servers' groups; how many.

    bubblewrap's outer process can exit before the sandbox's init has (the probe a server runs at
    start, a replaced worker): that init is then ours (``adopt_orphans``), and unreaped it stays a
    zombie for the server's whole life. The daemon's own children are left to whoever started them:
    they are in the daemon's group (the zygote, haproxy) or lead their own (a server started with Popen).
    ``known``: pids that are not looked at (the servers: each is reaped by its supervisor), so that a
    farm of servers started with Popen costs a list of pids every few seconds, not a file per server.
    """
    own_group = os.getpgrp()
    reaped = 0
    for children in Path("/proc/self/task").glob("*/children"):
        try:
            pids = [int(pid) for pid in children.read_text().split()]
        except OSError:
            continue  # a thread that ended meanwhile
        for pid in pids:
            if pid in known:
                continue
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            state, group = fields[0], int(fields[2])
            if state == "Z" and group not in (own_group, pid):
                try:
                    reaped += os.waitpid(pid, os.WNOHANG)[0] == pid
                except ChildProcessError:
                    continue
    return reaped


class ProcessBackend:
    """Starts every server of the plan (a few at a time), restarts the ones that die, stops them all.

    A server serves one environment, or ``plan.envs_per_server`` of them where servers are forked from
    the zygote: those start, stop and restart together (each keeps its port, token and workers).
    """

    servers_here = True

    def __init__(self, plan: FarmPlan, paths: FarmPaths, board: Board, spawner: Spawner | None = None) -> None:
        self.plan = plan
        self.paths = paths
        self.board = board
        self.spawner = spawner or default_spawner(plan)
        # env_id -> the server that serves it (one server for all the environments it serves).
        self.servers: dict[str, ServerProcess] = {}
        # env_id -> the listening sockets its server inherits at every start (``hold_ports``).
        self.listeners: dict[str, Listeners] = {}
        # env_id -> why the daemon killed its server (a hung one): reported instead of "killed by SIGKILL".
        self._kill_reasons: dict[str, str] = {}
        self._starting = anyio.CapacityLimiter(start_slots(self.spawner.starts_per_core))
        self._stopping = False

    async def run(self) -> None:
        """Start and supervise every environment until cancelled."""
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        adopt_orphans()
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._reap_adopted_forever)
                self.listeners = hold_plan_ports(self.plan, self.board)
                listening = [env for env in self.plan.envs if env.env_id in self.listeners]
                size = self._envs_per_server()
                for first in range(0, len(listening), size):
                    tasks.start_soon(self._supervise, listening[first:first + size])
        finally:
            with anyio.CancelScope(shield=True):
                await self.spawner.aclose()
            for listeners in self.listeners.values():
                listeners.close()

    async def _reap_adopted_forever(self) -> None:
        """Whoever adopts orphans reaps them (see :func:`reap_adopted`): every few seconds, since the
        event loop keeps SIGCHLD to itself."""
        while True:
            reap_adopted({server.pid for server in self.servers.values()})
            await anyio.sleep(_REAP_PERIOD_S)

    def _envs_per_server(self) -> int:
        """How many environments one server serves: the plan's, where the spawner can fork such servers."""
        if self.plan.envs_per_server > 1 and not isinstance(self.spawner, ZygoteSpawner):
            log.warning("servers are not forked from the zygote here: each serves one environment",
                        extra={"envs_per_server": self.plan.envs_per_server})
            self.plan.envs_per_server = 1
        return self.plan.envs_per_server

    def _environment(self, group: list[EnvPlan]) -> dict[str, str]:
        if len(group) == 1:
            tokens = {"ENVSCALER_TOKEN": group[0].token}
        else:
            tokens = {HOSTED_TOKEN_VARIABLE.format(number): env.token for number, env in enumerate(group)}
        return clean_environment({**tokens, FARM_ID_VARIABLE: self.plan.farm_id, "MALLOC_ARENA_MAX": "2"})

    def _log_path(self, group: list[EnvPlan]) -> Path:
        """The log file of the group's server: the first environment's; the others' name it (a symbolic link)."""
        path = self.paths.env_log(group[0].env_id)
        for env in group[1:]:
            link = self.paths.env_log(env.env_id)
            if not link.is_symlink():
                link.symlink_to(path.name)
        return path

    async def _supervise(self, group: list[EnvPlan]) -> None:
        """Start the server of ``group`` (one environment, or several that one server serves) and start
        it again whenever it ends, until the farm stops or it fails to start ``_STARTUP_ATTEMPTS`` times."""
        ids = [env.env_id for env in group]
        named = ", ".join(ids)
        failures = 0
        backoff_s = 0.2
        while not self._stopping:
            started = time.monotonic()
            try:
                server = await self._start(group)
            except OSError as e:  # no fork, pipe or pidfd now (out of pids, files or memory): like a crash
                oom, exit_text = False, f"could not start: {e}"
                log.error("could not start an environment server", extra={"env": named, "error": str(e)})
            else:
                if server is None:
                    return
                code = await server.wait_exit()
                server.send_signal(signal.SIGKILL)  # whatever it forked dies with it
                await reap_group(server.pid)
                for env_id in ids:
                    self.servers.pop(env_id, None)
                if self._stopping:
                    return
                oom = code == -signal.SIGKILL and killed_for_memory(server.pid, started)
                reasons = [reason for env_id in ids if (reason := self._kill_reasons.pop(env_id, None))]
                exit_text = "; ".join(dict.fromkeys(reasons)) or ("out of memory" if oom else describe_exit(code))
            records = [self.board.env(env_id) for env_id in ids]
            if all(record.healthy_at is None for record in records):
                failures += 1
                if failures >= _STARTUP_ATTEMPTS:
                    tail = log_tail(self.paths.env_log(ids[0]))
                    for env_id in ids:
                        self.board.update(env_id, status="failed", pid=None, last_exit=f"{exit_text}: {tail}")
                    log.error("environment server failed to start", extra={"env": named, "exit": exit_text})
                    return
            else:
                backoff_s = 0.2
            log.warning("environment server stopped; restarting", extra={"env": named, "exit": exit_text})
            for record in records:
                if record.status == "failed":
                    continue  # its code did not load at the last start (``ServerProcess.unserved``): it is tried again, not counted
                self.board.update(record.env_id, status="restarting", restarts=record.restarts + 1, last_exit=exit_text,
                                  oom_killed=oom or record.oom_killed, pid=None)
            await anyio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 5.0)

    async def _start(self, group: list[EnvPlan]) -> ServerProcess | None:
        """Spawn the server of ``group`` in one of the start slots, held until it listens, exits or is stuck;
        None when the farm began stopping while it waited for a slot."""
        async with self._starting:
            if self._stopping:
                return None
            memory_mb = self.plan.limits.memory_mb * len(group)
            listeners = [self.listeners[env.env_id] for env in group]
            if len(group) == 1:
                server = await self.spawner.spawn(group[0], self._environment(group), self._log_path(group), memory_mb, listeners[0])
            else:
                assert isinstance(self.spawner, ZygoteSpawner)
                server = await self.spawner.spawn_host(group, self._environment(group), self._log_path(group), memory_mb, listeners)
            for env in group:
                self.servers[env.env_id] = server
                self.board.update(env.env_id, pid=server.pid)
            with anyio.move_on_after(_LISTEN_TIMEOUT_S):
                if await server.wait_ready():
                    for env in group:
                        why = server.unserved.get(env.env_id)
                        if why is not None:
                            # Its code does not load: its neighbours are served, and a restart would not help it.
                            self.board.update(env.env_id, status="failed", pid=None, last_exit=why)
                            log.error("environment failed to start; the others of its server run", extra={"env": env.env_id, "error": why})
                            continue
                        record = self.board.env(env.env_id)
                        self.board.update(env.env_id, status="healthy", healthy_at=record.healthy_at or time.time())
                return server
            await self.kill(group[0].env_id, f"did not listen within {_LISTEN_TIMEOUT_S:g} s")
            return server

    async def kill(self, env_id: str, reason: str) -> None:
        """SIGKILL ``env_id``'s server (its whole group, and so every environment it serves); its restart
        reports ``reason``."""
        server = self.servers.get(env_id)
        if server is None:
            return
        self._kill_reasons[env_id] = reason
        log.warning("killing an environment server", extra={"env": env_id, "reason": reason})
        server.send_signal(signal.SIGKILL)

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every server, then SIGKILL the groups of the ones still alive after ``grace_s``."""
        self._stopping = True
        for server in {id(server): server for server in self.servers.values()}.values():
            server.send_signal(signal.SIGTERM)
        with anyio.move_on_after(grace_s):
            while self.servers:
                await anyio.sleep(_STOP_POLL_S)
        for server in {id(server): server for server in self.servers.values()}.values():
            server.send_signal(signal.SIGKILL)
        # Their exits are reaped by the supervising tasks: give them the moment it takes.
        with anyio.move_on_after(1.0):
            while self.servers:
                await anyio.sleep(_STOP_POLL_S)


def log_tail(path: Path, lines: int = 3) -> str:
    """The last ``lines`` lines of a server's log, on one line ("no log", "no output" when there are none)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) or "no output"
