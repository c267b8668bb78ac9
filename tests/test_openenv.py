"""The OpenEnv listener of real servers, driven by openenv-core's own clients over WebSockets."""

from __future__ import annotations

import json
import time

import anyio
import httpx
import pytest
import websockets

from tests.support.extras import require

require("openenv.core", extra="openenv")

from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction  # noqa: E402
from openenv.core.generic_client import GenericEnvClient  # noqa: E402
from openenv.core.mcp_client import MCPToolClient  # noqa: E402

from envscaler import EnvRuntime, default_catalog, find_bundles, load_bundle  # noqa: E402
from envscaler.wire import FarmCatalog  # noqa: E402
from tests.support.bundles import write_bundle  # noqa: E402
from tests.support.cli import envscaler  # noqa: E402
from tests.support.openenv_servers import serve_openenv  # noqa: E402

pytestmark = pytest.mark.anyio

DESK_CODE = '''
class Desk:
    def __init__(self, init_config: dict):
        self.notes = []
        self.cleared = 0

    def reset(self) -> dict:
        """Clear every note (a tool that happens to share a name with the protocol's reset)."""
        self.notes = []
        self.cleared += 1
        return {"success": True}

    def reset_tool(self) -> dict:
        """Say which tool this is (its name is what a renamed reset would be called)."""
        return {"success": True, "data": "the real reset_tool"}

    def state(self) -> dict:
        """Show the notes."""
        return {"success": True, "data": list(self.notes)}

    def finish(self, text: str) -> dict:
        """Finish a note and pin it.

        Args:
            text (str): The note.
        """
        self.notes.append(text)
        return {"success": True, "data": list(self.notes)}
'''

NOTES_ARE_DONE = {"check_item": "only the note 'done'", "check_func": "def check_func(final_state):\n    return final_state['notes'] == ['done']"}


def desk_scenario(task_id: str, notes: list[str]) -> dict:
    return {
        "task_id": task_id,
        "env_id": "desk",
        "init_config": {"notes": notes},
        "task": "Clear the desk and leave only the note 'done'.",
        "checklist_with_func": [NOTES_ARE_DONE],
        "reference_solution": [{"name": "reset", "arguments": {}}, {"name": "finish", "arguments": {"text": "done"}}],
    }


@pytest.fixture(scope="module")
def catalog_servers():
    with serve_openenv(find_bundles(default_catalog())) as servers:
        yield servers


@pytest.fixture(scope="module")
def desk(tmp_path_factory):
    spec = {"env_id": "desk", "env_class_name": "Desk", "env_class_code": DESK_CODE, "environment_introduction": "A desk of notes."}
    directory = write_bundle(tmp_path_factory.mktemp("desk"), spec, [desk_scenario("desk_a", ["old"]), desk_scenario("desk_b", ["x", "y"])])
    with serve_openenv([directory], "--openenv-sessions", "3", "--openenv-idle", "1", "--openenv-max-steps", "3") as (server,):
        yield server


def live_episodes(server) -> list[str]:
    with server.client() as http:
        return http.get("/episodes").json()["episodes"]


async def test_reference_solutions_score_one_on_the_bundled_catalog(catalog_servers):
    replayed = 0
    for server, directory in zip(catalog_servers, find_bundles(default_catalog()), strict=True):
        bundle = load_bundle(directory)
        expected_tools = {t.name for t in EnvRuntime(bundle.spec).tool_list()} | {"finish"}
        async with MCPToolClient(base_url=server.openenv_url) as client:
            for scenario in bundle.scenarios:
                if not scenario.reference_solution or not scenario.checklist_with_func:
                    continue
                await client.reset(scenario_id=scenario.task_id)
                assert {t.name for t in await client.list_tools(use_cache=False)} == expected_tools
                for call in scenario.reference_solution:
                    result = await client.step(CallToolAction(tool_name=call.name, arguments=call.arguments))
                    assert not result.done and result.reward is None
                    assert result.observation.result["is_error"] is False, (scenario.task_id, call.name, result.observation.result)
                final = await client.step(CallToolAction(tool_name="finish", arguments={}))
                assert (final.done, final.reward) == (True, 1.0), scenario.task_id
                state = await client.state()
                assert state.step_count == len(scenario.reference_solution)
                replayed += 1
        assert live_episodes(server) == []  # finished episodes are ended on the server
    assert replayed >= 60


async def test_a_thousand_and_twenty_four_concurrent_sessions(catalog_servers):
    server = catalog_servers[0]
    clients = [GenericEnvClient(base_url=server.openenv_url, message_timeout_s=120) for _ in range(1024)]
    tasks: set[str] = set()
    # Sessions stay open once made; only the opening is paced, so that 1024 WebSocket handshakes at
    # once on a loaded machine do not run past the client's handshake timeout.
    opening = anyio.CapacityLimiter(64)

    async def open_one(index: int, client: GenericEnvClient) -> None:
        async with opening:
            await client.connect()
            reset = await client.reset(seed=index)
        tasks.add(reset.observation["episode_id"])
        listing = await client.step({"type": "list_tools"})
        assert listing.observation["tools"]

    async with anyio.create_task_group() as group:
        for index, client in enumerate(clients):
            group.start_soon(open_one, index, client)
    try:
        assert len(tasks) == 1024
        assert set(live_episodes(server)) >= tasks
        with server.client() as http:
            assert http.get("/info").json()["live_episodes"] >= 1024
    finally:
        async with anyio.create_task_group() as group:
            for client in clients:
                group.start_soon(client.close)
    # Closing a session ends its episode.
    deadline = time.monotonic() + 20
    while set(live_episodes(server)) & tasks and time.monotonic() < deadline:
        await anyio.sleep(0.2)
    assert not set(live_episodes(server)) & tasks


