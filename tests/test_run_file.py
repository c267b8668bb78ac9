"""A run's file and its episodes under trouble: a full disk, a second run on the same file, a killed harness."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.bundles import write_bundle
from tests.support.cli import envscaler
from tests.support.server import RunningServer, serve

BIG_CODE = '''
class Pages:
    def __init__(self, init_config: dict):
        self.read = 0

    def page(self, n: int) -> str:
        """Read a long page.

        Args:
            n (int): How many characters.
        """
        self.read += 1
        return "p" * n
'''


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> Iterator[tuple[RunningServer, Path]]:
    root = tmp_path_factory.mktemp("pages")
    spec = {"env_id": "pages", "env_class_name": "Pages", "env_class_code": BIG_CODE, "environment_introduction": "Long pages."}
    scenario = {"task_id": "pages_001", "env_id": "pages", "env_class_name": "Pages", "init_config": {}, "task": "Read a page.",
                "checklist_with_func": [{"check_item": "read", "check_func": "def check_func(final_state):\n    return final_state['read'] == 1"}],
                "reference_solution": [{"name": "page", "arguments": {"n": 40_000}}]}
    with serve(write_bundle(root / "bundles", spec, [scenario])) as server:
        catalog = root / "farm.json"
        catalog.write_text(json.dumps({"envs": {"pages": {"url": server.url, "token": server.token}}}))
        yield server, catalog


def live_episodes(server: RunningServer) -> list[str]:
    with server.client() as http:
        return http.get("/episodes").json()["episodes"]


def records_of(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n"), "a torn last line"
    return [json.loads(line) for line in data.splitlines()]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (.ci/run is root)")
def test_a_full_disk_ends_the_run_cleanly_and_a_rerun_finishes_it(pages, tmp_path):
    server, catalog = pages
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=True)
    try:
        out = disk / "run.jsonl"
        args = ("run", "--farm", str(catalog), "--agent", "replay", "--repeats", "6", "--concurrency", "1", "--out", str(out))
        full = envscaler(*args)
        assert full.returncode == 1, full.stderr
        errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "No space left on device" in errors[0] and "run the same command again" in errors[0], full.stderr
        assert "Traceback" not in full.stderr and "a bug" not in full.stderr
        written = records_of(out)
        assert 1 <= len(written) < 6 and all(record["reward"] == 1.0 for record in written)
        assert live_episodes(server) == []  # the episode in flight was ended, not left to the lease
        # Room again: the same command runs only what is missing.
        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        again = envscaler(*args)
        assert again.returncode == 0, again.stderr
        finished = records_of(out)
        assert sorted(record["repeat"] for record in finished) == list(range(6)), [r["repeat"] for r in finished]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_second_run_on_the_same_file_is_refused_while_the_first_holds_it(pages, tmp_path):
    _, catalog = pages
    out = tmp_path / "run.jsonl"
    args = [sys.executable, "-m", "envscaler.cli", "run", "--farm", str(catalog), "--agent", "command", "--command", "/bin/sleep 3",
            "--out", str(out)]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not out.with_name(f".{out.name}.lock").exists():
            assert time.monotonic() < deadline and first.poll() is None, first.stderr.read() if first.stderr else ""
            time.sleep(0.05)
        second = envscaler(*args[3:])
        assert second.returncode == 2, second.stderr
        assert f"another run (pid {first.pid}) is writing {out}" in second.stderr, second.stderr
    finally:
        first.wait(60)
    assert first.returncode == 0, first.stderr.read() if first.stderr else ""
    assert len(records_of(out)) == 1
    assert not out.with_name(f".{out.name}.lock").exists()


def test_the_episodes_of_a_killed_harness_end_after_its_lease(pages, tmp_path):
    server, catalog = pages
    before = set(live_episodes(server))
    harness = subprocess.Popen([sys.executable, "-m", "envscaler.cli", "run", "--farm", str(catalog), "--agent", "command",
                                "--command", "/bin/sleep 300", "--repeats", "3", "--lease", "2", "--out", str(tmp_path / "run.jsonl")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(set(live_episodes(server)) - before) < 3:
            assert time.monotonic() < deadline and harness.poll() is None
            time.sleep(0.2)
        time.sleep(3)  # past one lease: the live harness renews them
        assert len(set(live_episodes(server)) - before) == 3
    finally:
        os.killpg(harness.pid, signal.SIGKILL)  # the harness and its agents, with no chance to end anything
        harness.wait()
    # The server's reaper runs every few seconds: the lease (2 s) plus that, and some slack for a busy machine.
    deadline = time.monotonic() + 30
    while set(live_episodes(server)) - before:
        assert time.monotonic() < deadline, live_episodes(server)
        time.sleep(0.5)
    with httpx.Client(timeout=30) as http:
        info = http.get(f"{server.url}/info", headers={"Authorization": f"Bearer {server.token}"}).json()
    assert info["expired_episodes"] >= 3
