"""Records that hold any text and never break: real runs, resumes, exports, a kill during repair.

Also the server side of the same text (lone surrogates, deep nesting), the size caps, extra
arguments, and what a command agent can see.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agent_client.models import Record
from agent_client.runner import record_line
from envscaler import EnvRuntime
from envscaler.bundle import load_bundle, save_bundle
from envscaler.jsonl import dumps, read_values
from envscaler.models import EnvSpec
from tests.support.bundles import counter_scenario, counter_spec, write_bundle
from tests.support.cli import envscaler
from tests.support.openai_replay import ReplayServer
from tests.support.server import serve

# Every character that broke a record: three line breaks to str.splitlines, and a lone surrogate.
HOSTILE = "a\u2028b\u2029c\x85d\udfffe"

TEXTS_CODE = '''
class Texts:
    def __init__(self, init_config: dict):
        self.notes = []

    def odd(self) -> str:
        """Answer with line-break characters and a lone surrogate."""
        return "a\\u2028b\\u2029c\\x85d\\udfffe"

    def note(self, text: str) -> dict:
        """Keep a note and echo it.

        Args:
            text (str): The note.
        """
        self.notes.append(text)
        return {"success": True, "data": text}

    def big(self, n: int) -> str:
        """A long answer.

        Args:
            n (int): How many characters.
        """
        return "x" * n
'''


def texts_bundle(root: Path) -> Path:
    spec = {"env_id": "texts", "env_class_name": "Texts", "env_class_code": TEXTS_CODE,
            "environment_introduction": "Notes of any text."}
    scenario = {"task_id": "texts_001", "env_id": "texts", "env_class_name": "Texts", "init_config": {},
                "task": "Keep the odd note.",
                "checklist_with_func": [{"check_item": "kept", "check_func": "def check_func(final_state):\n    return len(final_state['notes']) == 1"}],
                "reference_solution": [{"name": "odd", "arguments": {}}, {"name": "note", "arguments": {"text": HOSTILE}}]}
    return write_bundle(root, spec, [scenario])


@pytest.fixture(scope="module")
def texts_farm(tmp_path_factory):
    root = tmp_path_factory.mktemp("texts")
    with serve(texts_bundle(root / "bundles"), "--max-result-chars", "1000", "--max-trajectory-chars", "2500") as server:
        catalog = root / "farm.json"
        catalog.write_text(json.dumps({"envs": {"texts": {"url": server.url, "token": server.token}}}))
        yield server, catalog


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def test_hostile_text_survives_run_resume_and_export(texts_farm, tmp_path):
    _, catalog = texts_farm
    out = tmp_path / "run.jsonl"
    args = ("run", "--farm", str(catalog), "--agent", "replay", "--out", str(out))
    done = envscaler(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    raw = out.read_bytes()
    for encoded in ("\u2028".encode(), "\u2029".encode(), "\x85".encode()):
        assert encoded not in raw  # escaped, so no reader can see a line break there
    [line] = lines_of(out)
    record = json.loads(line)
    assert record["reward"] == 1.0 and record["termination"] == "finished"
    assert [c["result"] for c in record["trajectory"]] == [HOSTILE, {"success": True, "data": HOSTILE}]
    assert record["trajectory"][1]["arguments"] == {"text": HOSTILE}
    assert [m["content"] for m in record["messages"] if m["role"] == "tool"][0] == HOSTILE

    before = out.read_bytes()
    resumed = envscaler(*args)
    assert resumed.returncode == 0 and "resuming: 1 record(s)" in resumed.stderr
    assert out.read_bytes() == before  # nothing taken for torn, nothing run again

    sft = tmp_path / "sft.jsonl"
    exported = envscaler("export", "--in", str(out), "--out", str(sft))
    assert exported.returncode == 0 and "wrote 1 of 1" in exported.stdout, exported.stderr
    [item] = [value for _, value in read_values(sft)]
    assert [m["content"] for m in item["messages"] if m["role"] == "tool"][0] == HOSTILE


def test_a_model_reply_with_a_lone_surrogate_is_recorded_and_the_run_goes_on(texts_farm, tmp_path):
    _, catalog = texts_farm
    script = [{"content": "thinking \udfff about \u2028 it", "tool_calls": [{"name": "note", "arguments": {"text": "x\ud800y\u2029"}}]},
              {"content": "done \udfff"}]
    out = tmp_path / "run.jsonl"
    with ReplayServer({"agent": script}) as model:
        done = envscaler("run", "--farm", str(catalog), "--agent", "openai", "--base-url", model.base_url, "--model", "agent",
                         "--out", str(out), "--retries", "0")
        second = model.requests_for("agent")[1]["messages"]
    assert done.returncode == 0, done.stderr[-2000:]
    [record] = [json.loads(line) for line in lines_of(out)]
    assert record["termination"] == "finished" and record["reward"] == 1.0
    assert record["replaced_surrogates"] == 3
    assistant = [m for m in record["messages"] if m["role"] == "assistant"]
    assert assistant[0]["content"] == "thinking \ufffd about \u2028 it" and assistant[1]["content"] == "done \ufffd"
    # Arguments are JSON text: the model wrote the surrogate as an escape, which any request can carry.
    assert json.loads(assistant[0]["tool_calls"][0]["function"]["arguments"]) == {"text": "x\ud800y\u2029"}
    assert record["trajectory"][0]["arguments"] == {"text": "x\ud800y\u2029"}
    assert [m["content"] for m in record["messages"] if m["role"] == "tool"] == ['{"success":true,"data":"x\ufffdy\u2029"}']
    assert second[2]["content"] == "thinking \ufffd about \u2028 it"  # what the model was sent back


def test_a_record_that_cannot_be_serialised_becomes_an_error_record():
    record = Record(env_id="e", task_id="t", repeat=0, agent="replay", termination="finished", reward=1.0,
                    started_at=1.0, duration_s=2.0, messages=[{"role": "tool", "content": object()}])
    stand_in = json.loads(record_line(record))
    assert stand_in["termination"] == "infra_error" and stand_in["reward"] is None and stand_in["messages"] == []
    assert "could not be written" in stand_in["error"] and (stand_in["env_id"], stand_in["task_id"]) == ("e", "t")
    fine = record.model_copy(update={"messages": [{"role": "tool", "content": HOSTILE}]})
    assert Record.model_validate(json.loads(record_line(fine))) == fine


def test_scenarios_jsonl_round_trips_any_text(tmp_path):
    scenario = counter_scenario(task=f"Add 3 to item a. {HOSTILE}")
    bundle = load_bundle(write_bundle(tmp_path / "in", counter_spec(), [scenario]))
    saved = save_bundle(bundle, tmp_path / "out")
    assert len(lines_of(saved / "scenarios.jsonl")) == 1
    assert load_bundle(saved).scenarios[0].task == scenario["task"]


def _padded_record(repeat: int) -> bytes:
    record = {"env_id": "counter", "task_id": "counter_001", "repeat": repeat, "agent": "replay", "termination": "finished",
              "reward": 1.0, "started_at": 0.0, "duration_s": 0.0, "messages": [{"role": "user", "content": "p" * 2000}]}
    return (dumps(record) + "\n").encode()


def test_a_kill_during_the_repair_of_a_torn_line_leaves_the_file_whole(tmp_path):
    catalog = tmp_path / "farm.json"
    catalog.write_text(json.dumps({"envs": {"counter": {"url": "http://127.0.0.1:9", "token": "t"}}}))
    out = tmp_path / "big.jsonl"
    whole = b"".join(_padded_record(n) for n in range(60_000))  # ~125 MB, so the copy takes a while
    torn = _padded_record(60_000)[:700]
    out.write_bytes(whole + torn)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    command = [sys.executable, "-m", "envscaler.cli", "run", "--farm", str(catalog), "--agent", "replay", "--out", str(out), "--quiet"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    temporary = None
    deadline = time.monotonic() + 120
    while temporary is None and process.poll() is None and time.monotonic() < deadline:
        temporary = next(tmp_path.glob(".big.jsonl.*.repair"), None)
        time.sleep(0.001)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert temporary is not None, "the repair's temporary file never appeared"
    assert temporary.exists(), "the kill came after the replace: the file was not killed mid-repair"
    assert hashlib.sha256(out.read_bytes()).hexdigest() == digest  # the original, whole

    # The next resume repairs it (dropping only the torn line) and clears the killed repair's leftover.
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "127.0.0.1:9" in again.stderr, again.stderr[-2000:]  # repaired, then no farm answered
    assert out.stat().st_size == len(whole) and out.read_bytes()[-200:] == whole[-200:]
    assert not list(tmp_path.glob(".big.jsonl.*.repair"))


def test_resume_reports_a_broken_line_instead_of_deleting_it(tmp_path):
    catalog = tmp_path / "farm.json"
    catalog.write_text(json.dumps({"envs": {"counter": {"url": "http://127.0.0.1:9", "token": "t"}}}))
    out = tmp_path / "run.jsonl"
    out.write_bytes(_padded_record(0) + b'{"env_id": "counter", oops\n' + _padded_record(1))
    before = out.read_bytes()
    result = envscaler("run", "--farm", str(catalog), "--agent", "replay", "--out", str(out))
    assert result.returncode == 2 and "run.jsonl:2 is not a run record" in result.stderr
    assert out.read_bytes() == before


def _mcp(server, path: str, body: bytes | dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        return http.post(path, content=content, headers={"Content-Type": "application/json", "MCP-Protocol-Version": "2025-06-18"})


def _call(name: str, arguments: dict, request_id: int = 1) -> dict:
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {"name": name, "arguments": arguments}}


def test_the_server_answers_lone_surrogates_and_refuses_deep_nesting(texts_farm):
    server, _ = texts_farm
    with server.client() as http:
        episode = http.post("/episodes", json={"scenario_id": "texts_001"}).json()
        path = episode["mcp_path"]
        # Sent as its escape, as every JSON writer does: the server decodes it to a lone surrogate.
        answer = _mcp(server, path, _call("note", {"text": "q\udfffz"}))
        assert answer.status_code == 200 and not answer.json()["result"]["isError"]
        assert json.loads(answer.json()["result"]["content"][0]["text"]) == {"success": True, "data": "q\udfffz"}
        state = http.get(f"/episodes/{episode['episode_id']}/state")
        assert state.status_code == 200 and json.loads(state.content)["state"]["notes"] == ["q\udfffz"]
        trajectory = http.get(f"/episodes/{episode['episode_id']}/trajectory")
        assert trajectory.status_code == 200 and json.loads(trajectory.content)["calls"][0]["arguments"] == {"text": "q\udfffz"}

        deep = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "note", "arguments": {"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}}"
        refused = _mcp(server, path, deep)
        assert refused.status_code == 400 and "nests deeper than 64 levels" in refused.json()["error"]["message"]
        assert http.post("/episodes", content=b"[" * 100_000).status_code == 400
        assert _mcp(server, path, _call("note", {"text": "still here"})).status_code == 200
        assert http.get("/healthz").status_code == 200


def test_a_big_result_is_cut_and_the_cut_is_reported(texts_farm):
    server, _ = texts_farm
    with server.client() as http:
        episode = http.post("/episodes", json={"scenario_id": "texts_001"}).json()
        texts = [_mcp(server, episode["mcp_path"], _call("big", {"n": 5000}, n)).json()["result"]["content"][0]["text"] for n in range(3)]
        calls = http.get(f"/episodes/{episode['episode_id']}/trajectory").json()["calls"]
        limits = http.get("/info").json()["limits"]
    assert limits["max_result_chars"] == 1000 and limits["max_trajectory_chars"] == 2500
    for text in texts:  # the agent gets each result up to the per-result limit, and is told
        assert text == "x" * 1000 + "\n[truncated: the result has 5000 characters; the first 1000 are shown]"
    assert [(c["truncated"], c["result_chars"]) for c in calls] == [(True, 5000)] * 3
    kept = [len(c["result"]) for c in calls]
    assert kept[:2] == [1000, 1000] and kept[2] < 1000  # the trajectory's own limit cut the third further
    assert sum(kept) + sum(len(json.dumps(c["arguments"], separators=(",", ":"))) for c in calls) <= 2500


def test_an_argument_the_method_cannot_take_is_an_agent_error():
    # The schema lists "b", the method does not take it: the call must not reach the code.
    listed = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"item_id": {"type": "string"}, "b": {"type": "integer"}}}}}]
    runtime = EnvRuntime(EnvSpec.model_validate(counter_spec(tools=listed)))
    outcome = runtime.new_episode({"items": {"a": {"name": "A", "count": 0}}}).call("add", {"item_id": "a", "b": 2})
    assert outcome.error_kind == "agent"
    assert outcome.error == "Invalid arguments for 'add': unexpected argument 'b' (allowed: amount, item_id)"


SPY_AGENT = '''
import json, os, sys
seen = {"env": dict(os.environ), "cwd": os.getcwd(), "files": sorted(os.listdir("."))}
try:
    seen["catalog"] = open(".envscaler/farm.json").read()
except OSError as e:
    seen["catalog"] = type(e).__name__
print(json.dumps(seen))
'''


def test_a_command_agent_gets_the_url_and_the_task_and_nothing_of_the_harness(texts_farm, tmp_path):
    _, catalog = texts_farm
    (tmp_path / ".envscaler").mkdir()
    (tmp_path / ".envscaler" / "farm.json").write_text(catalog.read_text())  # the default catalog, in the harness's folder
    spy = tmp_path / "spy.py"
    spy.write_text(SPY_AGENT)
    env = {**os.environ, "ENVSCALER_TOKEN": "server-secret", "VENDOR_SECRET": "s3cr3t", "OPENAI_API_KEY": "sk-passed"}
    command = [sys.executable, "-m", "envscaler.cli", "run", "--agent", "command", "--command", f"{sys.executable} {spy} {{mcp_url}}",
               "--agent-env", "OPENAI_API_KEY", "--out", "run.jsonl"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    [record] = [json.loads(line) for line in lines_of(tmp_path / "run.jsonl")]
    assert record["termination"] == "finished"
    seen = json.loads(record["messages"][-1]["content"])
    allowed = {"PATH", "HOME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "USER", "LOGNAME", "SHELL", "OPENAI_API_KEY",
               "ENVSCALER_MCP_URL", "ENVSCALER_TASK", "ENVSCALER_ENV_ID", "ENVSCALER_TASK_ID"}
    assert set(seen["env"]) <= allowed, set(seen["env"]) - allowed
    assert seen["env"]["OPENAI_API_KEY"] == "sk-passed" and seen["env"]["ENVSCALER_TASK"] == "Keep the odd note."
    assert seen["env"]["ENVSCALER_MCP_URL"].endswith("/mcp")
    token = json.loads(catalog.read_text())["envs"]["texts"]["token"]
    dump = record["messages"][-1]["content"]
    assert token not in dump and "server-secret" not in dump and "s3cr3t" not in dump
    assert seen["catalog"] == "FileNotFoundError" and seen["files"] == [] and seen["cwd"] != str(tmp_path)
    refused = subprocess.run([*command, "--agent-env", "ENVSCALER_TOKEN"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "ENVSCALER_* variables are the harness's" in refused.stderr
