"""The process backend: one local subprocess per environment, restarted when it dies.

Isolation here is what a plain process can get: a clean environment (no host secrets), an
address-space limit, no core dumps, and death with the daemon (PR_SET_PDEATHSIG). Network, CPU,
pids and filesystem isolation need the docker backend.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

import anyio

from envscaler.sandbox import clean_environment, limit_resources
from servers.farm.board import Board
from servers.farm.models import EnvPlan, FarmPaths, FarmPlan

FARM_ID_VARIABLE = "ENVSCALER_FARM_ID"
_PR_SET_PDEATHSIG = 1
# A server that dies this many times before it was ever healthy is broken, not unlucky.
_STARTUP_ATTEMPTS = 3
# Address space is not resident memory: thread stacks and allocator arenas reserve far more than they use.
ADDRESS_SPACE_FACTOR = 4


def describe_exit(code: int) -> str:
    """``exit 3`` or ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def _child_setup(memory_mb: int) -> None:
    """Runs in the child before exec: limits, and die when the daemon dies so nothing is orphaned."""
    limit_resources(memory_mb * ADDRESS_SPACE_FACTOR)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def server_command(env: EnvPlan) -> list[str]:
    """The command line of one environment server on its loopback port (and OpenEnv port, if planned)."""
    command = [
        sys.executable, "-m", "servers.launch", env.bundle_dir,
        "--host", "127.0.0.1", "--port", str(env.port), "--public-url", env.url, "--log-level", "warning",
    ]
    if env.openenv_port is not None:
        command += ["--openenv-port", str(env.openenv_port)]
    return command


class ServerProcess(Protocol):
    """One running environment server, however it was started."""

    pid: int

    async def wait_ready(self) -> bool:
        """True once the server listens (its ready pipe said so); False if it exited first."""

    async def wait_exit(self) -> int:
        """Its exit status, in Popen.returncode's convention (negative: killed by that signal)."""

    def send_signal(self, signum: int) -> None:
        """Signal the server's whole process group (it is a group leader): what it forked dies with it."""


class Spawner(Protocol):
    """Starts environment servers for the process backend."""

    async def spawn(self, env: EnvPlan, environment: dict[str, str], log_path: Path, memory_mb: int) -> ServerProcess:
        """Start ``env``'s server with exactly ``environment`` as its environment variables, stdout and
        stderr appended to ``log_path``, its address space limited from ``memory_mb``, no core dumps,
        its own process group, and death when the farm goes away."""

    async def aclose(self) -> None:
        """Stop what the spawner itself runs (not the servers: the backend stops those first)."""


def default_spawner(plan: FarmPlan) -> Spawner | None:
    """The zygote where fork works, unless ``ENVSCALER_SPAWNER=popen``; None: a fresh interpreter per server."""
    from servers.farm.zygote import zygote_spawner

    return zygote_spawner(plan)


class ProcessBackend:
    """Starts every server of the plan, restarts the ones that die, stops them all."""

    def __init__(self, plan: FarmPlan, paths: FarmPaths, board: Board) -> None:
        self.plan = plan
        self.paths = paths
        self.board = board
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.spawner = default_spawner(plan)
        self.servers: dict[str, ServerProcess] = {}
        self._stopping = False

    async def run(self) -> None:
        """Start and supervise every environment until cancelled."""
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        try:
            async with anyio.create_task_group() as tasks:
                for env in self.plan.envs:
                    tasks.start_soon(self._supervise, env)
        finally:
            if self.spawner is not None:
                with anyio.CancelScope(shield=True):
                    await self.spawner.aclose()

    async def _run_once(self, env: EnvPlan) -> int:
        """Start ``env``'s server and wait for its exit status."""
        if self.spawner is None:
            child = self._spawn(env)
            self.board.update(env.env_id, pid=child.pid)
            while (code := child.poll()) is None:
                await anyio.sleep(0.2)
            return code
        server = await self.spawner.spawn(env, self._environment(env), self.paths.env_log(env.env_id), self.plan.limits.memory_mb)
        self.servers[env.env_id] = server
        self.board.update(env.env_id, pid=server.pid)
        code = await server.wait_exit()
        server.send_signal(signal.SIGKILL)  # whatever it forked dies with it
        self.servers.pop(env.env_id, None)
        return code

    def _environment(self, env: EnvPlan) -> dict[str, str]:
        return clean_environment({"ENVSCALER_TOKEN": env.token, FARM_ID_VARIABLE: self.plan.farm_id, "MALLOC_ARENA_MAX": "2"})

    async def _supervise(self, env: EnvPlan) -> None:
        failures = 0
        backoff_s = 0.2
        while not self._stopping:
            code = await self._run_once(env)
            if self._stopping:
                return
            record = self.board.env(env.env_id)
            exit_text = describe_exit(code)
            if record.healthy_at is None:
                failures += 1
                if failures >= _STARTUP_ATTEMPTS:
                    tail = _log_tail(self.paths.env_log(env.env_id))
                    self.board.update(env.env_id, status="failed", pid=None, last_exit=f"{exit_text}: {tail}")
                    return
            self.board.update(env.env_id, status="restarting", restarts=record.restarts + 1, last_exit=exit_text, pid=None)
            await anyio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 5.0)

    def _spawn(self, env: EnvPlan) -> subprocess.Popen[bytes]:
        with open(self.paths.env_log(env.env_id), "ab") as log:
            child = subprocess.Popen(
                server_command(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environment(env),
                preexec_fn=lambda: _child_setup(self.plan.limits.memory_mb),
            )
        self.children[env.env_id] = child
        return child

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every server, then SIGKILL the ones still alive after ``grace_s``."""
        self._stopping = True
        live = [c for c in self.children.values() if c.poll() is None]
        for child in live:
            child.terminate()
        for server in list(self.servers.values()):
            server.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while (self.servers or any(c.poll() is None for c in live)) and time.monotonic() < deadline:
            await anyio.sleep(0.05)
        for child in live:
            if child.poll() is None:
                child.kill()
                child.wait()
        for server in list(self.servers.values()):
            server.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while self.servers and time.monotonic() < deadline:
            await anyio.sleep(0.05)


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) or "no output"
