"""One environment server, as a real process over real HTTP and MCP."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from agent_client.http import LeanHttp
from agent_client.remote import EnvControl
from envscaler import EnvRuntime, default_catalog, load_bundle
from envscaler.wire import (
    EnvEndpoint,
    EpisodeCreated,
    EpisodeEnded,
    EpisodeIds,
    EpisodeReset,
    EpisodeState,
    EpisodeValidation,
    Health,
    ScenarioListing,
    ServerInfo,
    Trajectory,
)
from servers.episodes import store as episodes
from servers.serve import READY_FD_VARIABLE
from tests.support.bundles import (
    counter_bundle,
    counter_scenario,
    counter_spec,
    second_scenario,
    folders_bundle,
    tagger_bundle,
    users_scenario,
    users_spec,
    write_bundle,
)
from tests.support.large_state import shop_bundle
from tests.support.server import serve, stop

pytestmark = pytest.mark.anyio

CATALOG_ENV = default_catalog() / "library_circulation"


@pytest.fixture(scope="module")
def counter_dir(tmp_path_factory):
    return counter_bundle(tmp_path_factory.mktemp("counter"))


@pytest.fixture(scope="module")
def counter_server(counter_dir):
    with serve(counter_dir, "--call-timeout", "0.5", "--check-timeout", "0.5", "--max-body", "4096") as server:
        yield server


@pytest.fixture(scope="module")
def catalog_server():
    with serve(CATALOG_ENV) as server:
        yield server


def create(server, **body):
    with server.client() as http:
        response = http.post("/episodes", json=body)
    assert response.status_code == 201, response.text
    return response.json()


async def mcp_session(url, mode="auto"):
    """An official SDK client over a shared HTTP client (the caller enters both)."""
    http = httpx2.AsyncClient(timeout=30)
    return http, Client(streamable_http_client(url, http_client=http), mode=mode)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_official_client_lists_exactly_the_env_tools(catalog_server, mode):
    episode = create(catalog_server, scenario_id=load_bundle(CATALOG_ENV).scenarios[0].task_id)
    expected = {t.name for t in EnvRuntime(load_bundle(CATALOG_ENV).spec).tool_list()}
    http, client = await mcp_session(episode["mcp_url"], mode)
    async with http, client:
        listed = await client.list_tools()
    names = {t.name for t in listed.tools}
    assert names == expected
    assert not names & {"reset", "validate", "state", "get_state"}
    assert all(t.input_schema["type"] == "object" for t in listed.tools)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_reference_replay_through_mcp_scores_one(catalog_server, mode):
    bundle = load_bundle(CATALOG_ENV)
    scenario = bundle.scenarios[1]
    episode = create(catalog_server, scenario_id=scenario.task_id)
    with catalog_server.client() as control:
        before = control.post(f"/episodes/{episode['episode_id']}/validate").json()
        assert before["score"] < 1.0
        http, client = await mcp_session(episode["mcp_url"], mode)
        async with http, client:
            for call in scenario.reference_solution:
                result = await client.call_tool(call.name, call.arguments)
                assert not result.is_error, result.content[0].text
        after = control.post(f"/episodes/{episode['episode_id']}/validate").json()
        trajectory = control.get(f"/episodes/{episode['episode_id']}/trajectory").json()
    assert after["score"] == 1.0
    assert all(c["passed"] for c in after["checks"]) and len(after["checks"]) == len(scenario.checklist_with_func)
    assert [c["name"] for c in trajectory["calls"]] == [c.name for c in scenario.reference_solution]
    assert any(c["diff"] for c in trajectory["calls"])
    assert all(c["latency_s"] >= 0 for c in trajectory["calls"])


async def test_reset_restores_the_other_scenario_exactly(counter_server, counter_dir):
    episode = create(counter_server, scenario_id="counter_001")
    expected = EnvRuntime(load_bundle(counter_dir).spec).new_episode(second_scenario()["init_config"]).state()
    http, client = await mcp_session(episode["mcp_url"])
    async with http, client:
        await client.call_tool("add", {"item_id": "a", "amount": 5})
    with counter_server.client() as control:
        path = f"/episodes/{episode['episode_id']}"
        reset = control.post(f"{path}/reset", json={"scenario_id": "counter_002"})
        assert reset.status_code == 200 and reset.json()["task"] == second_scenario()["task"]
        assert control.get(f"{path}/state").json()["state"] == expected
        assert control.get(f"{path}/trajectory").json()["calls"] == []
        score = control.post(f"{path}/validate").json()
        assert score["score"] < 1.0 and len(score["checks"]) == 3


async def test_two_hundred_concurrent_episodes_do_not_bleed(counter_server):
    async with httpx.AsyncClient(base_url=counter_server.url, headers=counter_server.headers, timeout=60) as http:
        episodes = []
        for _ in range(200):
            response = await http.post("/episodes", json={"init_config": {"items": {"a": {"name": "A", "count": 0}}}})
            episodes.append(response.json())

        async def play(index: int, episode: dict) -> None:
            # Interleaved: every episode adds its own index, one unit at a time across three rounds.
            for round_number in range(3):
                body = {"jsonrpc": "2.0", "id": round_number, "method": "tools/call",
                        "params": {"name": "add", "arguments": {"item_id": "a", "amount": index}}}
                response = await http.post(episode["mcp_path"], json=body, headers={"MCP-Protocol-Version": "2026-07-28"})
                assert response.status_code == 200
                assert response.json()["result"]["isError"] is False
                await anyio.sleep(0)

        async with anyio.create_task_group() as tasks:
            for index, episode in enumerate(episodes):
                tasks.start_soon(play, index, episode)
        for index, episode in enumerate(episodes):
            state = (await http.get(f"/episodes/{episode['episode_id']}/state")).json()["state"]
            assert state["items"]["a"]["count"] == 3 * index
            assert len(state["log"]) == 3


@pytest.mark.parametrize("tool", ["nap", "spin"])
async def test_a_hanging_tool_errors_within_the_limit_while_others_answer(counter_server, tool):
    stuck = create(counter_server, scenario_id="counter_001")
    other = create(counter_server, scenario_id="counter_001")
    answers: list[float] = []
    started = time.monotonic()

    async def hang() -> None:
        http, client = await mcp_session(stuck["mcp_url"])
        async with http, client:
            result = await client.call_tool(tool, {})
        assert result.is_error
        assert "0.5 s" in result.content[0].text
        answers.append(time.monotonic() - started)

    async def keep_answering() -> None:
        http, client = await mcp_session(other["mcp_url"])
        async with http, client:
            for _ in range(5):
                result = await client.call_tool("get_item", {"item_id": "a"})
                assert not result.is_error
                answers.append(-(time.monotonic() - started))
                await anyio.sleep(0.05)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(hang)
        tasks.start_soon(keep_answering)
    hang_time = max(answers)
    other_times = [-a for a in answers if a <= 0]
    assert hang_time < 2.0
    assert len(other_times) == 5 and min(other_times) < hang_time
    with counter_server.client() as control:
        trajectory = control.get(f"/episodes/{stuck['episode_id']}/trajectory").json()
    assert trajectory["timeouts"] == 1 and trajectory["calls"][0]["error_kind"] == "timeout"


async def test_a_slow_call_is_undone_on_the_event_loop_and_run_once_on_a_worker(counter_server):
    episode = create(counter_server, scenario_id="counter_001")
    http, client = await mcp_session(episode["mcp_url"])
    async with http, client:
        slow = await client.call_tool("slow_add", {"item_id": "a", "amount": 2, "seconds": 0.1})
        quick = await client.call_tool("add", {"item_id": "a"})
    assert not slow.is_error and json.loads(slow.content[0].text)["data"]["count"] == 2
    assert json.loads(quick.content[0].text)["data"]["count"] == 3
    with counter_server.client() as control:
        path = f"/episodes/{episode['episode_id']}"
        state = control.get(f"{path}/state").json()["state"]
        calls = control.get(f"{path}/trajectory").json()["calls"]
        info = control.get("/info").json()
    # The preempted first run was undone: the change happened exactly once.
    assert state["log"] == ["add a 2", "add a 1"]
    assert [c["name"] for c in calls] == ["slow_add", "add"] and calls[0]["latency_s"] >= 0.1
    assert [d["path"] for d in calls[0]["diff"]] == [["items", "a", "count"], ["log", 0]]
    assert "slow_add" in info["threaded_tools"] and info["limits"]["inline_budget_s"] == 0.02


async def test_a_tool_sent_to_a_call_thread_is_tried_inline_again_later(counter_dir, monkeypatch):
    # One slow call (a busy machine) must not cost a tool its inline speed for good.
    monkeypatch.setattr(episodes, "THREADED_RETRY_S", 0.2)
    bundle = load_bundle(counter_dir)
    store = episodes.EpisodeStore(bundle, EnvRuntime(bundle.spec), worker_threads=2, inline_budget_s=0.02,
                                  max_episodes=10, idle_ttl_s=60)
    live = await store.create("counter_001", None)
    slow = await store.call_tool(live, "slow_add", {"item_id": "a", "seconds": 0.05})
    assert slow.error is None and store.threaded_tools() == ["slow_add"]
    assert store.call_now(live, "slow_add", {"item_id": "a", "seconds": 0}) is None  # on a thread for now
    await anyio.sleep(0.25)
    # Tried inline again and still slow: back on a thread, for twice as long.
    await store.call_tool(live, "slow_add", {"item_id": "a", "seconds": 0.05})
    await anyio.sleep(0.25)
    assert store.threaded_tools() == ["slow_add"]
    await anyio.sleep(0.25)
    fast = store.call_now(live, "slow_add", {"item_id": "a", "seconds": 0})
    assert fast is not None and fast.error is None and store.threaded_tools() == []
    state = await store.state(live)
    assert state["items"]["a"]["count"] == 3 and state["log"] == ["add a 1"] * 3  # each call ran once


@pytest.mark.parametrize("mode", ["in-process", "worker"])
async def test_a_call_that_swallows_every_interruption_does_not_take_the_server_down(counter_dir, mode):
    # Its own server: in-process, the endless loop keeps one call thread busy for the rest of the
    # process; with a worker, the worker is replaced and the episode goes on from before the call.
    with serve(counter_dir, "--call-timeout", "0.5", *(["--in-process"] if mode == "in-process" else [])) as server:
        stuck = create(server, scenario_id="counter_001")
        other = create(server, scenario_id="counter_001")
        started = time.monotonic()
        http, client = await mcp_session(stuck["mcp_url"])
        async with http, client:
            with anyio.fail_after(5):
                result = await client.call_tool("endless", {})
        assert result.is_error and "0.5 s" in result.content[0].text
        assert time.monotonic() - started < 2.0
        http, client = await mcp_session(other["mcp_url"])
        async with http, client:
            assert not (await client.call_tool("add", {"item_id": "a"})).is_error
        with server.client() as control:
            assert control.get("/healthz").status_code == 200
            info = control.get("/info").json()
        if mode == "in-process":
            assert info["stuck_calls"] == 1
        else:
            assert info["stuck_calls"] == 0 and info["worker_restarts"] == 1
            http, client = await mcp_session(stuck["mcp_url"])
            async with http, client:
                assert not (await client.call_tool("add", {"item_id": "a"})).is_error


def test_a_trajectory_keeps_diffs_within_its_limit_and_appends_cost_one_item(counter_dir):
    with serve(counter_dir, "--max-trajectory-chars", "3000") as server, server.client() as http:
        episode = create(server, scenario_id="counter_001")
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "add", "arguments": {"item_id": "a"}}}
        for _ in range(200):
            assert http.post(episode["mcp_url"], json=body).json()["result"]["isError"] is False
        calls = http.get(f"/episodes/{episode['episode_id']}/trajectory").json()["calls"]
    assert len(calls) == 200
    # Each add appends to the state's log: its diff names one new item, not the whole log twice.
    assert calls[0]["diff"] == [{"path": ["items", "a", "count"], "before": 0, "after": 1, "op": "replace"},
                                {"path": ["log", 0], "before": None, "after": "add a 1", "op": "add"}]
    kept = [c for c in calls if not c["diff_dropped"]]
    assert 10 < len(kept) < 200 and all(c["diff"] is None for c in calls[len(kept):]) and calls[-1]["diff_dropped"]
    assert sum(len(json.dumps(c["diff"])) for c in kept) < 3000


async def test_errors_come_back_as_tool_results(counter_server):
    episode = create(counter_server, scenario_id="counter_001")
    http, client = await mcp_session(episode["mcp_url"])
    async with http, client:
        wrong_type = await client.call_tool("add", {"item_id": 5})
        missing = await client.call_tool("add", {})
        unknown = await client.call_tool("teleport", {})
        private = await client.call_tool("_secret", {})
        crash = await client.call_tool("divide", {"a": 1, "b": 0})
        business = await client.call_tool("add", {"item_id": "zzz"})
        fine = await client.call_tool("add", {"item_id": "a"})
    assert wrong_type.is_error and "item_id" in wrong_type.content[0].text
    assert missing.is_error and "item_id" in missing.content[0].text
    assert unknown.is_error and "teleport" in unknown.content[0].text and "get_item" in unknown.content[0].text
    assert private.is_error
    assert crash.is_error and "ZeroDivisionError" in crash.content[0].text
    assert business.is_error and json.loads(business.content[0].text)["success"] is False
    assert not fine.is_error
    with counter_server.client() as control:
        path = f"/episodes/{episode['episode_id']}"
        trajectory = control.get(f"{path}/trajectory").json()
        validated = control.post(f"{path}/validate").json()
    assert trajectory["agent_errors"] == 4 and trajectory["env_errors"] == 1
    assert validated["agent_errors"] == 4 and validated["env_errors"] == 1


def test_control_api_bad_input(counter_server):
    with counter_server.client(headers={}) as anonymous:
        assert anonymous.get("/healthz").status_code == 200
        assert anonymous.get("/info").status_code == 401
        assert anonymous.post("/episodes", json={"scenario_id": "counter_001"}).status_code == 401
        wrong = anonymous.get("/info", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "Bearer" in wrong.json()["error"]
        # Unknown routes are 404 with or without a token: only control routes want one.
        for path in ("/.well-known/oauth-protected-resource", "/.well-known/oauth-authorization-server", "/register", "/",
                     "/episodes/x/nope", "/episodes/x/state/more", "/info/more", "/scenarios/a/b"):
            assert anonymous.get(path).status_code == 404, path
    with counter_server.client() as http:
        info = http.get("/info").json()
        assert info["limits"]["call_timeout_s"] == 0.5 and info["limits"]["max_body_bytes"] == 4096
        assert {"max_episodes", "idle_ttl_s", "check_timeout_s"} <= set(info["limits"])
        assert "token" not in json.dumps(info)

        malformed = http.post("/episodes", content=b"{not json")
        assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]
        too_big = http.post("/episodes", content=b"{" + b" " * 5000 + b"}")
        assert too_big.status_code == 413
        assert http.post("/episodes", json={"scenario_id": "nope"}).status_code == 404
        assert http.post("/episodes", json={}).status_code == 422
        assert http.post("/episodes", json={"scenario": "counter_001"}).status_code == 422
        assert http.get("/episodes/0123456789abcdef0123456789abcdef/state").status_code == 404
        assert http.get("/scenarios/nope").status_code == 404
        assert http.get("/scenarios/counter_001").json()["reference_solution"]

        episode = http.post("/episodes", json={"init_config": {"items": {}}}).json()
        assert len(episode["episode_id"]) >= 32  # 128 bits or more
        refused = http.post(f"/episodes/{episode['episode_id']}/validate")
        assert refused.status_code == 409
        custom = http.post(f"/episodes/{episode['episode_id']}/validate",
                           json={"checklist": [{"check_item": "empty", "check_func": "def check_func(final_state):\n    return final_state['items'] == {}"}]})
        assert custom.json()["score"] == 1.0
        assert http.delete(f"/episodes/{episode['episode_id']}").status_code == 200
        assert http.get(f"/episodes/{episode['episode_id']}/state").status_code == 404


def test_mcp_route_bad_input(counter_server, counter_dir):
    episode = create(counter_server, scenario_id="counter_001")
    with httpx.Client(base_url=counter_server.url, timeout=30) as http:
        headers = {"MCP-Protocol-Version": "2026-07-28"}
        assert http.post("/episodes/0123456789abcdef0123456789abcdef/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).status_code == 404
        parse = http.post(episode["mcp_path"], content=b"{oops", headers=headers)
        assert parse.status_code == 400 and parse.json()["error"]["code"] == -32700
        assert http.post(episode["mcp_path"], content=b"[" + b" " * 5000 + b"]").status_code == 413
        unknown = http.post(episode["mcp_path"], json={"jsonrpc": "2.0", "id": 1, "method": "resources/list"}, headers=headers)
        assert unknown.json()["error"]["code"] == -32601
        assert http.get(episode["mcp_path"]).status_code == 405
        foreign = http.post(episode["mcp_path"], json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, headers={**headers, "Origin": "https://evil.example"})
        assert foreign.status_code == 403
        # Behind a gateway or in a container the Host header is not localhost: still served.
        behind = http.post(episode["mcp_path"], json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, headers={**headers, "Host": "envs.internal:9000"})
        assert behind.status_code == 200 and len(behind.json()["result"]["tools"]) == len(EnvRuntime(load_bundle(counter_dir).spec).tools)


NOT_JSON_NUMBERS = {
    "NaN": "NaN is not part of JSON",
    "Infinity": "Infinity is not part of JSON",
    "-Infinity": "-Infinity is not part of JSON",
    "1e400": "1e400 is out of range",
    "-1e400": "-1e400 is out of range",
}
"""Number literals Python's parser takes (making NaN or an infinity) that JSON has no room for -> what the error says."""


