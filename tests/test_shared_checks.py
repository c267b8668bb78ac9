"""``farm up --envs-per-server N``: the environments of one server process share its check worker.

A real farm (process backend, sandboxed where it can confine itself) of three counter environments in one
server. One check worker serves the three; each validation still runs in a process of its own, forked
at once, so that one environment's slow checks hold up none of the others', and no check can end or
reach the processes of the others' validations, or the zygote that forks them.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from envscaler.bundle import load_bundle
from envscaler.errors import ChecklistError
from envscaler.models import CheckItem
from envscaler.sandbox import sandbox_problem
from servers.workers.checks import CheckWorker
from servers.workers.wire import CheckRequest, CheckResults, decode
from tests.support.bundles import counter_scenario, counter_spec, write_bundle
from tests.support.farm import process_farm, read_state
from tests.test_check_idle import new_episode, server_check_workers

pytestmark = pytest.mark.timeout(180)

ENV_IDS = ["counter_a", "counter_b", "counter_c"]
SLOW_CHECK_S = 4.0
SLOW = {"check_item": "slow", "check_func": f"def check_func(final_state):\n    import time\n    time.sleep({SLOW_CHECK_S})\n    return True"}
# Checks that try to end every other process of their user (the zygote and the other validations' processes),
# and to reach the zygote's memory.
REACHING = [
    {"check_item": "kill all", "check_func": "def check_func(final_state):\n    import os, signal\n    os.kill(-1, signal.SIGKILL)\n    return True"},
    {"check_item": "kill zygote", "check_func": "def check_func(final_state):\n    import os, signal\n    os.kill(os.getppid(), signal.SIGTERM)\n"
     "    return True"},
    {"check_item": "zygote memory", "check_func": "def check_func(final_state):\n    import os\n"
     "    with open(f'/proc/{os.getppid()}/mem', 'rb'):\n        return True"},
]


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_checks")
    for env_id in ENV_IDS:
        write_bundle(root / "bundles", counter_spec(env_id=env_id), [counter_scenario(env_id=env_id)])
    # Never stopped when idle: the last test finds the one the first started.
    with process_farm(root, [root / "bundles"], "--envs-per-server", "3", "--check-timeout", "10", "--check-idle", "0") as catalog:
        yield catalog


def clients(catalog: Path) -> dict[str, httpx.Client]:
    envs = json.loads(catalog.read_text())["envs"]
    return {env_id: httpx.Client(base_url=env["url"], headers={"Authorization": f"Bearer {env['token']}"}, timeout=60)
            for env_id, env in envs.items()}


def episode(http: httpx.Client) -> str:
    """A new episode of the counter's scenario, nothing done in it."""
    created = http.post("/episodes", json={"scenario_id": "counter_001"})
    assert created.status_code == 201, created.text
    return created.json()["episode_id"]


def zygotes(catalog: Path) -> list[int]:
    """The check workers (not their children) under the farm's one server."""
    (server,) = {record["pid"] for record in read_state(catalog)["envs"].values()}
    found = server_check_workers(server)
    return [pid for pid in found if _parent(pid) not in found and _state(pid) != "Z"]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_the_environments_of_a_server_share_one_check_worker_and_score_as_alone(farm):
    http = clients(farm)
    scores = {}
    for env_id, client in http.items():
        scores[env_id] = client.post(f"/episodes/{new_episode(client, 3)}/validate").json()["score"]
    assert scores == dict.fromkeys(ENV_IDS, 1.0)
    assert len(zygotes(farm)) == 1
    # The first scenario's checks on an episode that added nothing: a counts 0 (fails), the other two pass.
    untouched = http["counter_b"].post(f"/episodes/{episode(http['counter_b'])}/validate").json()
    assert [check["passed"] for check in untouched["checks"]] == [False, True, True], untouched