async def test_reserved_tool_names_are_renamed_and_still_work(desk):
    async with MCPToolClient(base_url=desk.openenv_url) as client:
        await client.reset(scenario_id="desk_a")
        names = {t.name for t in await client.list_tools()}
        assert names == {"reset_tool2", "reset_tool", "state_tool", "finish_tool", "finish"}
        assert await client.call_tool("reset_tool") == {"success": True, "data": "the real reset_tool"}
        await client.reset(scenario_id="desk_a")  # the desk's step limit is 3
        await client.call_tool("reset_tool2")
        assert (await client.call_tool("finish_tool", text="done"))["data"] == ["done"]
        final = await client.step(CallToolAction(tool_name="finish", arguments={"answer": "all clear"}))
        assert (final.done, final.reward) == (True, 1.0)


async def test_reset_after_reset_ends_the_first_episode(desk):
    async with GenericEnvClient(base_url=desk.openenv_url) as client:
        first = (await client.reset(scenario_id="desk_a")).observation
        assert first["task"].startswith("Clear the desk") and first["env_introduction"] == "A desk of notes."
        await client.step({"type": "call_tool", "tool_name": "finish_tool", "arguments": {"text": "half"}})
        second = (await client.reset(scenario_id="desk_a")).observation
        assert first["episode_id"] != second["episode_id"]
        episodes = live_episodes(desk)
        assert first["episode_id"] not in episodes and second["episode_id"] in episodes
        state = await client.state()
        assert (state["episode_id"], state["scenario_id"], state["step_count"], state["done"]) == (second["episode_id"], "desk_a", 0, False)
        notes = await client.step({"type": "call_tool", "tool_name": "state_tool", "arguments": {}})
        assert notes.observation["result"]["data"] == {"success": True, "data": ["old"]}  # the fresh initial state


async def test_seed_or_id_chooses_the_scenario_and_bad_resets_are_errors(desk):
    async with GenericEnvClient(base_url=desk.openenv_url) as client:
        assert (await client.reset(seed=0)).observation["scenario_id"] == "desk_a"
        assert (await client.reset(seed=3)).observation["scenario_id"] == "desk_b"
        assert (await client.reset()).observation["scenario_id"] in {"desk_a", "desk_b"}
        with pytest.raises(RuntimeError, match="no scenario 'desk_z'"):
            await client.reset(scenario_id="desk_z")
        with pytest.raises(RuntimeError, match="unknown reset parameters"):
            await client.reset(level=3)


async def test_step_limit_scores_and_ends_the_episode(desk):
    async with MCPToolClient(base_url=desk.openenv_url) as client:
        with pytest.raises(RuntimeError, match="call reset"):
            await client.step(CallToolAction(tool_name="state_tool", arguments={}))
        await client.reset(scenario_id="desk_b")
        first = await client.step(CallToolAction(tool_name="reset_tool2", arguments={}))
        missing = await client.step(CallToolAction(tool_name="no_such_tool", arguments={}))
        assert missing.observation.error.error_type.value == "tool_not_found" and not missing.done
        last = await client.step(CallToolAction(tool_name="finish_tool", arguments={"text": "done"}))
        assert (first.done, last.done, last.reward) == (False, True, 1.0)
        assert last.observation.result["data"] == {"success": True, "data": ["done"]}
        with pytest.raises(RuntimeError, match="episode is over"):
            await client.step(CallToolAction(tool_name="state_tool", arguments={}))
        assert isinstance((await client.step(ListToolsAction())).observation.tools, list)


async def test_bad_arguments_come_back_as_tool_errors(desk):
    async with MCPToolClient(base_url=desk.openenv_url) as client:
        await client.reset(scenario_id="desk_a")
        result = await client.step(CallToolAction(tool_name="finish_tool", arguments={"text": 5}))
        assert result.observation.result["is_error"] is True and "text" in result.observation.result["content"][0]["text"]
        assert result.observation.error is None and not result.done


