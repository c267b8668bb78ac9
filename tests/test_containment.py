"""Environment code never holds host root, and what it takes is counted against its own environment.

A sandboxed process farm run as root (as ``.ci/run``, containers and most training nodes run it)
serves the ``rogue`` bundle (``tests/support/rogue.py``) beside a plain counter with 256 MB and 64
tasks per environment. Each attack must fail or stay within those bounds, be reported against the
rogue environment, and cost the counter nothing: a bystander episode of it keeps calling and
validating with correct results throughout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from envscaler.sandbox import CONFINED_UID_BASE, process_uid, sandbox_problem
from tests.support.bundles import counter_bundle, counter_scenario
from tests.support.cli import envscaler
from tests.support.farm import farm_members, read_state
from tests.support.hostile import call
from tests.support.rogue import rogue_bundle

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0 or sandbox_problem() is not None,
                       reason="containment as root needs root and bubblewrap (.ci/run has both)"),
]

MEMORY_MB = 256
TASKS = 64


@dataclass
class Env:
    url: str
    token: str

    def control(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=120)

    def info(self) -> dict:
        with self.control() as http:
            return http.get("/info").json()


@dataclass
class Farm:
    catalog: Path
    rogue: Env
    counter: Env
    log: Path

    def episode(self, env: Env, scenario_id: str) -> dict:
        with env.control() as http:
            created = http.post("/episodes", json={"scenario_id": scenario_id})
            assert created.status_code == 201, created.text
            return created.json()

    def attack(self, tool: str, arguments: dict) -> dict:
        """One call of a rogue tool on a fresh episode, with the bystander checked before and after."""
        self.bystander_answers()
        with httpx.Client(timeout=120) as http:
            result = call(http, self.episode(self.rogue, "rogue_001")["mcp_url"], tool, arguments)
        self.bystander_answers()
        return result

    def bystander_answers(self) -> None:
        """A fresh counter episode adds 3 to item a through MCP and validates at 1.0."""
        episode = self.episode(self.counter, "counter_001")
        with httpx.Client(timeout=120) as http:
            for amount in (2, 1):
                result = call(http, episode["mcp_url"], "add", {"item_id": "a", "amount": amount})
                assert not result["isError"], result
        with self.counter.control() as http:
            validation = http.post(f"/episodes/{episode['episode_id']}/validate").json()
            assert validation["score"] == 1.0, validation
            http.delete(f"/episodes/{episode['episode_id']}")


@pytest.fixture(scope="module")
def farm(tmp_path_factory) -> Iterator[Farm]:
    root = tmp_path_factory.mktemp("containment")
    catalog = root / "farm.json"
    up = envscaler("farm", "up", str(rogue_bundle(root / "rogue")), str(counter_bundle(root / "counter")), "--backend", "process",
                   "--catalog", str(catalog), "--memory-mb", str(MEMORY_MB), "--pids", str(TASKS))
    assert up.returncode == 0, up.stderr
    try:
        envs = json.loads(catalog.read_text())["envs"]
        yield Farm(catalog, Env(**envs["rogue"]), Env(**envs["counter"]), root / "farm.json.farm" / "logs" / "rogue.log")
    finally:
        down = envscaler("farm", "down", "--catalog", str(catalog))
        assert down.returncode == 0, down.stderr


def host_uids(catalog: Path) -> dict[int, int]:
    """pid -> host uid of every process that a farm's spawners forked (the workers)."""
    uids = {pid: process_uid(pid) for pid in farm_members(read_state(catalog))["under a server"]}
    return {pid: uid for pid, uid in uids.items() if uid is not None}


def test_environment_code_runs_as_an_unprivileged_user_of_its_own(farm):
    info = farm.rogue.info()["worker_resources"]
    assert info["uid"] >= CONFINED_UID_BASE, info
    result = farm.attack("whoami", {})
    assert not result["isError"], result
    inside = json.loads(result["content"][0]["text"])["data"]
    # Its user namespace maps exactly one user, and that is the unprivileged host uid, never 0.
    assert inside["uid_map"] == [str(info["uid"]), str(info["uid"]), "1"], inside
    uids = host_uids(farm.catalog)
    # Each server's environment worker (and check worker, once it runs): none is root. (Their spawners are
    # root, run none of the environment's code and hold nothing secret.)
    assert len(uids) >= 2 and all(uid >= CONFINED_UID_BASE for uid in uids.values()), uids
    assert len(set(uids.values())) >= 2, "each worker has a user of its own"