def raw_call(name: str, arguments: str, request_id: int = 1) -> bytes:
    """A tools/call body with ``arguments`` as raw JSON text (json.dumps would not write NaN or 1e400)."""
    return b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"%s","arguments":%s}}' % (request_id, name.encode(), arguments.encode())


@pytest.mark.parametrize("mode", ["in-process", "worker"])
def test_numbers_json_cannot_carry_are_the_agents_error_and_reach_no_tool(counter_dir, mode):
    # Its own server in-process: there the tool would get the float itself, not null.
    with serve(counter_dir, *(["--in-process"] if mode == "in-process" else [])) as server, server.client() as http:
        episode = create(server, scenario_id="counter_001")
        path = f"/episodes/{episode['episode_id']}"
        for literal, problem in NOT_JSON_NUMBERS.items():
            for name, arguments, where in (("add", f'{{"item_id":"a","amount":{literal}}}', "argument 'amount'"),
                                           ("divide", f'{{"a":1,"b":[2,{{"c":{literal}}}]}}', "argument 'b'[1].c"),
                                           ("divide", f'{{"a":{literal},"b":2}}', "argument 'a'")):
                answer = http.post(episode["mcp_path"], content=raw_call(name, arguments))
                assert answer.status_code == 200, answer.text
                result = answer.json()["result"]
                assert result["isError"] is True
                assert result["content"][0]["text"] == f"Invalid arguments for {name!r}: {where} is not a valid JSON number: {problem}" + (
                    " (a JSON number must fit a 64-bit float)" if literal[-1].isdigit() else " (it has no NaN or Infinity)")
        assert http.get(f"{path}/state").json()["state"]["items"] == {"a": {"name": "A", "count": 0}}
        trajectory = http.get(f"{path}/trajectory").json()
        assert trajectory["agent_errors"] == 3 * len(NOT_JSON_NUMBERS) and trajectory["env_errors"] == 0
        # The record keeps each number as the agent wrote it (as text), never as null.
        assert [call["arguments"].get("amount") for call in trajectory["calls"][::3]] == list(NOT_JSON_NUMBERS)
        assert all(call["error_kind"] == "agent" and call["diff"] is None for call in trajectory["calls"])
        fine = http.post(episode["mcp_path"], content=raw_call("add", '{"item_id":"a","amount":3}')).json()["result"]
        assert fine["isError"] is False and json.loads(fine["content"][0]["text"])["data"]["count"] == 3
        # Small and huge numbers JSON carries still reach the tool, exactly as before.
        tiny = http.post(episode["mcp_path"], content=raw_call("divide", '{"a":1e-400,"b":1e308}')).json()["result"]
        assert json.loads(tiny["content"][0]["text"])["data"] == 0.0