async def test_numbers_json_cannot_carry_are_the_agents_error_and_reach_no_tool(desk):
    # Raw WebSocket text: openenv-core's clients (json.dumps) would not write NaN or 1e400.
    async with websockets.connect(desk.openenv_url.replace("http://", "ws://") + "/ws") as ws:
        for literal in ("NaN", "-Infinity", "1e400"):
            await ws.send(json.dumps({"type": "reset", "data": {"scenario_id": "desk_a"}}))
            episode = json.loads(await ws.recv())["data"]["observation"]["episode_id"]
            await ws.send('{"type":"step","data":{"type":"call_tool","tool_name":"finish_tool","arguments":{"text":%s}}}' % literal)
            result = json.loads(await ws.recv())["data"]["observation"]["result"]
            assert result["is_error"] is True
            assert "argument 'text' is not a valid JSON number: " in result["content"][0]["text"], result
            await ws.send(json.dumps({"type": "step", "data": {"type": "call_tool", "tool_name": "state_tool", "arguments": {}}}))
            notes = json.loads(await ws.recv())["data"]["observation"]["result"]
            assert notes["is_error"] is False and json.loads(notes["content"][0]["text"])["data"] == ["old"]
            with desk.client() as control:
                trajectory = control.get(f"/episodes/{episode}/trajectory").json()
            assert trajectory["agent_errors"] == 1 and [c["name"] for c in trajectory["calls"]] == ["finish", "state"]


async def test_session_cap_and_idle_sessions_are_reaped(desk):
    clients = [GenericEnvClient(base_url=desk.openenv_url) for _ in range(3)]
    episodes = []
    for client in clients:
        episodes.append((await client.reset(scenario_id="desk_a")).observation["episode_id"])
    try:
        # A session opens with the WebSocket; past the cap the server answers with an error and closes.
        async with websockets.connect(desk.openenv_url.replace("http://", "ws://") + "/ws") as extra:
            refusal = json.loads(await extra.recv())
        assert (refusal["type"], refusal["data"]["code"]) == ("error", "CAPACITY_REACHED")
        # Idle past 1 s, the sessions are reaped (openenv-core checks every 5 s at the least): their
        # episodes end, and their slots free up.
        deadline = time.monotonic() + 15
        while set(live_episodes(desk)) & set(episodes) and time.monotonic() < deadline:
            await anyio.sleep(0.5)
        assert not set(live_episodes(desk)) & set(episodes)
        with pytest.raises(RuntimeError, match="session was closed"):
            await clients[0].step({"type": "list_tools"})
        async with GenericEnvClient(base_url=desk.openenv_url) as fresh:
            assert (await fresh.reset(scenario_id="desk_a")).observation["scenario_id"] == "desk_a"
    finally:
        for client in clients:
            await client.close()


def test_plain_http_routes_of_the_protocol(desk):
    with httpx.Client(base_url=desk.openenv_url, timeout=30) as http:
        assert http.get("/health").json()["status"] == "healthy"
        schema = http.get("/schema").json()
        assert schema["action"]["properties"]["tool_name"]
        assert http.get("/metadata").json()["name"] == "desk"
    with desk.client() as control:
        assert control.get("/info").json()["limits"]["openenv"] == {
            "openenv_port": 0, "max_sessions": 3, "session_idle_s": 1.0, "max_steps": 3,
        }


async def test_a_dead_server_is_an_error_not_a_zero_reward(tmp_path):
    spec = {"env_id": "desk", "env_class_name": "Desk", "env_class_code": DESK_CODE, "environment_introduction": "A desk of notes."}
    directory = write_bundle(tmp_path, spec, [desk_scenario("desk_a", ["old"])])
    with serve_openenv([directory]) as (server,):
        async with MCPToolClient(base_url=server.openenv_url) as client:
            await client.reset(scenario_id="desk_a")
            server.process.kill()
            server.process.wait()
            with pytest.raises(websockets.ConnectionClosed):
                await client.step(CallToolAction(tool_name="finish", arguments={}))
        with pytest.raises(ConnectionError):
            await MCPToolClient(base_url=server.openenv_url).connect()


async def test_farm_up_with_openenv_writes_each_listener_into_the_catalog(tmp_path):
    catalog = tmp_path / "farm.json"
    names = ["library_circulation", "it_helpdesk"]
    up = envscaler("farm", "up", *(str(default_catalog() / n) for n in names), "--backend", "process", "--openenv", "--catalog", str(catalog))
    assert up.returncode == 0, up.stderr
    try:
        farm = FarmCatalog.model_validate_json(catalog.read_text())
        assert sorted(farm.envs) == sorted(names)
        assert len({endpoint.openenv_url for endpoint in farm.envs.values()} | {farm.envs[n].url for n in names}) == 4
        bundle = load_bundle(default_catalog() / "library_circulation")
        scenario = next(s for s in bundle.scenarios if s.reference_solution and s.checklist_with_func)
        async with MCPToolClient(base_url=farm.envs["library_circulation"].openenv_url) as client:
            await client.reset(scenario_id=scenario.task_id)
            for call in scenario.reference_solution:
                await client.step(CallToolAction(tool_name=call.name, arguments=call.arguments))
            final = await client.step(CallToolAction(tool_name="finish", arguments={}))
        assert (final.done, final.reward) == (True, 1.0)
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))


def test_farm_up_with_openenv_needs_the_process_backend(tmp_path):
    up = envscaler("farm", "up", "--backend", "docker", "--openenv", "--catalog", str(tmp_path / "farm.json"))
    assert up.returncode == 2 and "--openenv needs the process backend" in up.stderr, up.stderr
    assert not (tmp_path / "farm.json").exists()
