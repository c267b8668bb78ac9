"""A pydantic-ai agent with a scripted model (FunctionModel) using an episode's tools over MCP.

Runs in the interop venv (pydantic-ai-slim[mcp], mcp 1.x). Usage: python pydantic_ai_agent.py http|sse URL.
The model calls a read, a write, invalid arguments and a refused read, one per turn, then answers;
prints one JSON object: the tools it was offered and how each call's answer came back to it.
"""

import json
import sys
from importlib.metadata import version

import anyio
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import ModelResponse, RetryPromptPart, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

SCRIPT = [
    ("read", "get_item", {"item_id": "a"}),
    ("write", "add", {"item_id": "a", "amount": 3}),
    ("invalid", "add", {"item_id": 7}),
    ("refused", "get_item", {"item_id": "nope"}),
]

LABELS = {label for label, _, _ in SCRIPT}


async def main(transport_name: str, url: str) -> None:
    offered: list[dict] = []
    answers: dict[str, dict] = {}

    def model(messages, info: AgentInfo) -> ModelResponse:
        offered[:] = [{"name": tool.name, "readOnly": ((tool.metadata or {}).get("annotations") or {}).get("readOnlyHint")}
                      for tool in info.function_tools]
        for part in messages[-1].parts:
            # An isError result reaches the model as a call to retry (a retry prompt, or a return marked so).
            if isinstance(part, (ToolReturnPart, RetryPromptPart)) and part.tool_call_id in LABELS:
                content = part.content if isinstance(part.content, str) else json.dumps(part.content, separators=(",", ":"))
                retried = isinstance(part, RetryPromptPart) or getattr(part, "outcome", "success") != "success"
                answers[part.tool_call_id] = {"isError": retried, "text": content}
        step = len(answers)
        if step < len(SCRIPT):
            label, tool, arguments = SCRIPT[step]
            return ModelResponse(parts=[ToolCallPart(tool_name=tool, args=arguments, tool_call_id=label)])
        return ModelResponse(parts=[TextPart("done")])

    # fastmcp, under pydantic-ai, takes a URL ending in /sse for the HTTP+SSE transport.
    assert url.endswith("/sse") == (transport_name == "sse"), url
    toolset = MCPToolset(url, max_retries=3)
    agent = Agent(FunctionModel(model), toolsets=[toolset])
    async with agent:
        result = await agent.run("Add 3 to item a.")
    print(json.dumps({"sdk": f"pydantic-ai-slim {version('pydantic-ai-slim')}", "final": result.output,
                      "tools": offered, **answers}))


anyio.run(main, sys.argv[1], sys.argv[2])
