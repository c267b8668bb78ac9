"""How a process-backend server is started and heard from, whoever starts it: an interpreter of its own
(``servers.farm.backends.process``) or a fork of the farm's zygote (``servers.farm.backends.zygote``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Protocol

import anyio

from servers.farm.backends.ports import Listeners
from servers.farm.models import EnvPlan

# Address space is not resident memory: thread stacks and allocator arenas reserve far more than they use.
ADDRESS_SPACE_FACTOR = 4


def serve_command(bundle_dir: str, host: str, port: int, flags: list[str]) -> list[str]:
    """The command line of one environment server on ``host:port`` (0: a free port), with ``flags``."""
    return [sys.executable, "-m", "servers.cli", bundle_dir, "--host", host, "--port", str(port), "--log-level", "warning", *flags]


def server_command(env: EnvPlan, flags: list[str], listen_fds: list[int] | None = None) -> list[str]:
    """The command line of one environment server on its loopback port (and OpenEnv port, if planned),
    with the plan's ``flags`` (``FarmPlan.server_flags``: limits, ``--no-sandbox``). With ``listen_fds``
    (the main socket's descriptor in the server, then the OpenEnv one's), it serves sockets it inherits
    instead of binding the ports."""
    command = serve_command(env.bundle_dir, "127.0.0.1", env.port, ["--public-url", env.url, *flags])
    if env.openenv_port is not None:
        command += ["--openenv-port", str(env.openenv_port)]
    for flag, fd in zip(("--listen-fd", "--openenv-listen-fd"), listen_fds or []):
        command += [flag, str(fd)]
    return command


class ServerProcess(Protocol):
    """One running environment server, however it was started."""

    pid: int
    # Environments of a server that serves several which it could not serve (their code failed to load),
    # with why; known once ``wait_ready`` has said it listens.
    unserved: dict[str, str]

    async def wait_ready(self) -> bool:
        """True once the server listens (its ready pipe said so); False if it exited first."""

    async def wait_exit(self) -> int:
        """Its exit status, in Popen.returncode's convention (negative: killed by that signal)."""

    def send_signal(self, signum: int) -> None:
        """Signal the server's whole process group (it is a group leader): what it forked dies with it."""


class Spawner(Protocol):
    """Starts environment servers for the process backend."""

    # How many servers per core may be starting at once: what a start costs the CPU decides it.
    starts_per_core: int

    async def spawn(self, env: EnvPlan, environment: dict[str, str], log_path: Path, memory_mb: int,
                    listeners: Listeners | None = None) -> ServerProcess:
        """Start ``env``'s server with exactly ``environment`` as its environment variables, stdout and
        stderr appended to ``log_path``, its address space limited from ``memory_mb``, no core dumps,
        its own process group, and death when the farm goes away. With ``listeners``, it serves those
        sockets (inherited) instead of binding its ports."""

    async def aclose(self) -> None:
        """Stop what the spawner itself runs (not the servers: the backend stops those first)."""


async def read_ready_line(fd: int) -> dict | None:
    """Read the ready pipe ``fd`` to its first line or EOF, close it; the server's ready line when it
    said it listens, else None. EOF first means the server exited (or closed the pipe) before it listened."""
    data = b""
    try:
        os.set_blocking(fd, False)
        while b"\n" not in data:
            await anyio.wait_readable(fd)
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                continue
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    return listening_line(data)


def listening_line(data: bytes) -> dict | None:
    """The server's ready line (``servers.serve``: event, url, port...) at the start of ``data``, when it
    says the server listens; else None."""
    try:
        ready = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        return None
    return ready if isinstance(ready, dict) and ready.get("event") == "listening" else None
