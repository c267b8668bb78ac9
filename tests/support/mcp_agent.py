"""A small external MCP agent for the ``command`` agent test: the official SDK client, its own process.

Usage: python mcp_agent.py MCP_URL  (the task comes in $ENVSCALER_TASK). It adds 3 to item "a".
"""

import os
import sys

import anyio
from mcp import Client


async def main(url: str) -> None:
    async with Client(url) as client:
        tools = {t.name for t in (await client.list_tools()).tools}
        assert "add" in tools, tools
        result = await client.call_tool("add", {"item_id": "a", "amount": 3})
        print(f"task was: {os.environ['ENVSCALER_TASK']}; add returned error={result.is_error}")


anyio.run(main, sys.argv[1])