def test_numbers_json_cannot_carry_outside_tool_arguments_make_the_body_no_json(counter_server):
    episode = create(counter_server, scenario_id="counter_001")
    with httpx.Client(base_url=counter_server.url, timeout=30) as http:
        for body, where in ((b'{"jsonrpc":"2.0","id":NaN,"method":"tools/call","params":{"name":"add","arguments":{"item_id":"a"}}}', "message.id"),
                            (b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"cursor":1e400}}', "message.params.cursor")):
            answer = http.post(episode["mcp_path"], content=body)
            assert answer.status_code == 400 and answer.json()["error"]["code"] == -32700
            assert f"{where} is not a valid JSON number" in answer.json()["error"]["message"]
    with counter_server.client() as control:
        refused = control.post("/episodes", content=b'{"init_config":{"items":{},"limit":Infinity}}')
        assert refused.status_code == 400 and "not a valid JSON number: Infinity" in refused.json()["error"]
        assert control.get(f"/episodes/{episode['episode_id']}/trajectory").json()["calls"] == []


def test_a_number_json_cannot_carry_over_the_sse_transport_is_the_agents_error(counter_server):
    episode = create(counter_server, scenario_id="counter_001")
    with counter_server.client() as http, http.stream("GET", f"/episodes/{episode['episode_id']}/sse") as stream:
        lines = stream.iter_lines()
        assert next(lines) == "event: endpoint"
        endpoint = next(lines).removeprefix("data: ")
        next(lines)
        assert http.post(f"/episodes/{episode['episode_id']}/{endpoint}", content=raw_call("add", '{"item_id":"a","amount":NaN}')).status_code == 202
        assert next(lines) == "event: message"
        result = json.loads(next(lines).removeprefix("data: "))["result"]
        assert result["isError"] is True and "argument 'amount' is not a valid JSON number: NaN" in result["content"][0]["text"]
        assert http.get(f"/episodes/{episode['episode_id']}/trajectory").json()["agent_errors"] == 1


