"""The ``mcp`` SDK 1.x client against one episode of the counter environment (runs in a 1.x venv).

Usage: python mcp1_client.py http|sse URL   Prints one JSON object: what each step saw.
"""

import json
import sys
from importlib.metadata import version

import anyio
from mcp import ClientSession
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamablehttp_client


def seen(result):
    return {"isError": bool(result.isError), "text": "".join(part.text for part in result.content)}


async def main(transport_name: str, url: str) -> None:
    transport = sse_client(url) if transport_name == "sse" else streamablehttp_client(url)
    async with transport as streams:
        async with ClientSession(streams[0], streams[1]) as session:
            initialized = await session.initialize()
            listed = await session.list_tools()
            steps = {
                "read": await session.call_tool("get_item", {"item_id": "a"}),
                "write": await session.call_tool("add", {"item_id": "a", "amount": 3}),
                "invalid": await session.call_tool("add", {"item_id": 7}),
                "refused": await session.call_tool("get_item", {"item_id": "nope"}),
            }
    print(json.dumps({
        "sdk": version("mcp"),
        "protocol": initialized.protocolVersion,
        "tools": [{"name": t.name, "readOnly": t.annotations.readOnlyHint if t.annotations else None} for t in listed.tools],
        **{name: seen(result) for name, result in steps.items()},
    }))


anyio.run(main, sys.argv[1], sys.argv[2])
