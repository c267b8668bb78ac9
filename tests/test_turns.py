"""Scripted multi-turn users: the format, the server's turns over HTTP and MCP, the harness's agents, the gates.

The scenario (tests/support/bundles.py, ``stock_turns_scenario``) has three user turns; the second
changes nothing and is checked only on the tool output it read and on what the agent told the user.
"""

from __future__ import annotations

import json
import sys

import pytest

from envscaler.bundle import load_bundle
from envscaler.errors import BundleError
from tests.support.bundles import CHECK_READ_B, counter_scenario, stock_bundle, stock_turns_scenario
from tests.support.cli import envscaler
from tests.support.openai_replay import ReplayServer
from tests.support.server import serve

MODES = ["worker", "in-process"]


def _flags(mode: str) -> list[str]:
    return ["--in-process"] if mode == "in-process" else []


@pytest.fixture(scope="module", params=MODES)
def stock_server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("stock")
    single = counter_scenario(task_id="stock_single", env_id="stock", init_config={"items": {"a": 0, "b": 7}},
                              checklist_with_func=[{"check_item": "a counts 1", "check_func": "def check_func(final_state):\n    return final_state['items']['a'] == 1"}],
                              reference_solution=[{"name": "add", "arguments": {"item_id": "a", "amount": 1}}])
    bundle = stock_bundle(root / "bundles", stock_turns_scenario(), single)
    with serve(bundle, *_flags(request.param)) as server:
        catalog = root / "farm.json"
        catalog.write_text(json.dumps({"envs": {"stock": {"url": server.url, "token": server.token}}}))
        yield server, catalog


