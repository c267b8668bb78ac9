"""The 2024-11-05 HTTP+SSE transport, driven by the mcp SDK's own SSE client, directly and through the gateway."""

from __future__ import annotations

import json

import httpx
import pytest
from mcp import Client
from mcp.client.sse import sse_client

from tests.support.farm import counter_farm

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    with counter_farm(tmp_path_factory.mktemp("sse")) as catalog:
        yield catalog


def control(farm, via: str) -> httpx.Client:
    base = farm["envs"]["counter"]["url"] if via == "direct" else f"{farm['gateway']}/envs/counter"
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {farm['envs']['counter']['token']}"}, timeout=30)


@pytest.mark.parametrize("via", ["direct", "gateway"])
async def test_the_sdk_sse_client_lists_calls_and_solves_an_episode(farm, via):
    with control(farm, via) as http:
        episode = http.post("/episodes", json={"scenario_id": "counter_001"}).json()
    sse_url = episode["mcp_url"].removesuffix("/mcp") + "/sse"
    async with Client(sse_client(sse_url), mode="legacy") as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert tools["get_item"].annotations.read_only_hint is True and "add" in tools
        assert not (await client.call_tool("add", {"item_id": "a", "amount": 3})).is_error
        invalid = await client.call_tool("add", {"item_id": "a", "amount": "lots"})
        assert invalid.is_error and "Invalid arguments" in invalid.content[0].text
        refused = await client.call_tool("get_item", {"item_id": "nope"})
        assert refused.is_error and '"success":false' in refused.content[0].text
    with control(farm, via) as http:
        validation = http.post(f"/episodes/{episode['episode_id']}/validate").json()
    assert validation["score"] == 1.0 and validation["agent_errors"] == 1 and validation["tool_errors"] == 1


def test_messages_need_an_open_stream_of_the_same_episode(farm):
    with control(farm, "direct") as http:
        first = http.post("/episodes", json={"scenario_id": "counter_001"}).json()["episode_id"]
        second = http.post("/episodes", json={"scenario_id": "counter_001"}).json()["episode_id"]
        message = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        assert http.post(f"/episodes/{first}/messages?session_id=nope", json=message).status_code == 404
        with http.stream("GET", f"/episodes/{first}/sse") as stream:
            assert stream.headers["content-type"] == "text/event-stream"
            lines = stream.iter_lines()
            assert next(lines) == "event: endpoint"
            endpoint = next(lines).removeprefix("data: ")
            assert endpoint.startswith("messages?session_id=")
            # Another episode's stream is not this one's, even with a valid session id.
            assert http.post(f"/episodes/{second}/{endpoint}", json=message).status_code == 404
            assert http.post(f"/episodes/{first}/{endpoint}", json=message).status_code == 202
            next(lines)  # the blank line that ends the endpoint event
            assert next(lines) == "event: message"
            answer = json.loads(next(lines).removeprefix("data: "))
            assert answer["id"] == 1 and {t["name"] for t in answer["result"]["tools"]} >= {"add", "get_item"}
        assert http.post(f"/episodes/{first}/sse").status_code == 405
        assert http.get("/episodes/unknown/sse").status_code == 404