def test_bad_serve_options_are_named_and_exit_2(counter_dir):
    done = subprocess.run(
        [sys.executable, "-m", "envscaler.cli", "serve", str(counter_dir), "--port", "0", "--inline-budget", "-1", "--workers", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--inline-budget" in done.stderr and "--workers" in done.stderr


def test_episode_limit_gives_429(counter_dir):
    with serve(counter_dir, "--max-episodes", "2") as server, server.client() as http:
        for _ in range(2):
            assert http.post("/episodes", json={"scenario_id": "counter_001"}).status_code == 201
        refused = http.post("/episodes", json={"scenario_id": "counter_001"})
        assert refused.status_code == 429 and "2" in refused.json()["error"]


def test_idle_episodes_expire(counter_dir):
    with serve(counter_dir, "--idle-ttl", "0.5") as server, server.client() as http:
        episode = http.post("/episodes", json={"scenario_id": "counter_001"}).json()
        deadline = time.monotonic() + 5
        while http.get("/info").json()["expired_episodes"] == 0:
            assert time.monotonic() < deadline, "the idle episode never expired"
            time.sleep(0.1)
        assert http.get(f"/episodes/{episode['episode_id']}/state").status_code == 404


def test_mcp_url_is_absolute_and_follows_the_gateway_header(counter_server):
    with counter_server.client() as http:
        direct = http.post("/episodes", json={"scenario_id": "counter_001"}).json()
        proxied = http.post("/episodes", json={"scenario_id": "counter_001"},
                            headers={"X-Envscaler-Base-Url": "http://gateway:8080/envs/counter"}).json()
    assert direct["mcp_url"] == counter_server.url + direct["mcp_path"]
    assert proxied["mcp_url"] == "http://gateway:8080/envs/counter" + proxied["mcp_path"]


def test_graceful_shutdown_on_sigterm(counter_dir, tmp_path):
    with open(tmp_path / "server.log", "w") as log, serve(counter_dir, log=log) as server:
        with server.client() as http:
            http.post("/episodes", json={"scenario_id": "counter_001"})
        stop(server.process)  # SIGTERM to its group: in the sandbox, bubblewrap forwards no signal
    lines = [json.loads(line) for line in (tmp_path / "server.log").read_text().splitlines() if line.startswith("{")]
    stopping = [line for line in lines if line["event"] == "server stopping"]
    assert stopping and stopping[0]["env"] == "counter" and stopping[0]["episodes"] == 1


def test_scenarios_listing(counter_server):
    with counter_server.client() as http:
        listing = http.get("/scenarios").json()
    assert [s["task_id"] for s in listing["scenarios"]] == ["counter_001", "counter_002"]
    assert listing["scenarios"][0]["task"] == counter_scenario()["task"]


def test_every_control_reply_is_exactly_its_wire_model(counter_server):
    """Each reply parses as its envscaler.wire model and dumps back to the same JSON: no field the model lacks."""
    with counter_server.client() as http:
        created = http.post("/episodes", json={"scenario_id": "counter_001"}).json()
        path = f"/episodes/{created['episode_id']}"
        http.post(created["mcp_path"], json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                             "params": {"name": "add", "arguments": {"item_id": "a"}}})
        replies = [
            (EpisodeCreated, created),
            (Health, http.get("/healthz").json()),
            (ServerInfo, http.get("/info").json()),
            (ScenarioListing, http.get("/scenarios").json()),
            (EpisodeIds, http.get("/episodes").json()),
            (EpisodeState, http.get(f"{path}/state").json()),
            (Trajectory, http.get(f"{path}/trajectory").json()),
            (EpisodeValidation, http.post(f"{path}/validate").json()),
            (EpisodeReset, http.post(f"{path}/reset", json={"scenario_id": "counter_002"}).json()),
            (EpisodeEnded, http.delete(path).json()),
        ]
    for model, reply in replies:
        assert model.model_validate(reply).model_dump(mode="json") == reply, model.__name__
    assert {"episode_id", "mcp_url", "task", "env_introduction", "tools"} <= set(created)
    assert {"score", "checks", "state_hash"} <= set(replies[7][1])


def test_the_last_validation_can_end_the_episode_and_bring_its_trajectory(counter_server):
    # What the harness asks at the end of every episode, in one request instead of three.
    with counter_server.client() as http:
        created = http.post("/episodes", json={"scenario_id": "counter_001"}).json()
        path = f"/episodes/{created['episode_id']}"
        for _ in range(2):
            http.post(created["mcp_path"], json={"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                                 "params": {"name": "add", "arguments": {"item_id": "a"}}})
        plain = http.post(f"{path}/validate").json()
        trajectory = http.get(f"{path}/trajectory").json()
        assert http.post(f"{path}/validate?end=0").json()["ended"] is False
        for wrong in ("end=yes", "end=", "end=1&end=1"):
            refused = http.post(f"{path}/validate?{wrong}")
            assert refused.status_code == 400 and "takes 0 or 1" in refused.json()["error"], refused.text
        final = http.post(f"{path}/validate?end=1").json()
        assert http.get(f"{path}/trajectory").status_code == 404
        assert created["episode_id"] not in http.get("/episodes").json()["episodes"]
    assert (plain["ended"], plain["calls"]) == (False, None)
    assert final["ended"] is True and final["calls"] == trajectory["calls"] and len(final["calls"]) == 2
    assert {key: final[key] for key in ("score", "checks", "state_hash")} == {key: plain[key] for key in ("score", "checks", "state_hash")}


def test_mcp_routing_headers_must_agree_with_the_body_and_errors_carry_the_sdk_status(counter_server):
    episode = create(counter_server, scenario_id="counter_001")
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}

    def call(name, headers, **params):
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": {"item_id": "a"}, **params}}
        return http.post(episode["mcp_path"], json=body, headers=headers)

    modern = {"MCP-Protocol-Version": "2026-07-28"}
    with httpx.Client(base_url=counter_server.url, timeout=30) as http:
        agreeing = call("add", {**modern, "Mcp-Method": "tools/call", "Mcp-Name": "add"}, _meta=meta)
        assert agreeing.status_code == 200 and agreeing.json()["result"]["isError"] is False
        encoded = call("add", {**modern, "Mcp-Method": "tools/call", "Mcp-Name": "=?base64?YWRk?="}, _meta=meta)
        assert encoded.status_code == 200 and encoded.json()["result"]["isError"] is False
        for headers in ({**modern, "Mcp-Method": "tools/list"}, {**modern, "Mcp-Name": "get_item"},
                        {"MCP-Protocol-Version": "2025-06-18", "Mcp-Method": "tools/call"}):
            refused = call("add", headers, _meta=meta)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == -32020, headers
        twice = http.post(episode["mcp_path"], headers=[("MCP-Protocol-Version", "2026-07-28"), ("Mcp-Method", "tools/call"),
                                                        ("Mcp-Method", "tools/call"), ("Content-Type", "application/json")],
                          content=json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "add"}}))
        assert twice.status_code == 400 and "more than once" in twice.json()["error"]["message"]
        # A parameter error gets the SDK's 400 in the sessionless era, 200 in the handshake era.
        nameless = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"arguments": {}}}
        modern_error = http.post(episode["mcp_path"], json=nameless, headers=modern)
        assert modern_error.status_code == 400 and modern_error.json()["error"]["code"] == -32602
        legacy_error = http.post(episode["mcp_path"], json=nameless, headers={"MCP-Protocol-Version": "2025-06-18"})
        assert legacy_error.status_code == 200 and legacy_error.json()["error"]["code"] == -32602
    with counter_server.client() as control:
        calls = control.get(f"/episodes/{episode['episode_id']}/trajectory").json()["calls"]
    assert [c["name"] for c in calls] == ["add", "add"], "refused requests never reach the environment"