def test_slow_checks_of_one_environment_hold_up_no_other(farm):
    http = clients(farm)
    slow_episode = episode(http["counter_a"])
    with ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        slow = pool.submit(http["counter_a"].post, f"/episodes/{slow_episode}/validate", json={"checklist": [SLOW]})
        time.sleep(0.5)  # its child forked and sleeping
        for env_id in ("counter_b", "counter_c"):
            fast = http[env_id].post(f"/episodes/{new_episode(http[env_id], 3)}/validate")
            assert fast.status_code == 200 and fast.json()["score"] == 1.0, fast.text
            assert not slow.done(), "the slow validation ended before the others could be asked"
        assert slow.result().json()["checks"][0]["passed"], slow.result().text
        assert time.monotonic() - started >= SLOW_CHECK_S


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")
def test_checks_cannot_end_or_reach_the_zygote_or_another_validation(farm):
    http = clients(farm)
    (zygote,) = zygotes(farm)
    slow_episode = episode(http["counter_c"])
    with ThreadPoolExecutor(1) as pool:
        # Another environment's validation, running while the checks below try to end every process they can.
        slow = pool.submit(http["counter_c"].post, f"/episodes/{slow_episode}/validate", json={"checklist": [SLOW]})
        time.sleep(0.5)
        reaching = http["counter_a"].post(f"/episodes/{episode(http['counter_a'])}/validate", json={"checklist": REACHING})
        assert reaching.status_code == 200, reaching.text
        errors = [check["error"] or "" for check in reaching.json()["checks"]]
        assert errors[0].startswith("PermissionError: [Errno 1] Operation not permitted"), errors
        assert errors[1].startswith("PermissionError: [Errno 1] Operation not permitted"), errors
        assert errors[2].startswith("PermissionError: [Errno 13] Permission denied"), errors
        survived = slow.result()
        assert survived.status_code == 200 and survived.json()["checks"][0]["passed"], survived.text
    assert zygotes(farm) == [zygote]


def test_a_check_worker_answers_only_for_its_own_environments(tmp_path):
    # A worker of its own (unsandboxed: a fresh interpreter), outside any farm: what a server asks of it for an
    # environment it was not made for is refused, by the server's side and by the worker's.
    write_bundle(tmp_path, counter_spec(), [counter_scenario()])
    worker = CheckWorker([(load_bundle(tmp_path / "counter"), 10.0)], sandbox=False, idle_s=None)
    with pytest.raises(ValueError, match="not for 'counter_b'"):
        worker.joins("counter_b")
    worker.joins("counter")
    checklist = [CheckItem(check_item="true", check_func="def check_func(final_state):\n    return True")]

    async def ask(env_id: str) -> CheckResults:
        request = CheckRequest(env_id=env_id, handle="episode", checklist=checklist, final={"items": {}}, initial={"items": {}})
        return decode(CheckResults, await worker.ask(request, 10.0))

    async def scenario() -> None:
        try:
            assert [check.passed for check in (await ask("counter")).checks] == [True]
            with pytest.raises(ChecklistError, match="holds no environment 'counter_b'"):
                await ask("counter_b")
            assert [check.passed for check in (await ask("counter")).checks] == [True]  # the same worker, still serving
        finally:
            worker.leaves("counter")

    asyncio.run(scenario())


ROOMY = 20  # environments validating at once, for a check worker whose group holds 16 tasks: itself and 15 children at most
ROOM_CHECK_S = 3.0


def test_validations_beyond_the_check_workers_task_limit_wait_for_room(tmp_path):
    # More validations at once than the check worker's control group may have processes: those it cannot fork a
    # process for are asked again as the others end. None fails, none waits in vain, and the worker is not restarted.
    env_ids = [f"counter_{number:02d}" for number in range(ROOMY)]
    for env_id in env_ids:
        write_bundle(tmp_path / "bundles", counter_spec(env_id=env_id), [counter_scenario(env_id=env_id)])
    sleepy = {"check_item": "sleepy", "check_func": f"def check_func(final_state):\n    import time\n    time.sleep({ROOM_CHECK_S})\n    return True"}
    with process_farm(tmp_path, [tmp_path / "bundles"], "--envs-per-server", str(ROOMY), "--pids", "16", "--check-timeout", "30",
                      "--check-idle", "0") as catalog:
        http = clients(catalog)
        episodes = {env_id: episode(http[env_id]) for env_id in env_ids}
        http[env_ids[0]].post(f"/episodes/{episodes[env_ids[0]]}/validate").raise_for_status()  # the check worker started
        (zygote,) = zygotes(catalog)
        started = time.monotonic()
        with ThreadPoolExecutor(ROOMY) as pool:
            answers = list(pool.map(lambda env_id: http[env_id].post(f"/episodes/{episodes[env_id]}/validate", json={"checklist": [sleepy]}),
                                    env_ids))
        assert [(answer.status_code, answer.json().get("score")) for answer in answers] == [(200, 1.0)] * ROOMY, \
            [answer.text for answer in answers if answer.status_code != 200]
        assert time.monotonic() - started >= 2 * ROOM_CHECK_S  # some waited for others to end: never 20 processes at once
        assert zygotes(catalog) == [zygote]
