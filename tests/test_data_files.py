"""Data files: ``{"$file": "data/NAME.json"}`` in a scenario's init_config, loaded by the process that runs the
environment's code, once, and shared by every episode that names it; over real HTTP and MCP."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from envscaler import BundleError, EnvRuntime, load_bundle
from envscaler.models import CheckItem
from envscaler.sandbox import sandbox_problem
from tests.support.bundles import write_bundle
from tests.support.data_bundle import CHECK_EMAIL_CHANGED, DIRECTORY_CODE, directory_bundle
from tests.support.hostile import call
from tests.support.server import serve


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory):
    return directory_bundle(tmp_path_factory.mktemp("data"))


def test_a_constructor_that_changes_the_data_changes_only_its_scenarios_state(tmp_path):
    code = DIRECTORY_CODE.replace("self.notes = []", "self.notes = []\n        init_config['users']['user_0']['email'] = 'ctor@example.com'")
    directory = directory_bundle(tmp_path)
    spec = json.loads((directory / "env.json").read_text())
    (directory / "env.json").write_text(json.dumps({**spec, "env_class_code": code}))
    bundle = load_bundle(directory)
    runtime = EnvRuntime(bundle.spec, bundle_dir=bundle.directory)
    first, second = (runtime.new_episode(s.init_config, scenario_key=s.task_id) for s in bundle.scenarios)
    assert first.shares_state and second.shares_state
    assert first.state()["users"]["user_0"]["email"] == "ctor@example.com"
    assert runtime.data_files.load("data/users.json", "a test")["user_0"]["email"] == "user0@example.com"
    # The rest of the file is the file's own content, shared, not a copy.
    assert first._shared.attributes["users"]["user_2"] is runtime.data_files.load("data/users.json", "a test")["user_2"]
    assert first.validate([CheckItem.model_validate(CHECK_EMAIL_CHANGED)]).score == 0.0


@pytest.mark.parametrize("name, problem", [
    ("/etc/passwd", "is not a path inside the bundle's data/ folder"),
    ("data/../env.json", "is not a path inside the bundle's data/ folder"),
    ("users.json", "is not a path inside the bundle's data/ folder"),
    ("data/missing.json", "no such file"),
    ("data/outside.json", "leads out of the bundle's data/ folder"),
    (7, "$file must be a path"),
])
def test_a_bad_reference_is_refused_naming_the_scenario(tmp_path, name, problem):
    directory = directory_bundle(tmp_path)
    (tmp_path / "secret.json").write_text("{}")
    (directory / "data" / "outside.json").symlink_to(tmp_path / "secret.json")
    scenarios = [json.loads(line) for line in (directory / "scenarios.jsonl").read_text().splitlines()]
    scenarios[1]["init_config"]["users"] = {"$file": name}
    write_bundle(tmp_path, json.loads((directory / "env.json").read_text()), scenarios)
    with pytest.raises(BundleError) as caught:
        load_bundle(directory)
    message = str(caught.value)
    assert "scenario 'directory_other'" in message and "init_config.users" in message and problem in message, message
    # The server refuses to start on it: one line, exit 2.
    done = subprocess.run([sys.executable, "-m", "envscaler.cli", "serve", str(directory), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and problem in done.stderr, done.stderr


def test_a_reference_with_other_keys_is_refused(tmp_path):
    directory = directory_bundle(tmp_path)
    scenarios = [json.loads(line) for line in (directory / "scenarios.jsonl").read_text().splitlines()]
    scenarios[0]["init_config"]["users"] = {"$file": "data/users.json", "limit": 3}
    write_bundle(tmp_path, json.loads((directory / "env.json").read_text()), scenarios)
    with pytest.raises(BundleError, match=r"scenario 'directory_email': init_config.users: .* alone, but it also has 'limit'"):
        load_bundle(directory)


@pytest.mark.parametrize("flags", [[], ["--in-process"]], ids=["worker", "in-process"])
def test_episodes_of_two_scenarios_share_the_file_and_keep_their_own_changes(bundle_dir, flags):
    with serve(bundle_dir, *flags) as server, server.client() as http:
        first = http.post("/episodes", json={"scenario_id": "directory_email"}).json()
        second = http.post("/episodes", json={"scenario_id": "directory_other"}).json()
        assert call(http, first["mcp_url"], "get_user", {"user_id": "user_3"})["structuredContent"]["data"]["email"] == "user3@example.com"
        changed = call(http, first["mcp_url"], "set_email", {"user_id": "user_1", "email": "new@example.com"})
        assert not changed["isError"], changed
        state = http.get(f"/episodes/{second['episode_id']}/state").json()["state"]
        assert state["users"]["user_1"]["email"] == "user1@example.com" and state["notes"] == ["other task"] and state["user_count"] == 5
        mine = http.get(f"/episodes/{first['episode_id']}/state").json()["state"]
        assert mine["users"]["user_1"]["email"] == "new@example.com" and mine["notes"] == ["email task"]

        # validate reads initial_state (from the file) and the final state.
        assert http.post(f"/episodes/{first['episode_id']}/validate").json()["score"] == 1.0
        assert http.post(f"/episodes/{second['episode_id']}/validate").json()["score"] == 0.0
        # A new episode of the first scenario starts from the file, and so does a reset.
        third = http.post("/episodes", json={"scenario_id": "directory_email"}).json()
        assert http.get(f"/episodes/{third['episode_id']}/state").json()["state"]["users"]["user_1"]["email"] == "user1@example.com"
        assert http.post(f"/episodes/{first['episode_id']}/reset", json={}).status_code == 200
        reset = http.get(f"/episodes/{first['episode_id']}/state").json()["state"]
        assert reset["users"]["user_1"]["email"] == "user1@example.com"
        hashes = {http.post(f"/episodes/{e['episode_id']}/validate").json()["state_hash"] for e in (first, third)}
        assert len(hashes) == 1

        # A raw init_config may name the file too; a bad name is the request's error.
        raw = http.post("/episodes", json={"init_config": {"users": {"$file": "data/users.json"}}})
        assert raw.status_code == 201, raw.text
        raw_state = http.get(f"/episodes/{raw.json()['episode_id']}/state").json()["state"]
        assert raw_state["users"]["user_4"]["name"] == "User 4"
        refused = http.post("/episodes", json={"init_config": {"users": {"$file": "data/../env.json"}}})
        assert refused.status_code == 422 and "not a path inside the bundle's data/ folder" in refused.json()["error"]


def test_the_gates_see_the_data(bundle_dir):
    done = subprocess.run([sys.executable, "-m", "envscaler.cli", "catalog", "check", str(bundle_dir)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout + done.stderr


HOG_CODE = DIRECTORY_CODE.replace("        self.notes = []", """        self.notes = []
        self._held = [bytearray(init_config.get("hog_mb", 0) * 1024 * 1024)]
        for page in range(0, len(self._held[0]), 4096):
            self._held[0][page] = 1""") + '''
    def hog(self, megabytes: int) -> str:
        """Hold that much more memory.

        Args:
            megabytes (int): How much.
        """
        block = bytearray(megabytes * 1024 * 1024)
        for page in range(0, len(block), 4096):
            block[page] = 1
        self._held.append(block)
        return "held"
'''

contained = pytest.mark.skipif(os.geteuid() != 0 or sandbox_problem() is not None,
                               reason="a worker's memory limit is its control group's: needs root and bubblewrap")


def _hog_bundle(root, count: int = 5):
    directory = directory_bundle(root, count=count, padding=40)
    spec = json.loads((directory / "env.json").read_text())
    scenarios = [json.loads(line) for line in (directory / "scenarios.jsonl").read_text().splitlines()]
    scenarios.append({**scenarios[0], "task_id": "directory_hog", "init_config": {**scenarios[0]["init_config"], "hog_mb": 400}})
    return write_bundle(root, {**spec, "env_class_code": HOG_CODE}, scenarios)


@contained
def test_running_out_of_memory_says_so_with_the_limit_to_raise(tmp_path):
    log = tmp_path / "server.log"
    with log.open("w") as sink, serve(_hog_bundle(tmp_path), "--worker-memory-mb", "128", log=sink) as server, server.client() as http:
        created = http.post("/episodes", json={"scenario_id": "directory_hog"})
        assert created.status_code == 507, created.text
        said = created.json()["error"]
        for part in ("directory: episode ", "out of memory building the episode", "128 MB", "--worker-memory-mb"):
            assert part in said, said
        episode = http.post("/episodes", json={"scenario_id": "directory_email"}).json()
        result = call(http, episode["mcp_url"], "hog", {"megabytes": 400})
        text = result["content"][0]["text"]
        assert result["isError"], result
        for part in (f"directory: episode {episode['episode_id']}", "out of memory in tool 'hog'", "128 MB", "--worker-memory-mb"):
            assert part in text, text
        # The episode goes on from before the call.
        assert call(http, episode["mcp_url"], "get_user", {"user_id": "user_1"})["structuredContent"]["success"]
    logged = log.read_text()
    assert "environment out of memory" in logged and episode["episode_id"] in logged, logged[-3000:]


@contained
def test_a_data_file_that_does_not_fit_stops_the_server_at_its_start_saying_so(tmp_path):
    bundle = directory_bundle(tmp_path, count=300_000, padding=40)
    done = subprocess.run([sys.executable, "-m", "envscaler.cli", "serve", str(bundle), "--port", "0", "--worker-memory-mb", "64"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    for part in ("directory", "out of memory", "64 MB", "--worker-memory-mb"):
        assert part in last, done.stderr[-3000:]


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")
def test_a_check_worker_that_cannot_start_is_an_environment_error_not_a_timeout(tmp_path):
    # Its sandbox shows the bundle's data folder, gone meanwhile: the check worker ends before it says hello.
    bundle = directory_bundle(tmp_path)
    with serve(bundle) as server, server.client() as http:
        episode = http.post("/episodes", json={"scenario_id": "directory_email"}).json()["episode_id"]
        (bundle / "data").rename(bundle / "data.away")
        failed = http.post(f"/episodes/{episode}/validate")
        assert failed.status_code == 500, failed.text
        assert "the check worker ended before it answered" in failed.json()["error"] and "outlived" not in failed.json()["error"]
        (bundle / "data.away").rename(bundle / "data")
        assert http.post(f"/episodes/{episode}/validate").json()["checks"], "the next validation starts the check worker again"