async def test_ids_with_percent_and_slash_are_decoded_once(tmp_path):
    odd = "odd%41/1"  # a literal "%41" (not "A") and a slash
    bundle = write_bundle(tmp_path, counter_spec(), [counter_scenario(task_id=odd)])
    with serve(bundle) as server:
        with server.client() as http:
            assert http.get("/scenarios/odd%2541%2F1").json()["task_id"] == odd
            assert http.get("/scenarios/oddA%2F1").status_code == 404
        async with LeanHttp() as lean:
            control = EnvControl(lean, "counter", EnvEndpoint(url=server.url, token=server.token))
            assert (await control.scenario(odd)).task_id == odd
            assert (await control.create(odd)).scenario_id == odd


async def test_reset_with_no_body_goes_back_to_the_episodes_own_start(counter_server):
    episode = create(counter_server, scenario_id="counter_002")
    raw = create(counter_server, init_config={"items": {"z": {"name": "Z", "count": 9}}})
    for started in (episode, raw):
        http, client = await mcp_session(started["mcp_url"])
        async with http, client:
            await client.call_tool("add", {"item_id": "a" if started is episode else "z", "amount": 5})
    with counter_server.client() as control:
        path = f"/episodes/{episode['episode_id']}"
        before = control.get(f"{path}/state").json()["state"]
        reset = control.post(f"{path}/reset")
        assert reset.status_code == 200 and reset.json()["scenario_id"] == "counter_002"
        assert control.get(f"{path}/state").json()["state"]["items"]["a"]["count"] == 1 != before["items"]["a"]["count"]
        raw_path = f"/episodes/{raw['episode_id']}"
        assert control.post(f"{raw_path}/reset").status_code == 200
        assert control.get(f"{raw_path}/state").json()["state"]["items"] == {"z": {"name": "Z", "count": 9}}


