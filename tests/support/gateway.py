"""Replay a bundled scenario's reference solution through a farm's gateway with the official MCP client."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from envscaler import default_catalog, load_bundle


@dataclass
class Replay:
    gateway: str
    mcp_url: str
    listed_tools: set[str]
    reference_tools: set[str]
    score: float


def replay_through_gateway(catalog_file: Path, env_id: str) -> Replay:
    """Create an episode of ``env_id``'s first scenario via the gateway, replay it over MCP, validate."""
    catalog = json.loads(catalog_file.read_text())
    gateway = catalog["gateway"]
    scenario = load_bundle(default_catalog() / env_id).scenarios[0]
    headers = {"Authorization": f"Bearer {catalog['envs'][env_id]['token']}"}
    listed: set[str] = set()
    with httpx.Client(base_url=f"{gateway}/envs/{env_id}", headers=headers) as control:
        episode = control.post("/episodes", json={"scenario_id": scenario.task_id}).json()

        async def replay() -> None:
            async with httpx2.AsyncClient() as http, Client(streamable_http_client(episode["mcp_url"], http_client=http)) as client:
                listed.update(t.name for t in (await client.list_tools()).tools)
                for call in scenario.reference_solution:
                    result = await client.call_tool(call.name, call.arguments)
                    assert not result.is_error, result.content[0].text

        anyio.run(replay)
        score = control.post(f"/episodes/{episode['episode_id']}/validate").json()["score"]
    return Replay(gateway=gateway, mcp_url=episode["mcp_url"], listed_tools=listed,
                  reference_tools={c.name for c in scenario.reference_solution}, score=score)
