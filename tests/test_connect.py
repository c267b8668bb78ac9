"""``envscaler connect``: an episode as a stdio MCP server, driven by the official SDK's stdio client."""

from __future__ import annotations

import json
import socket
import sys

import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from tests.support.bundles import counter_bundle
from tests.support.cli import envscaler
from tests.support.server import serve

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(counter_bundle(tmp_path_factory.mktemp("connect"))) as running:
        yield running


def stdio(url: str) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=["-m", "envscaler.cli", "connect", url])


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_the_sdk_stdio_client_drives_an_episode_through_connect(server, mode):
    with server.client() as http:
        episode = http.post("/episodes", json={"scenario_id": "counter_001"}).json()
    async with Client(stdio(episode["mcp_url"]), mode=mode) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert {"get_item", "add", "rename"} <= set(tools)
        assert tools["get_item"].annotations.read_only_hint is True
        read = await client.call_tool("get_item", {"item_id": "a"})
        assert not read.is_error and json.loads(read.content[0].text)["data"]["count"] == 0
        wrote = await client.call_tool("add", {"item_id": "a", "amount": 3})
        assert not wrote.is_error
        invalid = await client.call_tool("add", {"item_id": 7})
        assert invalid.is_error and "Invalid arguments" in invalid.content[0].text
        refused = await client.call_tool("get_item", {"item_id": "zzz"})
        assert refused.is_error and json.loads(refused.content[0].text) == {"success": False, "error": "no item zzz"}
    with server.client() as http:
        validation = http.post(f"/episodes/{episode['episode_id']}/validate").json()
    assert validation["score"] == 1.0 and validation["agent_errors"] == 1 and validation["tool_errors"] == 1


async def test_an_episode_that_does_not_answer_fails_the_request_instead_of_hanging():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/episodes/x/mcp"
    with pytest.raises(Exception) as raised:
        async with Client(stdio(dead), mode="legacy") as client:
            await client.list_tools()
    assert any("did not answer" in str(e) for e in _leaves(raised.value))


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def test_help_prints_config_blocks_for_the_common_hosts():
    result = envscaler("connect", "--help")
    assert result.returncode == 0
    for host in ("Claude Desktop", "Cursor", "Codex", "VS Code"):
        assert host in result.stdout
    assert "[mcp_servers.envscaler]" in result.stdout and '"type": "stdio"' in result.stdout
    blocks = [json.loads(block) for block in _json_blocks(result.stdout)]
    assert blocks[0]["mcpServers"]["envscaler"]["args"] == ["connect", "MCP_URL"]
    assert blocks[1]["servers"]["envscaler"]["args"] == ["connect", "MCP_URL"]


def _json_blocks(text: str) -> list[str]:
    """The top-level ``{...}`` blocks of the help text, as written (lines from '{' to '}')."""
    blocks, current = [], None
    for line in text.splitlines():
        if line == "{":
            current = [line]
        elif current is not None:
            current.append(line)
            if line == "}":
                blocks.append("\n".join(current))
                current = None
    return blocks


@pytest.mark.parametrize("where", ["ended", "mistyped", "sse"])
async def test_an_episode_url_that_is_no_episode_fails_the_initialize_naming_the_cause(server, where):
    with server.client() as http:
        episode = http.post("/episodes", json={"scenario_id": "counter_001"}).json()
        if where == "ended":
            http.delete(f"/episodes/{episode['episode_id']}")
    url = {"ended": episode["mcp_url"], "mistyped": episode["mcp_url"].replace(episode["episode_id"], "nope"),
           "sse": episode["mcp_url"].removesuffix("/mcp") + "/sse"}[where]
    with pytest.raises(Exception) as raised:
        async with Client(stdio(url), mode="legacy") as client:
            await client.list_tools()
    messages = [str(e) for e in _leaves(raised.value)]
    expected = "give connect the episode's /mcp URL" if where == "sse" else "no such episode: it ended, expired or the URL is mistyped"
    assert any("HTTP 4" in m and expected in m for m in messages), messages