def test_a_server_out_of_memory_refuses_episodes_with_507_and_keeps_serving(tmp_path):
    bundle = shop_bundle(tmp_path, 1_300_000)
    limit = 1536 * 1024 * 1024
    command = [sys.executable, "-m", "envscaler.cli", "serve", str(bundle), "--port", "0", "--token", "t", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    try:
        url = json.loads(process.stdout.readline())["url"]
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer t"}, timeout=60) as http:
            memory = http.get("/info").json()["memory"]
            # The workers' memory cgroup where the server can make one (as root), else the address space it gave them.
            assert (memory["limited_by"], memory["limit_mb"]) in {("cgroup", 1024), ("address space", 1536)}, memory
            assert memory["headroom_mb"] > 32
            first = http.post("/episodes", json={"scenario_id": "move_1"})
            assert first.status_code == 201
            config = {"seed": 3, "user_count": 2400}  # raw episodes: each builds its own ~2.5 MB of JSON state
            for _ in range(400):
                refused = http.post("/episodes", json={"init_config": config})
                if refused.status_code != 201:
                    break
            assert refused.status_code == 507, refused.text
            reason = refused.json()["error"]
            assert "memory" in reason and "end some" in reason
            assert http.get("/info").json()["memory"]["headroom_mb"] < 32 + 40
            # Still serving: the live episodes answer, and the health check is fine.
            assert http.get("/healthz").status_code == 200
            validation = http.post(f"/episodes/{first.json()['episode_id']}/validate")
            assert validation.status_code == 200 and validation.json()["score"] < 1.0
    finally:
        process.kill()  # its graceful stop would free a gigabyte of episodes first: not what this test is about
        process.wait(30)


def test_a_server_tells_its_supervisor_it_listens_through_the_ready_pipe(tmp_path):
    bundle = default_catalog() / "library_circulation"
    read_end, write_end = os.pipe()
    command = [sys.executable, "-m", "servers.cli", str(bundle), "--port", "0", "--log-level", "warning"]
    environment = {**os.environ, READY_FD_VARIABLE: str(write_end), "ENVSCALER_TOKEN": "t"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment, pass_fds=[write_end],
                               start_new_session=True)
    os.close(write_end)
    try:
        with os.fdopen(read_end) as pipe:
            ready = json.loads(pipe.readline())
            assert pipe.read() == ""  # the server closed its end: EOF, not a pipe held open
        assert ready["event"] == "listening" and ready["env_id"] == "library_circulation" and "token" not in ready
        assert httpx.get(ready["url"] + "/healthz").status_code == 200
    finally:
        stop(process)


def test_a_server_whose_call_threads_are_all_stuck_says_so_on_healthz(counter_dir):
    # In-process (a worker process would be replaced at the first stuck thread: tests/test_worker_process.py).
    with serve(counter_dir, "--in-process", "--workers", "2", "--call-timeout", "0.5") as server, server.client() as http:
        assert http.get("/healthz").json()["status"] == "ok"
        calls = []
        for _ in range(2):
            mcp_url = http.post("/episodes", json={"scenario_id": "counter_001"}).json()["mcp_url"]
            body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                    "params": {"name": "slow_add", "arguments": {"item_id": "a", "seconds": 4}}}
            calls.append((mcp_url, body))
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda call: http.post(call[0], json=call[1]).json()["result"], calls))
        # Each sleeping call is abandoned at its limit, but holds its thread until the sleep ends.
        assert all(r["isError"] and "abandoned" in r["content"][0]["text"] for r in results), results
        assert time.monotonic() - started < 3
        health = http.get("/healthz")
        assert health.status_code == 503 and health.json()["status"] == "no call capacity: all 2 call threads are stuck"
        deadline = time.monotonic() + 10
        while http.get("/healthz").status_code != 200:
            assert time.monotonic() < deadline, "the threads never came back"
            time.sleep(0.2)


