"""A farm run by an unprivileged user: its workers confine themselves without root.

Where the farm runs as root, a worker becomes a user of its own and gets control groups
(``tests/test_containment.py``). Run by anyone else (a researcher's own account), ``envscaler.confine``
takes its other path: the worker stays the farm's user, mapped alone into a user namespace of its own,
with no control group to count its memory, so an address-space limit does. The same attacks must fail
the same way, and the farm must work as well.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from envscaler.sandbox import sandbox_problem
from servers.farm.teardown import farm_processes
from tests.support.bundles import counter_bundle
from tests.support.farm import ancestors_of, farm_members, read_state
from tests.support.hostile import attack, call, common_attacks, hostile_bundle
from tests.support.unprivileged import NOBODY, unprivileged, unprivileged_problem

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}"),
    pytest.mark.skipif(unprivileged_problem() is not None, reason=str(unprivileged_problem())),
]


def status_fields(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)


def address_space_limit(pid: int) -> str:
    line = next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines() if line.startswith("Max address space"))
    return line.split()[3]


def assert_confined(worker: int, server: int) -> None:
    """``worker`` runs as the farm's user, with no capability and no way to gain one, under the seccomp
    policy, in user and network namespaces apart from its server's, its memory limited without a cgroup."""
    fields = status_fields(worker)
    assert {int(uid) for uid in fields["Uid"].split()} == {NOBODY}, fields["Uid"]
    assert (fields["CapEff"], fields["CapPrm"], fields["NoNewPrivs"], fields["Seccomp"]) == ("0" * 16, "0" * 16, "1", "2"), fields
    for namespace in ("user", "net", "pid", "mnt"):
        assert os.readlink(f"/proc/{worker}/ns/{namespace}") != os.readlink(f"/proc/{server}/ns/{namespace}"), namespace
    assert address_space_limit(worker) != "unlimited"


def test_a_farm_run_by_an_unprivileged_user_confines_its_workers_and_holds_hostile_code():
    with unprivileged() as nobody:
        home = nobody.home
        victim = counter_bundle(home / "victim")
        hostile = hostile_bundle(home / "hostile")
        secret = home / "secret.txt"  # one of the user's own files
        secret.write_text("token")
        os.chown(secret, NOBODY, NOBODY)
        secret.chmod(0o600)
        catalog = home / "farm.json"
        up = nobody.envscaler("farm", "up", str(victim), str(hostile), "--backend", "process", "--catalog", str(catalog))
        assert up.returncode == 0, up.stderr
        assert "without a sandbox" not in up.stderr
        state = read_state(catalog)
        try:
            assert state["sandbox"] is True
            members = farm_members(state)
            assert {status_fields(pid)["Uid"].split()[0] for kind in ("daemon", "zygote", "server") for pid in members[kind]} == {str(NOBODY)}

            attacks = common_attacks(catalog, victim)
            attacks["read", json.dumps({"path": str(secret)})] = "No such file"
            attack(catalog, "hostile", "counter", attacks)
            with httpx.Client(timeout=60) as http:
                endpoint = json.loads(catalog.read_text())["envs"]["hostile"]
                created = http.post(f"{endpoint['url']}/episodes", json={"scenario_id": "hostile_001"},
                                    headers={"Authorization": f"Bearer {endpoint['token']}"}).json()
                outside = home / "outside.txt"  # the user may write there; the worker may not
                call(http, created["mcp_url"], "write", {"path": str(outside)})
                assert not outside.exists()

            # Every scenario, validated by the check workers: as a root farm scores them.
            out = home / "replay.jsonl"
            run = nobody.envscaler("run", "--farm", str(catalog), "--agent", "replay", "--out", str(out))
            assert run.returncode == 0, run.stderr
            rewards = [json.loads(line)["reward"] for line in out.read_text().splitlines()]
            assert rewards and set(rewards) == {1.0}, rewards

            servers = {record["pid"] for record in read_state(catalog)["envs"].values()}
            workers: dict[str, list[int]] = {"env-worker": [], "check-worker": []}
            for pid in farm_members(read_state(catalog))["under a server"]:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                if name in workers:
                    workers[name].append(pid)
            assert len(workers["env-worker"]) == 2 and len(workers["check-worker"]) == 2, workers
            for pid in workers["env-worker"] + workers["check-worker"]:
                server = next(server for server in servers if server in ancestors_of(pid))
                assert_confined(pid, server)

            status = nobody.envscaler("farm", "status", "--catalog", str(catalog))
            assert "2/2 healthy, 0 restart(s)" in status.stdout, status.stdout
        finally:
            down = nobody.envscaler("farm", "down", "--catalog", str(catalog))
        assert down.returncode == 0, down.stderr
        assert not farm_processes(state["farm_id"])
