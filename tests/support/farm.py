"""A real process farm of the counter environment for a test: ``farm up``, the catalog, ``farm down``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from envscaler.sandbox import FARM_ID_VARIABLE
from servers.farm.models import Backend, FarmPaths, Limits, write_json
from servers.farm.plan import plan_farm
from tests.support.bundles import counter_bundle, counter_scenario, counter_spec, write_bundle
from tests.support.cli import envscaler
from tests.support.waiting import wait_until


@contextmanager
def counter_farm(root: Path, *flags: str) -> Iterator[dict[str, Any]]:
    """``farm up`` (process backend, extra ``flags``) of the counter bundle; yields the catalog; ``farm down`` after."""
    catalog = root / "farm.json"
    up = envscaler("farm", "up", str(counter_bundle(root / "bundles")), "--backend", "process", "--catalog", str(catalog), *flags)
    assert up.returncode == 0, up.stderr
    try:
        yield json.loads(catalog.read_text())
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))


@contextmanager
def bundled_farm(root: Path, env_ids: list[str]) -> Iterator[Path]:
    """``farm up`` (process backend) of these bundled environments; yields the catalog file; ``farm down`` after."""
    from envscaler import default_catalog

    with process_farm(root, [default_catalog() / e for e in env_ids]) as catalog:
        yield catalog


@contextmanager
def process_farm(root: Path, bundles: list[Path], *flags: str) -> Iterator[Path]:
    """``farm up`` (process backend, and ``flags``) of these bundles (or folders of bundles); yields the catalog
    file; ``farm down`` after."""
    catalog = root / "farm.json"
    up = envscaler("farm", "up", *map(str, bundles), "--backend", "process", "--catalog", str(catalog), *flags)
    assert up.returncode == 0, up.stderr
    try:
        yield catalog
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))


@contextmanager
def farm_with_its_port_taken(root: Path, bundle: Path, backend: Backend) -> Iterator[tuple[Path, int, socket.socket]]:
    """A farm of ``bundle`` whose daemon starts, as ``farm up`` starts it, after another program took the
    port it planned: yields, once the farm is ready, its catalog file, the planned port and the other
    program's listening socket; ``farm down`` after (which must succeed)."""
    catalog = root / "farm.json"
    plan = plan_farm([str(bundle)], backend, catalog, Limits(), 0)
    planned = plan.envs[0].port
    paths = FarmPaths(catalog)
    paths.dir.mkdir()
    write_json(paths.plan, plan)
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", planned))
        thief.listen()
        daemon = subprocess.Popen([sys.executable, "-m", "servers.farm.daemon", str(paths.dir)], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                  env={**os.environ, FARM_ID_VARIABLE: plan.farm_id})
        try:
            wait_until(lambda: paths.state.exists() and read_state(catalog)["ready"], timeout_s=300)
            yield catalog, planned, thief
        finally:
            down = envscaler("farm", "down", "--catalog", str(catalog), timeout=300)
            daemon.wait(60)
    assert down.returncode == 0, down.stderr


def read_state(catalog: Path) -> dict[str, Any]:
    """The farm daemon's state file (``farm.json.farm/state.json``) of the farm whose catalog is ``catalog``."""
    return json.loads((catalog.parent / (catalog.name + ".farm") / "state.json").read_text())


def catalog_copies(root: Path, count: int, scenarios_per_env: int | None = None, of: str | None = None) -> list[Path]:
    """``count`` bundles cycling through the bundled catalog (or copies of its environment ``of`` alone), each
    under its own env_id (``<env>_NNN``), with its first ``scenarios_per_env`` scenarios (all when None)."""
    from envscaler import default_catalog, load_bundles, save_bundle

    bundles = load_bundles(default_catalog() / of if of is not None else default_catalog())
    written = []
    for number in range(count):
        bundle = bundles[number % len(bundles)].model_copy(deep=True)
        env_id = f"{bundle.env_id}_{number:03d}"
        bundle.spec.env_id = env_id
        bundle.scenarios = bundle.scenarios[:scenarios_per_env]
        for scenario in bundle.scenarios:
            scenario.env_id = env_id
        written.append(save_bundle(bundle, root))
    return written


def gateway_only_catalog(catalog: Path, out: Path) -> Path:
    """A copy of ``catalog`` whose every environment is reached through the farm's gateway."""
    data = json.loads(catalog.read_text())
    for env_id, endpoint in data["envs"].items():
        endpoint["url"] = f"{data['gateway']}/envs/{env_id}"
    out.write_text(json.dumps(data))
    return out


def parent_of(pid: int) -> int:
    """The parent process id of ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^PPid:\s+(\d+)", status, re.MULTILINE).group(1))


def ancestors_of(pid: int) -> list[int]:
    """``pid``'s parent, its parent's parent, and so on, up to (not with) init."""
    ancestors, parent = [], parent_of(pid)
    while parent > 1:
        ancestors.append(parent)
        parent = parent_of(parent)
    return ancestors


# Long enough for a process killed with its sandbox to be gone.
_DYING_S = 1.0


def farm_members(state: dict[str, Any]) -> dict[str, list[int]]:
    """Every running process of the farm (found by its farm id, as ``farm down`` finds them), by what it is:
    the daemon, the zygote, haproxy, the servers, each server's spawner (its child), the processes under a
    spawner (the environment and check workers), and anything else that is still there a second later
    (``stray``: a leak; not a process in a sandbox whose first process was just killed, which the kernel
    kills with it)."""
    from servers.farm.teardown import farm_processes

    servers = {record["pid"] for record in state["envs"].values()}
    members: dict[str, list[int]] = {"daemon": [], "zygote": [], "haproxy": [], "server": [], "spawner": [], "under a server": [],
                                      "stray": []}
    for pid in farm_processes(state["farm_id"]):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            ancestors = ancestors_of(pid)
        except (OSError, AttributeError):
            continue  # gone meanwhile
        if pid == state["daemon_pid"]:
            kind = "daemon"
        elif pid in servers:
            kind = "server"
        elif ancestors and ancestors[0] in servers:
            kind = "spawner"
        elif servers & set(ancestors):
            kind = "under a server"
        elif b"servers.farm.backends.zygote" in command:
            kind = "zygote"
        elif b"haproxy" in command:
            kind = "haproxy"
        else:
            kind = "stray"
        members[kind].append(pid)
    if members["stray"]:
        time.sleep(_DYING_S)
        members["stray"] = sorted(set(members["stray"]) & set(farm_processes(state["farm_id"])))
    return members


def two_counters_up(root: Path) -> Path:
    """``envscaler farm up`` (process backend) of two counter environments under ``root``; its catalog."""
    catalog = root / "farm.json"
    two = root / "two"
    counter_bundle(two)
    write_bundle(two, counter_spec(env_id="counter2"), [counter_scenario(env_id="counter2")])
    up = envscaler("farm", "up", str(two), "--backend", "process", "--catalog", str(catalog), timeout=180)
    assert up.returncode == 0, up.stderr
    return catalog