def _call(http, episode, name, arguments, request_id=1):
    body = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
    reply = http.post(episode["mcp_url"], json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["result"]


def test_a_scenario_with_turns_takes_its_task_from_the_first_turn_and_refuses_a_scenario_level_reference(tmp_path):
    bundle = load_bundle(stock_bundle(tmp_path / "good"))
    [scenario] = bundle.scenarios
    assert scenario.task == "Add 2 to item a." and len(scenario.turns) == 3 and scenario.check_count() == 5
    cases = {
        "reference solution in each turn": stock_turns_scenario(reference_solution=[{"name": "add", "arguments": {"item_id": "a", "amount": 2}}]),
        "the task is the first turn's message": stock_turns_scenario(task="Something else."),
        "at least one turn": stock_turns_scenario(turns=[]),
    }
    for number, (said, scenario) in enumerate(cases.items()):
        with pytest.raises(BundleError, match=said):
            load_bundle(stock_bundle(tmp_path / f"bad{number}", scenario))


def test_turns_end_in_order_and_validation_covers_every_turn(stock_server):
    server, _ = stock_server
    with server.client() as http:
        [listed] = [s for s in http.get("/scenarios").json()["scenarios"] if s["task_id"] == "stock_turns_001"]
        assert listed["turns"] == 3 and listed["checks"] == 5 and listed["has_reference"]
        episode = http.post("/episodes", json={"scenario_id": "stock_turns_001"}).json()
        assert episode["turns"] == 3 and episode["task"] == "Add 2 to item a."
        turn_url = f"/episodes/{episode['episode_id']}/turn"

        _call(http, episode, "add", {"item_id": "a", "amount": 2})
        first = http.post(turn_url, json={"agent_replies": ["Done."]}).json()
        assert first == {"episode_id": episode["episode_id"], "turn": 1, "score": 1.0, "next_message": "How many of item b are there?",
                         "turns_left": 2, "calls": 1, "checks": [{"check_item": "a counts 2", "passed": True, "error": None, "turn": 1}]}

        # Turn 2 is checked on its own calls: a look-up of a, then of b, and what the agent said.
        _call(http, episode, "count", {"item_id": "a"}, 2)
        _call(http, episode, "count", {"item_id": "b"}, 3)
        second = http.post(turn_url, json={"agent_replies": ["b: 7"]}).json()
        assert second["score"] == 1.0 and second["calls"] == 2 and second["next_message"] == "Add 1 to item b." and second["turns_left"] == 1

        # Validated before turn 3 ends: its checks run on the state now (b still counts 7); three calls so far.
        early = http.post(f"/episodes/{episode['episode_id']}/validate").json()
        assert [(c["turn"], c["passed"]) for c in early["checks"]] == [(1, True), (2, True), (2, True), (3, False), (None, True)]

        _call(http, episode, "add", {"item_id": "b", "amount": 1}, 4)
        third = http.post(turn_url).json()
        assert third["score"] == 1.0 and third["next_message"] is None and third["turns_left"] == 0
        over = http.post(turn_url)
        assert over.status_code == 409 and "all 3 turns" in over.json()["error"]

        # The final check counts every call of the episode: four, where the reference makes three.
        final = http.post(f"/episodes/{episode['episode_id']}/validate").json()
        assert [c["passed"] for c in final["checks"]] == [True, True, True, True, False] and final["score"] == 0.8

        # A reset starts the turns over.
        reset = http.post(f"/episodes/{episode['episode_id']}/reset", json={}).json()
        assert reset["turns"] == 3
        again = http.post(turn_url).json()
        assert again["turn"] == 1 and again["score"] == 0.0


def test_turns_never_reached_fail_with_an_error_that_says_so(stock_server):
    server, _ = stock_server
    with server.client() as http:
        episode = http.post("/episodes", json={"scenario_id": "stock_turns_001"}).json()
        _call(http, episode, "add", {"item_id": "a", "amount": 2})
        result = http.post(f"/episodes/{episode['episode_id']}/validate", json={"agent_replies": ["added"]}).json()
    unreached = [c for c in result["checks"] if c["turn"] in (2, 3)]
    assert [c["passed"] for c in result["checks"]] == [True, False, False, False, False]
    assert all("never reached" in c["error"] for c in unreached) and "turn 2 of 3" in unreached[0]["error"]
    assert result["check_errors"] == 0  # the agent's doing, not the checks' code


def test_a_scenario_without_turns_has_no_turn_to_end_and_its_checks_read_the_calls(stock_server):
    server, _ = stock_server
    with server.client() as http:
        episode = http.post("/episodes", json={"scenario_id": "stock_single"}).json()
        assert episode["turns"] == 0
        refused = http.post(f"/episodes/{episode['episode_id']}/turn")
        assert refused.status_code == 409 and "no scripted user turns" in refused.json()["error"]
        _call(http, episode, "count", {"item_id": "b"})
        checklist = [CHECK_READ_B, {"check_item": "told", "check_func": "def check_func(final_state):\n    return agent_replies == ['seven']"}]
        result = http.post(f"/episodes/{episode['episode_id']}/validate", json={"checklist": checklist, "agent_replies": ["seven"]}).json()
    assert [c["passed"] for c in result["checks"]] == [True, True], result


def test_replay_scores_one_over_mcp_and_random_fails_the_turn_checked_on_its_output(stock_server, tmp_path):
    _, catalog = stock_server
    out = tmp_path / "replay.jsonl"
    done = envscaler("run", "--farm", str(catalog), "--agent", "replay", "--out", str(out), "--quiet", "--scenario", "stock_turns_001")
    assert done.returncode == 0, done.stderr[-2000:]
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["reward"] == 1.0 and record["termination"] == "finished", record["checks"]
    assert [(t["turn"], t["score"]) for t in record["turns"]] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    users = [m["content"] for m in record["messages"] if m["role"] == "user"]
    assert users == ["Add 2 to item a.", "How many of item b are there?", "Add 1 to item b."]
    assert "There are 7 of item b." in [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert "scripted user turns over 1 episode(s): turn 1: ended in 1, score 1.000; turn 2" in done.stdout

    # Exports keep every user turn: the chat formats in order, Inspect's log with each check's turn.
    sft, sharegpt, inspect_log = tmp_path / "sft.jsonl", tmp_path / "sharegpt.jsonl", tmp_path / "run.eval"
    for fmt, target in (("openai", sft), ("sharegpt", sharegpt), ("inspect", inspect_log)):
        exported = envscaler("export", "--in", str(out), "--out", str(target), "--format", fmt)
        assert exported.returncode == 0, exported.stderr
    [item] = [json.loads(line) for line in sft.read_text().splitlines()]
    assert [m["content"] for m in item["messages"] if m["role"] == "user"] == users
    [shared] = [json.loads(line) for line in sharegpt.read_text().splitlines()]
    assert [c["value"] for c in shared["conversations"] if c["from"] == "human"] == users
    from inspect_ai.log import read_eval_log

    [sample] = read_eval_log(str(inspect_log)).samples
    assert [m.text for m in sample.messages if m.role == "user"] == users
    score = sample.scores["checks"]
    assert score.value == 1.0 and "pass: turn 2: b was looked up, and it counts 7" in score.explanation
    assert [t["turn"] for t in score.metadata["turns"]] == [1, 2, 3]

    randomly = tmp_path / "random.jsonl"
    done = envscaler("run", "--farm", str(catalog), "--agent", "random", "--out", str(randomly), "--quiet", "--repeats", "3",
                     "--scenario", "stock_turns_001")
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in randomly.read_text().splitlines()]
    assert len(records) == 3
    for random_record in records:
        assert [t["turn"] for t in random_record["turns"]] == [1, 2, 3]
        assert random_record["turns"][1]["score"] < 1.0 and random_record["reward"] < 1.0

    # Reverify replays each turn's own calls and replies, then ends it: the same verdicts, turn by turn.
    for run in (out, randomly):
        again = tmp_path / f"again-{run.name}"
        done = envscaler("reverify", str(run), "--farm", str(catalog), "--out", str(again), "--quiet")
        assert done.returncode == 0, done.stderr[-2000:]
        before = [json.loads(line) for line in run.read_text().splitlines()]
        after = [json.loads(line) for line in again.read_text().splitlines()]
        def verdicts(records):
            return [(r["reward"], r["checks"], [{k: v for k, v in t.items() if k != "episode_id"} for t in r["turns"]]) for r in records]

        assert verdicts(after) == verdicts(before)


def test_gates_pass_on_turns_and_fail_on_a_turn_check_that_cannot_pass(tmp_path):
    good = envscaler("catalog", "check", str(stock_bundle(tmp_path / "good").parent))
    assert good.returncode == 0, good.stdout + good.stderr
    broken = stock_turns_scenario()
    broken["turns"][1]["checklist_with_func"].append({"check_item": "b was counted twice", "check_func": (
        "def check_func(final_state):\n    return sum(c['name'] == 'count' for c in turn_results) == 2")})
    report = tmp_path / "report.json"
    bad = envscaler("catalog", "check", str(stock_bundle(tmp_path / "bad", broken).parent), "--json", str(report))
    assert bad.returncode != 0
    [env] = json.loads(report.read_text())
    failed = {g["gate"]: g["detail"] for g in env["scenarios"][0]["gates"] if not g["passed"]}
    assert list(failed) == ["checks_pass_on_reference"] and "turn 2: 'b was counted twice'" in failed["checks_pass_on_reference"]


def test_a_do_nothing_agent_that_ends_every_turn_fails_the_gate_when_the_checks_ask_nothing_of_it(tmp_path):
    lenient = stock_turns_scenario()
    for turn in lenient["turns"]:
        turn["checklist_with_func"] = [{"check_item": "anything", "check_func": "def check_func(final_state):\n    return True"}]
    lenient["checklist_with_func"] = None
    report = tmp_path / "report.json"
    done = envscaler("catalog", "check", str(stock_bundle(tmp_path / "lenient", lenient).parent), "--json", str(report))
    assert done.returncode != 0
    failed = {g["gate"] for g in json.loads(report.read_text())[0]["scenarios"][0]["gates"] if not g["passed"]}
    assert failed == {"check_fails_on_initial", "do_nothing_below_one"}


def test_an_openai_agent_goes_on_after_each_next_message(stock_server, tmp_path):
    _, catalog = stock_server
    script = [{"tool_calls": [{"name": "add", "arguments": {"item_id": "a", "amount": 2}}]}, {"content": "Added."},
              {"tool_calls": [{"name": "count", "arguments": {"item_id": "b"}}]}, {"content": "There are 7."},
              {"tool_calls": [{"name": "add", "arguments": {"item_id": "b", "amount": 1}}]}, {"content": "Now 8."}]
    out = tmp_path / "openai.jsonl"
    with ReplayServer({"agent": script}) as model:
        done = envscaler("run", "--farm", str(catalog), "--agent", "openai", "--base-url", model.base_url, "--model", "agent",
                         "--out", str(out), "--quiet", "--scenario", "stock_turns_001")
        assert done.returncode == 0, done.stderr[-2000:]
        # Each request after a plain answer carries the next turn's message as the last user message.
        asked = [[m["content"] for m in r["messages"] if m["role"] == "user"][-1] for r in model.requests]
    assert asked == ["Add 2 to item a."] * 2 + ["How many of item b are there?"] * 2 + ["Add 1 to item b."] * 2
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["reward"] == 1.0 and record["termination"] == "finished" and len(record["turns"]) == 3


COMMAND_AGENT = '''
import json, os, sys, urllib.request

def call(name, arguments):
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
    request = urllib.request.Request(os.environ["ENVSCALER_MCP_URL"], json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "Accept": "application/json"})
    return json.loads(json.loads(urllib.request.urlopen(request).read())["result"]["content"][0]["text"])

task = os.environ["ENVSCALER_TASK"]
if task == "Add 2 to item a.":
    call("add", {"item_id": "a", "amount": 2})
    print("Added 2.")
elif task == "How many of item b are there?":
    print(f"There are {call('count', {'item_id': 'b'})['data']}.")
else:
    call("add", {"item_id": "b", "amount": 1})
    print("Added 1.")
'''


def test_a_command_agent_runs_once_per_turn_with_that_turns_message(stock_server, tmp_path):
    _, catalog = stock_server
    agent = tmp_path / "agent.py"
    agent.write_text(COMMAND_AGENT)
    out = tmp_path / "command.jsonl"
    done = envscaler("run", "--farm", str(catalog), "--agent", "command", "--command", f"{sys.executable} {agent}",
                     "--out", str(out), "--quiet", "--scenario", "stock_turns_001")
    assert done.returncode == 0, done.stderr[-2000:]
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["content"] for m in record["messages"] if m["role"] == "assistant"] == ["Added 2.", "There are 7.", "Added 1."]
    assert record["reward"] == 1.0 and [t["score"] for t in record["turns"]] == [1.0, 1.0, 1.0]