async def test_a_tool_that_changes_its_list_argument_leaves_the_recorded_call_as_sent(tmp_path):
    with serve(tagger_bundle(tmp_path)) as server:
        episode = create(server, scenario_id="tagger_001")
        http, client = await mcp_session(episode["mcp_url"])
        async with http, client:
            kept = await client.call_tool("keep", {"tags": ["a"]})
            more = await client.call_tool("more", {"tag": "b"})
        assert not kept.is_error and not more.is_error
        with server.client() as control:
            path = f"/episodes/{episode['episode_id']}"
            calls = control.get(f"{path}/trajectory").json()["calls"]
            validated = control.post(f"{path}/validate").json()
    assert [c["arguments"] for c in calls] == [{"tags": ["a"]}, {"tag": "b"}]
    assert validated["score"] == 1.0


async def test_a_state_whose_nodes_link_back_to_their_parents_is_served(tmp_path):
    with serve(folders_bundle(tmp_path)) as server:
        episode = create(server, scenario_id="folders_001")
        http, client = await mcp_session(episode["mcp_url"])
        async with http, client:
            made = await client.call_tool("mkdir", {"name": "tmp"})
            shown = await client.call_tool("root_folder", {})
        assert not made.is_error and not shown.is_error, made.content[0].text + shown.content[0].text
        assert json.loads(shown.content[0].text)["children"][1] == {"name": "tmp", "parent": {"$ref": "#"}, "children": []}
        with server.client() as control:
            path = f"/episodes/{episode['episode_id']}"
            state = control.get(f"{path}/state").json()["state"]
            validated = control.post(f"{path}/validate").json()
    assert state["root"]["children"][1] == {"name": "tmp", "parent": {"$ref": "#/root"}, "children": []}
    assert validated["score"] == 1.0 and validated["env_errors"] == 0


