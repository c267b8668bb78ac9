"""``envscaler serve --check-idle``: the check worker holds no memory while an environment is not validating.

Real servers and real workers (sandboxed where they can confine themselves). The check worker starts at the first
validation and stops once it has been idle for ``--check-idle`` seconds; the next validation starts it
again and scores as the first did. A validation is never cut short by the stop, however long its
checks run, and a stop is no worker restart in the server's counts.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from servers.workers.spawner import worker_name
from tests.support.bundles import counter_bundle
from tests.support.farm import ancestors_of, counter_farm, parent_of, read_state
from tests.support.hostile import call
from tests.support.server import RunningServer, serve

pytestmark = pytest.mark.timeout(120)

IDLE_S = 1.0
CHECK_WORKER = worker_name("servers.workers.check_worker")


def check_workers(server: RunningServer) -> list[int]:
    """The processes under ``server`` that run the check worker (and its check children)."""
    return server_check_workers(server.process.pid)


def the_check_worker(server: RunningServer) -> list[int]:
    """The check worker itself under ``server``, not the check children it forks: a used child is replaced by a
    new one, and one that has just ended is no longer there to ask for its parent."""
    workers = check_workers(server)
    parents = {}
    for pid in workers:
        try:
            parents[pid] = parent_of(pid)
        except FileNotFoundError:
            continue
    return [pid for pid, parent in parents.items() if parent not in workers]


def server_check_workers(server: int) -> list[int]:
    """The processes under the server whose pid is ``server`` that run the check worker."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if (entry / "comm").read_text().strip() != CHECK_WORKER:
                continue
            under = server in ancestors_of(pid)
        except (OSError, AttributeError):
            continue  # gone meanwhile
        if under:
            found.append(pid)
    return found


def wait_for_no_check_worker(server: RunningServer, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while check_workers(server):
        assert time.monotonic() < deadline, f"the check worker still runs {within_s:g} s after its last validation"
        time.sleep(0.2)


def new_episode(http: httpx.Client, added: int) -> str:
    """A new episode of the counter's first scenario, ``added`` added to its item a."""
    created = http.post("/episodes", json={"scenario_id": "counter_001"})
    assert created.status_code == 201, created.text
    result = call(http, created.json()["mcp_url"], "add", {"item_id": "a", "amount": added})
    assert not result["isError"], result
    return created.json()["episode_id"]


def restarts(http: httpx.Client) -> int:
    return http.get("/info").json()["worker_restarts"]


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    return counter_bundle(tmp_path)


def test_a_validation_after_the_check_worker_stopped_scores_as_before(bundle):
    with serve(bundle, "--check-idle", f"{IDLE_S:g}") as server, server.client() as http:
        assert check_workers(server) == []  # no check capacity before the first validation
        passing, failing = new_episode(http, 3), new_episode(http, 1)
        first = {episode: http.post(f"/episodes/{episode}/validate").json() for episode in (passing, failing)}
        assert first[passing]["score"] == 1.0 and first[failing]["score"] < 1.0, first
        assert check_workers(server)
        for _ in range(2):  # stopped, started by a validation, stopped again
            wait_for_no_check_worker(server, IDLE_S + 10)
            again = {episode: http.post(f"/episodes/{episode}/validate").json() for episode in (failing, passing)}
            assert again == first
        assert restarts(http) == 0


def test_the_check_worker_is_not_stopped_while_it_runs_a_validation(bundle):
    slow = {"check_item": "slow", "check_func": "def check_func(final_state):\n    import time\n    time.sleep(3)\n"
            "    return final_state['items']['a']['count'] == 3"}
    with serve(bundle, "--check-idle", "0.5", "--check-timeout", "10") as server, server.client() as http:
        episode = new_episode(http, 3)
        for _ in range(2):  # on the first validation's worker, then on one started after it stopped
            answer = http.post(f"/episodes/{episode}/validate", json={"checklist": [slow]})
            assert answer.status_code == 200, answer.text
            assert [(check["passed"], check["error"]) for check in answer.json()["checks"]] == [(True, None)], answer.text
            wait_for_no_check_worker(server, 0.5 + 10)
        assert restarts(http) == 0


def test_check_idle_zero_never_stops_the_check_worker(bundle):
    with serve(bundle, "--check-idle", "0") as server, server.client() as http:
        episode = new_episode(http, 3)
        assert http.post(f"/episodes/{episode}/validate").json()["score"] == 1.0
        (worker,) = the_check_worker(server)
        time.sleep(3 * IDLE_S)  # 0 is "never", not "at once": the same worker is still there
        assert worker in check_workers(server)
        assert http.post(f"/episodes/{episode}/validate").json()["score"] == 1.0 and restarts(http) == 0


def test_farm_up_passes_check_idle_to_its_servers(tmp_path):
    with counter_farm(tmp_path, "--check-idle", f"{IDLE_S:g}") as catalog:
        (env,) = catalog["envs"].values()
        with httpx.Client(base_url=env["url"], headers={"Authorization": f"Bearer {env['token']}"}, timeout=30) as http:
            episode = new_episode(http, 3)
            assert http.post(f"/episodes/{episode}/validate").json()["score"] == 1.0
            state = read_state(tmp_path / "farm.json")
            server = next(iter(state["envs"].values()))["pid"]
            assert server_check_workers(server), "a validation starts the server's check worker"
            deadline = time.monotonic() + IDLE_S + 10
            while server_check_workers(server):
                assert time.monotonic() < deadline, "the farm's server kept its idle check worker past --check-idle"
                time.sleep(0.2)
            assert restarts(http) == 0
