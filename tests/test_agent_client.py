"""The harness over real servers and a real OpenAI-compatible replay server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent_client.http import LeanHttp
from agent_client.models import AgentResult
from agent_client.remote import EnvControl
from agent_client.runner import RunOptions, run_episode, spread_over_environments
from envscaler.wire import EnvEndpoint, ScenarioSummary
from tests.support.bundles import counter_scenario, counter_spec, second_scenario, write_bundle
from tests.support.cli import envscaler
from tests.support.openai_replay import ReplayServer
from tests.support.server import serve
from tests.test_http_client import ok, scripted

SUPPORT = Path(__file__).parent / "support"


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    """The counter environment behind a real server, with a catalog file as 'farm up' writes it."""
    root = tmp_path_factory.mktemp("farm")
    conversational = counter_scenario(task_id="counter_003", user_profile="You are Ann. You want item a to count 3. You know nothing else.")
    bundle = write_bundle(root / "bundles", counter_spec(), [counter_scenario(), second_scenario(), conversational])
    with serve(bundle, "--call-timeout", "2") as server:
        catalog = root / "farm.json"
        catalog.write_text(json.dumps({"envs": {"counter": {"url": server.url, "token": server.token}}}))
        yield catalog


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_openai(farm, out, server, *extra):
    return envscaler("run", "--farm", str(farm), "--agent", "openai", "--base-url", server.base_url, "--model", "agent",
                     "--out", str(out), "--retries", "2", "--backoff", "0.01", *extra)


def test_demo_replays_score_one_and_random_scores_less(tmp_path):
    result = envscaler("demo", "--out", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    replay, random_ = records(tmp_path / "replay.jsonl"), records(tmp_path / "random.jsonl")
    assert len(replay) >= 48 and all(r["reward"] == 1.0 for r in replay)
    assert len(random_) == len(replay)
    assert sum(r["reward"] for r in random_) / len(random_) < 1.0
    assert "overall" in result.stdout and f"{len(replay)}/{len(replay)} replays scored 1.0" in result.stdout
    first = replay[0]
    assert first["messages"][0]["role"] == "system" and first["messages"][1]["role"] == "user"
    assert any(m.get("tool_calls") for m in first["messages"]) and first["tools"]
    assert first["trajectory"] and any(c["diff"] for c in first["trajectory"])


def test_scripted_openai_agent_scores_one_with_several_calls_in_one_turn(farm, tmp_path):
    script = [
        {"tool_calls": [{"name": "get_item", "arguments": {"item_id": "a"}}, {"name": "add", "arguments": {"item_id": "a", "amount": 2}}]},
        {"tool_calls": [{"name": "add", "arguments": {"item_id": "a"}}]},
        {"content": "Item a now counts 3."},
    ]
    with ReplayServer({"agent": script}) as server:
        result = run_openai(farm, tmp_path / "out.jsonl", server, "--scenario", "counter/counter_001")
        sent = server.requests_for("agent")
    assert result.returncode == 0, result.stderr
    [record] = records(tmp_path / "out.jsonl")
    assert record["reward"] == 1.0 and record["termination"] == "finished"
    assert [c["name"] for c in record["trajectory"]] == ["get_item", "add", "add"]
    assert record["usage"]["requests"] == 3 and record["usage"]["prompt_tokens"] == 30
    assert sent[0]["tools"] and sent[0]["messages"][1] == {"role": "user", "content": counter_scenario()["task"]}
    assert [m["role"] for m in sent[1]["messages"]][-3:] == ["assistant", "tool", "tool"]


def test_malformed_tool_json_and_an_unknown_tool_go_back_to_the_model(farm, tmp_path):
    script = [
        {"tool_calls": [{"name": "add", "arguments": '{"item_id": "a", '}]},
        {"tool_calls": [{"name": "teleport", "arguments": {}}]},
        {"tool_calls": [{"name": "add", "arguments": {"item_id": "a", "amount": 3}}]},
        {"content": "done"},
    ]
    with ReplayServer({"agent": script}) as server:
        result = run_openai(farm, tmp_path / "out.jsonl", server, "--scenario", "counter/counter_001")
    assert result.returncode == 0, result.stderr
    [record] = records(tmp_path / "out.jsonl")
    tool_messages = [m["content"] for m in record["messages"] if m["role"] == "tool"]
    assert "not valid JSON" in tool_messages[0]
    assert "Unknown tool 'teleport'" in tool_messages[1]
    assert record["reward"] == 1.0 and record["agent_errors"] == 1 and record["env_errors"] == 0


def test_rate_limits_are_retried_and_an_outage_is_an_infra_error(farm, tmp_path):
    with ReplayServer({"agent": [{"status": 429}, {"status": 503}, {"content": "nothing to do"}]}) as server:
        retried = run_openai(farm, tmp_path / "retried.jsonl", server, "--scenario", "counter/counter_001")
    assert retried.returncode == 0, retried.stderr
    [record] = records(tmp_path / "retried.jsonl")
    assert record["termination"] == "finished" and record["reward"] < 1.0

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    down = envscaler("run", "--farm", str(farm), "--agent", "openai", "--base-url", dead, "--model", "agent",
                     "--out", str(tmp_path / "down.jsonl"), "--retries", "1", "--backoff", "0.01", "--scenario", "counter/counter_001")
    assert down.returncode == 1
    [record] = records(tmp_path / "down.jsonl")
    assert record["termination"] == "infra_error" and record["reward"] is None and "failed 2 times" in record["error"]
    assert "infra" in down.stdout and down.stdout.strip().splitlines()[-1].split()[-1] == "1"


def test_conversational_run_with_a_scripted_user(farm, tmp_path):
    scripts = {
        "user": [{"content": "Hi, please make item a count 3."}, {"content": "Thanks! ###STOP###"}],
        "agent": [{"tool_calls": [{"name": "add", "arguments": {"item_id": "a", "amount": 3}}]}, {"content": "Done: a counts 3."}],
    }
    with ReplayServer(scripts) as server:
        result = run_openai(farm, tmp_path / "out.jsonl", server, "--user-model", "user", "--scenario", "counter/counter_003")
        user_requests = server.requests_for("user")
    assert result.returncode == 0, result.stderr
    [record] = records(tmp_path / "out.jsonl")
    assert record["termination"] == "user_stop" and record["reward"] == 1.0
    assert record["messages"][1] == {"role": "user", "content": "Hi, please make item a count 3."}
    assert record["user_usage"]["requests"] == 2
    assert "You are Ann" in user_requests[0]["messages"][0]["content"]
    assert user_requests[1]["messages"][-1] == {"role": "user", "content": "Done: a counts 3."}


def test_command_agent_runs_an_external_mcp_client(farm, tmp_path):
    command = f"{sys.executable} {SUPPORT / 'mcp_agent.py'} {{mcp_url}}"
    result = envscaler("run", "--farm", str(farm), "--agent", "command", "--command", command,
                       "--out", str(tmp_path / "out.jsonl"), "--scenario", "counter/counter_001")
    assert result.returncode == 0, result.stderr
    [record] = records(tmp_path / "out.jsonl")
    assert record["reward"] == 1.0 and record["termination"] == "finished"
    assert "task was: Add 3 to item a." in record["messages"][-1]["content"]


def test_resume_after_an_interrupted_run_writes_no_duplicates(farm, tmp_path):
    out = tmp_path / "out.jsonl"
    args = ("run", "--farm", str(farm), "--agent", "replay", "--out", str(out), "--repeats", "2",
            "--scenario", "counter/counter_001", "--scenario", "counter/counter_002")
    assert envscaler(*args).returncode == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 4
    out.write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])  # a kill mid-write leaves a torn line
    resumed = envscaler(*args)
    assert resumed.returncode == 0 and "resuming: 2 record(s)" in resumed.stderr
    keys = [(r["env_id"], r["task_id"], r["repeat"]) for r in records(out)]
    assert len(keys) == 4 and len(set(keys)) == 4
    assert "pass^2" in resumed.stdout and "4 episode(s)" in resumed.stdout, resumed.stdout


def test_resume_runs_infra_errors_again_in_their_place(farm, tmp_path):
    out = tmp_path / "out.jsonl"
    args = ("run", "--farm", str(farm), "--agent", "replay", "--out", str(out),
            "--scenario", "counter/counter_001", "--scenario", "counter/counter_002")
    assert envscaler(*args).returncode == 0
    first, second = records(out)
    # As a run records an episode whose environment instance died under it.
    second.update(termination="infra_error", reward=None, checks=[], error="environment instance gone")
    out.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    resumed = envscaler(*args)
    assert resumed.returncode == 0 and "resuming: 1 record(s)" in resumed.stderr
    after = records(out)
    assert [(r["task_id"], r["termination"], r["reward"]) for r in after] == [
        (first["task_id"], "finished", 1.0), (second["task_id"], "finished", 1.0)]


def test_export_writes_valid_sft_files(farm, tmp_path):
    out = tmp_path / "run.jsonl"
    assert envscaler("run", "--farm", str(farm), "--agent", "replay", "--out", str(out)).returncode == 0
    assert envscaler("run", "--farm", str(farm), "--agent", "random", "--out", str(tmp_path / "random.jsonl")).returncode == 0
    openai_file, sharegpt_file = tmp_path / "sft.openai.jsonl", tmp_path / "sft.sharegpt.jsonl"
    done = envscaler("export", "--in", str(out), "--out", str(openai_file), "--min-reward", "1.0", "--format", "openai")
    assert done.returncode == 0 and "wrote 3 of 3" in done.stdout
    for item in records(openai_file):
        assert item["messages"][0]["role"] == "system" and item["tools"][0]["type"] == "function"
        for message in item["messages"]:
            for call in message.get("tool_calls", []):
                json.loads(call["function"]["arguments"])
    assert envscaler("export", "--in", str(out), "--out", str(sharegpt_file), "--format", "sharegpt").returncode == 0
    conversation = records(sharegpt_file)[0]["conversations"]
    assert {turn["from"] for turn in conversation} >= {"system", "human", "function_call", "observation", "gpt"}
    none = envscaler("export", "--in", str(tmp_path / "random.jsonl"), "--out", str(tmp_path / "none.jsonl"))
    assert "wrote 0 of 3" in none.stdout
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"env_id": "x"}\n')
    bad = envscaler("export", "--in", str(broken))
    assert bad.returncode == 2 and "broken.jsonl:1" in bad.stderr


def test_episode_commands_hand_an_episode_to_a_person(farm, tmp_path):
    new = envscaler("episode", "new", "--farm", str(farm), "--scenario", "counter/counter_001")
    assert new.returncode == 0, new.stderr
    lines = dict(line.split(":", 1) for line in new.stdout.splitlines() if line[:8] in ("episode:", "MCP URL:"))
    episode, url = lines["episode"].strip(), lines["MCP URL"].strip()
    assert '"mcpServers"' in new.stdout and url in new.stdout
    # Claude Desktop starts servers as programs: it is pointed at connect, not at the HTTP config.
    http_label = next(line for line in new.stdout.splitlines() if line.startswith("MCP client config"))
    assert "Claude Desktop" not in http_label and f"envscaler connect {url}" in new.stdout
    before = envscaler("episode", "validate", "--farm", str(farm), episode)
    assert before.returncode == 1 and "FAIL" in before.stdout
    agent = subprocess.run([sys.executable, str(SUPPORT / "mcp_agent.py"), url], capture_output=True, text=True,
                           env={"ENVSCALER_TASK": "by hand", "PATH": ""}, timeout=60)
    assert agent.returncode == 0, agent.stderr
    after = envscaler("episode", "validate", "--farm", str(farm), episode)
    assert after.returncode == 0 and "score 1.000" in after.stdout
    ended = envscaler("episode", "end", "--farm", str(farm), episode)
    assert ended.returncode == 0 and "ended" in ended.stdout
    twice = envscaler("episode", "end", "--farm", str(farm), episode)
    assert twice.returncode == 2 and "ended" not in twice.stdout and "no live episode" in twice.stderr
    never = envscaler("episode", "end", "--farm", str(farm), "counter/never-created")
    assert never.returncode == 2 and "no live episode" in never.stderr and len(never.stderr.strip().splitlines()) == 1
    gone = envscaler("episode", "validate", "--farm", str(farm), episode)
    assert gone.returncode == 2 and "404" in gone.stderr
    unknown = envscaler("episode", "new", "--farm", str(farm), "--scenario", "nope/x")
    assert unknown.returncode == 2 and "not in" in unknown.stderr


def test_an_environment_server_that_does_not_answer_ends_the_command_with_exit_1(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    catalog = tmp_path / "farm.json"
    catalog.write_text(json.dumps({"envs": {"counter": {"url": dead, "token": "t"}}}))
    new = envscaler("episode", "new", "--farm", str(catalog), "--scenario", "counter/counter_001")
    assert new.returncode == 1 and "Traceback" not in new.stderr
    assert new.stderr.startswith("error: counter:") and dead.removeprefix("http://") in new.stderr
    # A run asks every environment for its scenarios at once; what it reports is the first environment's failure.
    catalog.write_text(json.dumps({"envs": {name: {"url": dead, "token": "t"} for name in ("counter", "other", "third")}}))
    ran = envscaler("run", "--farm", str(catalog), "--agent", "replay", "--out", str(tmp_path / "run.jsonl"))
    assert ran.returncode == 1 and "Traceback" not in ran.stderr and "ExceptionGroup" not in ran.stderr
    assert ran.stderr.startswith("error: counter:") and len(ran.stderr.strip().splitlines()) == 1


def test_a_run_takes_each_environment_s_scenarios_in_turn():
    listed = [ScenarioSummary(env_id=env_id, task_id=f"{env_id}_{number}") for env_id in ("a", "b", "c") for number in range(3)]
    listed = [s for s in listed if (s.env_id, s.task_id) != ("c", "c_2")]
    jobs = spread_over_environments([(s, repeat) for s in listed for repeat in range(2)])
    order = [(s.task_id, repeat) for s, repeat in jobs]
    assert order[:6] == [("a_0", 0), ("b_0", 0), ("c_0", 0), ("a_0", 1), ("b_0", 1), ("c_0", 1)]
    assert order[-4:] == [("a_2", 0), ("b_2", 0), ("a_2", 1), ("b_2", 1)]
    assert sorted(order) == sorted((s.task_id, repeat) for s in listed for repeat in range(2))
    assert spread_over_environments([]) == []


KINDS_CODE = '''
class Kinds:
    def __init__(self, init_config: dict):
        self.seen = []

    def name_of(self, user: str) -> str:
        """A plain string answer.

        Args:
            user (str): Whose name.
        """
        self.seen.append(user)
        return "yusuf_rossi_9620"

    def quoted(self) -> str:
        """A string that holds JSON."""
        return '{"order_id": "#W1", "note": "caf\\u00e9 \\\\ done"}'

    def record(self) -> dict:
        """A dict answer."""
        return {"success": True, "data": {"id": 1}}

    def items(self) -> list:
        """A list answer."""
        return [1, "two", None]

    def count(self) -> int:
        """A number answer."""
        return 42
'''


def test_results_reach_agent_trajectory_and_export_as_the_tool_returned_them(tmp_path):
    calls = [{"name": "name_of", "arguments": {"user": "yusuf"}}, {"name": "quoted", "arguments": {}},
             {"name": "record", "arguments": {}}, {"name": "items", "arguments": {}}, {"name": "count", "arguments": {}}]
    spec = {"env_id": "kinds", "env_class_name": "Kinds", "env_class_code": KINDS_CODE,
            "environment_introduction": "Answers of every kind."}
    scenario = {"task_id": "kinds_001", "env_id": "kinds", "env_class_name": "Kinds", "init_config": {}, "task": "Ask everything.",
                "checklist_with_func": [{"check_item": "asked", "check_func": "def check_func(final_state):\n    return final_state['seen'] == ['yusuf']"}],
                "reference_solution": calls}
    bundle = write_bundle(tmp_path / "bundles", spec, [scenario])
    expected = ["yusuf_rossi_9620", '{"order_id": "#W1", "note": "café \\ done"}',
                '{"success":true,"data":{"id":1}}', '[1,"two",null]', "42"]
    with serve(bundle) as server:
        catalog = tmp_path / "farm.json"
        catalog.write_text(json.dumps({"envs": {"kinds": {"url": server.url, "token": server.token}}}))
        out = tmp_path / "run.jsonl"
        done = envscaler("run", "--farm", str(catalog), "--agent", "replay", "--out", str(out))
        assert done.returncode == 0, done.stderr[-2000:]
    record = records(out)[0]
    assert record["reward"] == 1.0
    assert [c["result"] for c in record["trajectory"]] == [
        "yusuf_rossi_9620", '{"order_id": "#W1", "note": "café \\ done"}', {"success": True, "data": {"id": 1}}, [1, "two", None], 42]
    assert [m["content"] for m in record["messages"] if m["role"] == "tool"] == expected
    sft = tmp_path / "sft.jsonl"
    assert envscaler("export", "--in", str(out), "--out", str(sft), "--format", "openai").returncode == 0
    exported = records(sft)[0]["messages"]
    assert [m["content"] for m in exported if m["role"] == "tool"] == expected


class _DoneAtOnce:
    """An agent that ends its episode without a tool call."""

    name, converses, model = "done-at-once", False, None

    async def run(self, ctx):
        return AgentResult()


@pytest.mark.anyio
async def test_a_server_that_predates_validate_end_is_still_asked_for_the_trajectory_and_to_end():
    # A farm built before ``?end=1`` (an older server image) ignores it: the record must still get its
    # trajectory and error counts, and the episode must still be ended.
    replies = [ok(json.dumps({"episode_id": "e1", "mcp_url": "http://127.0.0.1:9/mcp", "mcp_path": "/episodes/e1/mcp", "env_id": "demo"}).encode()),
               ok(json.dumps({"score": 1.0, "checks": [], "state_hash": "h"}).encode()),
               ok(json.dumps({"episode_id": "e1", "env_id": "demo", "scenario_id": "t1", "calls": [], "env_errors": 2}).encode()),
               ok(json.dumps({"episode_id": "e1", "calls": 0}).encode())]
    async with scripted(replies) as server, LeanHttp() as http:
        control = EnvControl(http, "demo", EnvEndpoint(url=server.url, token="t"))
        record = await run_episode(http, control, ScenarioSummary(env_id="demo", task_id="t1"), 0, _DoneAtOnce(), RunOptions())
    assert server.requests == [b"POST /episodes HTTP/1.1", b"POST /episodes/e1/validate?end=1 HTTP/1.1",
                               b"GET /episodes/e1/trajectory HTTP/1.1", b"DELETE /episodes/e1 HTTP/1.1"]
    assert (record.termination, record.reward, record.env_errors, record.error) == ("finished", 1.0, 2, None)
