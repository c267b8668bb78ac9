"""``envscaler run --procs N`` on a real process farm: worker processes, one output file, resume, a worker's death."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest

from agent_client.agents import ReplayAgent
from agent_client.errors import HarnessError, TransportError
from agent_client.models import load_farm_catalog
from agent_client.runner import RunOptions, run
from tests.support.cli import envscaler
from tests.support.farm import counter_farm
from tests.support.openai_replay import ReplayServer


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    """A process farm of the counter environment (two scenarios); yields its catalog file."""
    root = tmp_path_factory.mktemp("procs")
    with counter_farm(root):
        yield root / "farm.json"


def keys(path: Path) -> list[tuple[str, str, int]]:
    return [(r["env_id"], r["task_id"], r["repeat"]) for r in map(json.loads, path.read_text().splitlines())]


def live_episodes(catalog: Path) -> set[str]:
    """The episodes the farm's server holds now (a killed worker's stay there until their lease ends)."""
    endpoint = json.loads(catalog.read_text())["envs"]["counter"]
    reply = httpx.get(f"{endpoint['url']}/episodes", headers={"Authorization": f"Bearer {endpoint['token']}"})
    reply.raise_for_status()
    return set(reply.json()["episodes"])


def test_two_processes_write_every_episode_once_and_the_summary_of_one(farm, tmp_path):
    summaries = {}
    for procs in ("1", "2"):
        out = tmp_path / f"procs{procs}.jsonl"
        done = envscaler("run", "--farm", str(farm), "--agent", "replay", "--out", str(out), "--repeats", "6",
                         "--concurrency", "4", "--procs", procs)
        assert done.returncode == 0, done.stderr
        written = keys(out)
        assert sorted(written) == sorted((("counter", task, r) for task in ("counter_001", "counter_002") for r in range(6)))
        summaries[procs] = done.stdout.replace(str(out), "OUT")
    assert summaries["1"] == summaries["2"]
    assert "worker" not in done.stderr


def test_an_interrupted_two_process_run_ends_its_episodes_and_resumes_without_duplicates(farm, tmp_path):
    out = tmp_path / "out.jsonl"
    before = live_episodes(farm)
    args = ("run", "--farm", str(farm), "--agent", "replay", "--out", str(out), "--repeats", "60",
            "--concurrency", "4", "--procs", "2", "--quiet")
    # Its own session, as a terminal's foreground job: Ctrl-C is a SIGINT to it alone, never to its workers.
    run = subprocess.Popen([sys.executable, "-m", "envscaler.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and len(out.read_bytes().splitlines()) >= 4):
            assert run.poll() is None and time.monotonic() < deadline, "the run wrote no records"
            time.sleep(0.05)
        run.send_signal(signal.SIGINT)
        _, stderr = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, stderr
    raw = out.read_bytes()
    assert raw.endswith(b"\n")  # whole records only
    first = keys(out)
    assert 4 <= len(first) < 120 and len(set(first)) == len(first)
    assert live_episodes(farm) <= before  # ended by the workers, not left to the lease
    resumed = envscaler(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming: {len(first)} record(s)" in resumed.stderr
    after = keys(out)
    assert len(after) == 120 and len(set(after)) == 120
    assert after[:len(first)] == first
    # The summary counts what it resumed from as well as what it ran (without reading the file again).
    assert "120 episode(s)" in resumed.stdout, resumed.stdout


def harness_workers(parent: int | None = None) -> list[int]:
    """The children of ``parent`` (this process by default) that are harness worker processes (``python -m agent_client.worker``)."""
    tasks = Path(f"/proc/{parent or os.getpid()}/task")
    children = [pid for task in tasks.iterdir() for pid in (task / "children").read_text().split()]
    return [int(pid) for pid in children if b"agent_client.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has: only its exit status is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_the_workers_of_a_run_that_is_killed_end_their_episodes_at_once(farm, tmp_path):
    before = live_episodes(farm)
    args = ("run", "--farm", str(farm), "--agent", "command", "--command", f"{sys.executable} -c 'import time; time.sleep(600)'",
            "--out", str(tmp_path / "out.jsonl"), "--concurrency", "2", "--procs", "2", "--quiet")
    run = subprocess.Popen([sys.executable, "-m", "envscaler.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(live_episodes(farm) - before) < 2:
            assert run.poll() is None and time.monotonic() < deadline, "the run started no episodes"
            time.sleep(0.05)
        workers = harness_workers(run.pid)
        assert len(workers) == 2
    finally:
        run.kill()
        run.wait()
    # Their records could no longer be written: the workers end their episodes on the farm and exit, long
    # before the agents' 600 s.
    deadline = time.monotonic() + 30
    while any(map(running, workers)) or live_episodes(farm) - before:
        assert time.monotonic() < deadline, (workers, live_episodes(farm) - before)
        time.sleep(0.1)


def test_a_worker_that_dies_is_reported_and_its_episode_recorded_as_an_infra_error(farm, tmp_path):
    out = tmp_path / "out.jsonl"
    # The command agent is a child of the worker running its episode: on counter_002 it kills that worker.
    command = f"{sys.executable} -c \"import os, sys; sys.argv[1] == 'counter_002' and os.kill(os.getppid(), 9)\" {{task_id}}"
    done = envscaler("run", "--farm", str(farm), "--agent", "command", "--command", command, "--out", str(out),
                     "--concurrency", "2", "--procs", "2")
    assert done.returncode == 1, done.stderr
    assert "was killed by signal SIGKILL with 1 episode(s) in flight" in done.stderr
    by_task = {r["task_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(by_task) == ["counter_001", "counter_002"]
    assert by_task["counter_001"]["termination"] == "finished"
    lost = by_task["counter_002"]
    assert lost["termination"] == "infra_error" and "was killed by signal SIGKILL" in lost["error"]
    assert "1 x the harness's worker" in done.stderr  # the summary's infra reasons name it too


def test_a_run_whose_every_worker_dies_stops_with_exit_1_and_says_what_was_not_run(farm, tmp_path):
    out = tmp_path / "out.jsonl"
    command = f"{sys.executable} -c \"import os; os.kill(os.getppid(), 9)\""
    done = envscaler("run", "--farm", str(farm), "--agent", "command", "--command", command, "--out", str(out),
                     "--repeats", "3", "--concurrency", "2", "--procs", "2")
    assert done.returncode == 1, done.stderr
    assert "every worker process died; 4 episode(s) were not run" in done.stderr
    written = list(map(json.loads, out.read_text().splitlines()))
    assert len(written) == 2 and all(r["termination"] == "infra_error" for r in written)


def test_the_openai_agent_runs_in_worker_processes(farm, tmp_path):
    out = tmp_path / "out.jsonl"
    with ReplayServer({"agent": [{"content": "Nothing to do."}] * 4}) as server:
        done = envscaler("run", "--farm", str(farm), "--agent", "openai", "--base-url", server.base_url, "--model", "agent",
                         "--scenario", "counter/counter_001", "--repeats", "4", "--out", str(out), "--procs", "2",
                         "--concurrency", "2", "--retries", "0")
        asked = len(server.requests_for("agent"))
    assert done.returncode == 0, done.stderr
    written = list(map(json.loads, out.read_text().splitlines()))
    assert sorted(r["repeat"] for r in written) == [0, 1, 2, 3] and asked == 4
    assert all(r["termination"] == "finished" and r["model"] == "agent" and r["usage"]["requests"] == 1 for r in written)


def test_an_agent_factory_that_cannot_reach_a_worker_process_is_refused_before_any_episode(farm, tmp_path):
    out = tmp_path / "out.jsonl"
    options = RunOptions(repeats=2, concurrency=2, progress=False, procs=2)
    before = live_episodes(farm)
    with pytest.raises(HarnessError, match="cannot be sent to a worker process"):
        anyio.run(lambda: run(load_farm_catalog(farm), lambda: ReplayAgent(), out, options=options))
    assert out.read_text() == "" and live_episodes(farm) <= before
    # The worker processes, started before the scenarios were listed, are gone with the run.
    assert harness_workers() == []


def test_a_run_whose_farm_cannot_be_listed_leaves_no_worker_process(farm, tmp_path):
    catalog = load_farm_catalog(farm)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: a connection to it is refused
    try:
        endpoint = catalog.envs["counter"].model_copy(update={"url": f"http://127.0.0.1:{closed.getsockname()[1]}"})
        unreachable = catalog.model_copy(update={"envs": {"counter": endpoint}})
        options = RunOptions(concurrency=4, progress=False, procs=3)
        with pytest.raises(TransportError):
            anyio.run(lambda: run(unreachable, ReplayAgent, tmp_path / "out.jsonl", options=options))
    finally:
        closed.close()
    assert harness_workers() == []


def test_a_run_with_fewer_episodes_than_processes_runs_each_once(farm, tmp_path):
    out = tmp_path / "out.jsonl"
    scores = anyio.run(lambda: run(load_farm_catalog(farm), ReplayAgent, out, options=RunOptions(concurrency=8, progress=False, procs=6)))
    assert sorted((s.task_id, s.reward) for s in scores) == [("counter_001", 1.0), ("counter_002", 1.0)]
    assert sorted(keys(out)) == [("counter", "counter_001", 0), ("counter", "counter_002", 0)]
    assert harness_workers() == []