async def test_exceptions_the_environment_declares_are_the_agents_errors(tmp_path):
    # Declared: the environment's own NotFound and ValueError; the KeyError of a bug is not.
    directory = write_bundle(tmp_path, users_spec(), [users_scenario([{"name": "rename_user", "arguments": {"user_id": "u1", "name": "Ann"}}])])
    with serve(directory) as server:
        episode = create(server, scenario_id="users_001")
        http, client = await mcp_session(episode["mcp_url"])
        async with http, client:
            missing = await client.call_tool("find_user", {"user_id": "u9"})
            bad = await client.call_tool("rename_user", {"user_id": "u9", "name": "Ann"})
            bug = await client.call_tool("broken", {})
            fine = await client.call_tool("rename_user", {"user_id": "u1", "name": "Ann"})
        with server.client() as control:
            path = f"/episodes/{episode['episode_id']}"
            trajectory = control.get(f"{path}/trajectory").json()
            validated = control.post(f"{path}/validate").json()
    assert missing.is_error and missing.content[0].text == "Error in 'find_user': NotFound: no user u9"
    assert bad.is_error and bad.content[0].text == "Error in 'rename_user': ValueError: no user u9"
    assert bug.is_error and "Environment error in 'broken': KeyError: 'missing' (env code line" in bug.content[0].text
    assert not fine.is_error
    calls = trajectory["calls"]
    assert [(c["error_kind"], c.get("exception")) for c in calls] == [("agent", "NotFound"), ("agent", "ValueError"), ("env", "KeyError"), (None, None)]
    assert (trajectory["agent_errors"], trajectory["env_errors"]) == (2, 1)
    assert validated["score"] == 1.0 and validated["agent_errors"] == 2


@pytest.mark.parametrize(
    ("requires", "unmet"),
    [
        (["envscaler-test-absent-distribution>=1.0"], "envscaler-test-absent-distribution>=1.0 (not installed)"),
        (["pydantic<1"], "pydantic<1 (pydantic 2."),
    ],
)
def test_serve_refuses_an_environment_whose_python_requirements_are_not_installed(tmp_path, requires, unmet):
    directory = write_bundle(tmp_path, counter_spec(requires=["pydantic>=2", *requires]), [counter_scenario()])
    done = subprocess.run([sys.executable, "-m", "servers.cli", str(directory), "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr and not done.stdout, done.stderr
    assert f"counter: needs Python distributions this interpreter lacks: {unmet}" in done.stderr
    assert f"Install them with: {sys.executable} -m pip install 'pydantic>=2' '{requires[0]}'" in done.stderr


def test_serve_runs_an_environment_whose_python_requirements_are_installed(tmp_path):
    # A marker that does not apply here leaves its requirement out.
    requires = ["pydantic>=2", "httpx", "envscaler-test-absent-distribution; sys_platform == 'nowhere'"]
    with serve(write_bundle(tmp_path, counter_spec(requires=requires), [counter_scenario()])) as server:
        episode = create(server, scenario_id="counter_001")
        with server.client() as control:
            assert control.get(f"/episodes/{episode['episode_id']}/state").status_code == 200
