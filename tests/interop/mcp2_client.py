"""The ``mcp`` SDK 2.x client (the project's own) against one episode of the counter environment.

Usage: python mcp2_client.py http|sse URL   Prints one JSON object: what each step saw.
"""

import json
import sys
from importlib.metadata import version

import anyio
from mcp import Client
from mcp.client.sse import sse_client


def seen(result):
    return {"isError": bool(result.is_error), "text": "".join(part.text for part in result.content)}


async def main(transport_name: str, url: str) -> None:
    # Streamable HTTP in "auto" mode takes the 2026-07-28 sessionless protocol; SSE is the handshake era only.
    server = sse_client(url) if transport_name == "sse" else url
    async with Client(server, mode="legacy" if transport_name == "sse" else "auto") as client:
        listed = await client.list_tools()
        steps = {
            "read": await client.call_tool("get_item", {"item_id": "a"}),
            "write": await client.call_tool("add", {"item_id": "a", "amount": 3}),
            "invalid": await client.call_tool("add", {"item_id": 7}),
            "refused": await client.call_tool("get_item", {"item_id": "nope"}),
        }
    print(json.dumps({
        "sdk": version("mcp"),
        "tools": [{"name": t.name, "readOnly": t.annotations.read_only_hint if t.annotations else None} for t in listed.tools],
        **{name: seen(result) for name, result in steps.items()},
    }))


anyio.run(main, sys.argv[1], sys.argv[2])
