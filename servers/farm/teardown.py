"""Stopping a farm from its files alone: the daemon, every process and container it started, its files.

Works also after the daemon was killed (``kill -9``): processes are found by the farm id in their
environment, containers and networks by the farm's label, and a swarm farm's services, networks,
secrets and configs by the farm's label on the swarm.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections import Counter

from envscaler.sandbox import FARM_ID_VARIABLE
from servers.farm.models import FarmPaths, FarmPlan, FarmState, read_json

_DAEMON_STOP_S = 15.0


def pid_alive(pid: int | None) -> bool:
    """Whether process ``pid`` runs (a zombie does not count)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def farm_processes(farm_id: str) -> list[int]:
    """Pids of live processes carrying this farm's id in their environment (the daemon and its servers)."""
    marker = f"{FARM_ID_VARIABLE}={farm_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                if marker in handle.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours to read
    return found


def tear_down(paths: FarmPaths) -> Counter[str]:
    """Stop the daemon, then remove whatever of the farm is left; what was stopped, counted by kind."""
    plan = read_json(paths.plan, FarmPlan) if paths.plan.exists() else None
    state = read_json(paths.state, FarmState)
    stopped: Counter[str] = Counter()
    backend = (plan.backend if plan else None) or (state.backend if state else None)
    if state and pid_alive(state.daemon_pid):
        os.kill(state.daemon_pid, signal.SIGTERM)
        deadline = time.monotonic() + _DAEMON_STOP_S
        while pid_alive(state.daemon_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The daemon stops what it runs itself: every server, and a docker farm's network. A process-backend
        # server may serve several environments (``--envs-per-server``): counted once.
        servers = {record.pid or record.env_id for record in state.envs.values()} if backend == "process" else state.envs
        stopped["container" if backend == "docker" else "server"] += len(servers)
        stopped["network"] += backend == "docker"
    farm_id = (plan.farm_id if plan else None) or (state.farm_id if state else None)
    if farm_id:
        for pid in farm_processes(farm_id):
            try:
                os.kill(pid, signal.SIGKILL)
                stopped["leftover process"] += 1
            except ProcessLookupError:
                continue
        if backend == "docker":
            from servers.farm.backends.docker import remove_farm_resources

            stopped["leftover Docker object"] += remove_farm_resources(farm_id)
        if backend == "swarm":
            from servers.farm.backends.swarm import remove_swarm_farm

            stopped["swarm object"] += remove_swarm_farm(paths, farm_id)
    paths.catalog.unlink(missing_ok=True)
    shutil.rmtree(paths.dir, ignore_errors=True)
    return stopped


def describe_stopped(stopped: Counter[str]) -> str:
    """``6 containers and 1 network stopped`` for what :func:`tear_down` stopped."""
    parts = [f"{count} {kind}{'' if count == 1 else 'es' if kind.endswith('s') else 's'}" for kind, count in stopped.items() if count]
    if not parts:
        return "nothing was running"
    return (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]) + " stopped"