@pytest.mark.parametrize("knob", ["vm/swappiness", "kernel/core_pattern", "vm/overcommit_memory"])
def test_kernel_knobs_cannot_be_written(farm, knob):
    before = Path("/proc/sys", knob).read_text()
    result = farm.attack("rewrite_sysctl", {"name": knob})
    assert result["isError"] and ("Permission denied" in result["content"][0]["text"] or "Read-only" in result["content"][0]["text"]), result
    assert Path("/proc/sys", knob).read_text() == before


def test_every_resource_is_counted_in_the_environments_cgroup(farm):
    resources = farm.rogue.info()["worker_resources"]
    assert resources["counted_by"].startswith("cgroup"), resources
    # Each worker (the environment's, the checks') in a group of its own with the environment's limits.
    assert resources["memory_limit_mb"] == 2 * MEMORY_MB and resources["tasks_limit"] == 2 * TASKS, resources
    assert 0 < resources["memory_mb"] < MEMORY_MB and 0 < resources["tasks"] <= TASKS, resources


def test_shared_memory_is_small(farm):
    result = farm.attack("fill_shm", {"mb": 64})
    assert result["isError"] and "No space left" in result["content"][0]["text"], result


def test_a_memfd_beyond_the_limit_costs_only_its_environment(farm):
    result = farm.attack("hold_memfd", {"mb": 2048})
    assert result["isError"], result
    text = result["content"][0]["text"]
    assert "out of memory" in text or "Cannot allocate memory" in text or "No space left" in text, text
    resources = farm.rogue.info()["worker_resources"]
    assert resources["memory_mb"] < MEMORY_MB and resources["oom_kills"] >= 1, resources
    # The environment serves again once its worker is replaced.
    assert farm.attack("whoami", {})["isError"] is False


def test_output_goes_through_the_server_labelled_and_capped(farm):
    result = farm.attack("shout", {"mb": 300})
    assert not result["isError"], result
    log = farm.log.read_text()
    assert len(log) < 2_000_000, len(log)
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    # The line that looked like the server's is the worker's, nested and labelled with its environment.
    assert not any(record.get("event") == "episode lost" and record.get("env") == "counter" for record in records)
    forged = [record for record in records if isinstance(record.get("said"), dict) and record["said"].get("event") == "episode lost"]
    assert forged and all(record["env"] == "rogue" for record in forged), forged
    assert any(record.get("event", "").startswith("environment worker output cut") for record in records), log[-2000:]


def test_threads_past_the_guard_are_bounded_by_the_tasks_limit(farm):
    result = farm.attack("spawn_threads", {"count": 1000})
    assert result["isError"], result
    started = int(json.loads(result["content"][0]["text"])["error"].split(" started")[0])
    assert 0 < started < TASKS, result
    # farm status still answers, and shows what each environment's workers hold.
    status = envscaler("farm", "status", "--catalog", str(farm.catalog), "--all")
    assert status.returncode == 0 and "2/2 healthy" in status.stdout, status.stdout + status.stderr
    rogue = next(line for line in status.stdout.splitlines() if line.startswith("rogue "))
    assert f"/{2 * MEMORY_MB} " in rogue and int(rogue.split()[5]) >= started, status.stdout


def test_catalog_check_runs_gates_and_checks_as_an_unprivileged_user(tmp_path):
    writes = {"check_item": "writes a knob",
              "check_func": "def check_func(final_state):\n    open('/proc/sys/vm/swappiness', 'w').write(open('/proc/sys/vm/swappiness').read())\n    return True"}
    by_solution = counter_scenario(env_id="rogue", task_id="rogue_001",
                                   reference_solution=[{"name": "rewrite_sysctl", "arguments": {"name": "vm/swappiness"}},
                                                       *counter_scenario()["reference_solution"]])
    by_check = counter_scenario(env_id="rogue", task_id="rogue_002",
                                checklist_with_func=[*counter_scenario()["checklist_with_func"], writes])
    # No cgroup counts a gate worker's memory: a memory file, which no address-space limit counts either, is refused.
    by_memfd = counter_scenario(env_id="rogue", task_id="rogue_003",
                                reference_solution=[{"name": "hold_memfd", "arguments": {"mb": 1}}, *counter_scenario()["reference_solution"]])
    bundle = rogue_bundle(tmp_path / "bundles", [by_solution, by_check, by_memfd])
    done = envscaler("catalog", "check", str(bundle), timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rogue_001: reference_runs: call 1 (rewrite_sysctl)" in done.stdout and "Permission denied" in done.stdout, done.stdout
    assert "rogue_002: checks_pass_on_reference" in done.stdout, done.stdout
    assert "rogue_003: reference_runs: call 1 (hold_memfd)" in done.stdout and "Operation not permitted" in done.stdout, done.stdout
