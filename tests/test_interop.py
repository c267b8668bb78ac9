"""Real MCP clients of other stacks against episodes, directly and through the gateway, over both transports.

Each client (tests/interop/) lists the tools, reads, writes, sends invalid arguments and meets a
``success: false`` answer; the episode is then validated. One of them is an agent framework,
pydantic-ai, whose scripted model (FunctionModel) makes the calls and sees the errors as retries.
``.ci/run`` installs the TypeScript SDK (npm, Debian's nodejs) and a venv with the ``mcp`` 1.x SDK
and pydantic-ai.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
import subprocess

import httpx
import pytest

from tests.support.farm import counter_farm

INTEROP = Path(__file__).parent / "interop"
CLIENTS = {
    "typescript-sdk": ["node", str(INTEROP / "ts" / "client.mjs")],
    "python-mcp-1.x": [str(INTEROP / "mcp1-venv" / "bin" / "python"), str(INTEROP / "mcp1_client.py")],
    "python-mcp-2.x": [sys.executable, str(INTEROP / "mcp2_client.py")],
    "pydantic-ai": [str(INTEROP / "mcp1-venv" / "bin" / "python"), str(INTEROP / "pydantic_ai_agent.py")],
}
INSTALLED = {
    "typescript-sdk": INTEROP / "ts" / "node_modules" / "@modelcontextprotocol" / "sdk",
    "python-mcp-1.x": INTEROP / "mcp1-venv" / "bin" / "python",
    "pydantic-ai": INTEROP / "mcp1-venv" / "bin" / "python",
}


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    with counter_farm(tmp_path_factory.mktemp("interop")) as catalog:
        yield catalog


@pytest.mark.parametrize("via", ["direct", "gateway"])
@pytest.mark.parametrize("transport", ["http", "sse"])
@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_real_client_reads_writes_and_sees_errors_as_error_results(farm, client, transport, via):
    if client in INSTALLED:
        assert INSTALLED[client].exists(), f"{client} is not installed: run .ci/run (it installs the interop clients)"
    base = farm["envs"]["counter"]["url"] if via == "direct" else f"{farm['gateway']}/envs/counter"
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {farm['envs']['counter']['token']}"}, timeout=30) as http:
        episode = http.post("/episodes", json={"scenario_id": "counter_001"}).json()
        url = episode["mcp_url"] if transport == "http" else episode["mcp_url"].removesuffix("/mcp") + "/sse"
        ran = subprocess.run([*CLIENTS[client], transport, url], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr[-2000:]
        seen = json.loads(ran.stdout.strip().splitlines()[-1])
        validation = http.post(f"/episodes/{episode['episode_id']}/validate").json()
    tools = {t["name"]: t["readOnly"] for t in seen["tools"]}
    assert tools["get_item"] is True and tools["add"] is False
    assert seen["read"] == {"isError": False, "text": '{"success":true,"data":{"name":"A","count":0}}'}
    assert not seen["write"]["isError"] and json.loads(seen["write"]["text"])["data"]["count"] == 3
    assert seen["invalid"]["isError"] and "Invalid arguments for 'add'" in seen["invalid"]["text"]
    assert seen["refused"] == {"isError": True, "text": '{"success":false,"error":"no item nope"}'}
    assert validation["score"] == 1.0 and validation["agent_errors"] == 1 and validation["tool_errors"] == 1
