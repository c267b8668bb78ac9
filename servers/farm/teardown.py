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


def tear_down(paths: FarmPaths) -> int:
    """Stop the daemon, then remove whatever of the farm is left; the number of things removed."""
    plan = read_json(paths.plan, FarmPlan) if paths.plan.exists() else None
    state = read_json(paths.state, FarmState)
    removed = 0
    if state and pid_alive(state.daemon_pid):
        os.kill(state.daemon_pid, signal.SIGTERM)
        deadline = time.monotonic() + _DAEMON_STOP_S
        while pid_alive(state.daemon_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        removed += 1
    farm_id = (plan.farm_id if plan else None) or (state.farm_id if state else None)
    if farm_id:
        for pid in farm_processes(farm_id):
            try:
                os.kill(pid, signal.SIGKILL)
                removed += 1
            except ProcessLookupError:
                continue
        backend = (plan.backend if plan else None) or (state.backend if state else None)
        if backend == "docker":
            from servers.farm.backends.docker import remove_farm_resources

            removed += remove_farm_resources(farm_id)
        if backend == "swarm":
            from servers.farm.backends.swarm import remove_swarm_farm

            removed += remove_swarm_farm(paths, farm_id)
    paths.catalog.unlink(missing_ok=True)
    shutil.rmtree(paths.dir, ignore_errors=True)
    return removed
