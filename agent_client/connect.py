"""``envscaler connect MCP_URL``: an episode's MCP endpoint as a stdio MCP server, for stdio-only hosts.

Claude Desktop, Codex, Cursor and VS Code start local MCP servers as programs that speak JSON-RPC,
one message per line, on stdin and stdout. This relays each message to the episode's streamable
HTTP endpoint and writes the answer back, so such a host drives an episode of any farm or server
(directly or through the gateway). Requests are relayed concurrently, so a slow tool call does not
hold up a ping. Nothing but protocol lines ever reaches stdout; errors go to stderr and, for a
request, come back as its JSON-RPC error so that the host does not wait forever.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx

from envscaler.errors import EXIT_OK

_INTERNAL_ERROR = -32603
_ACCEPT = "application/json, text/event-stream"


def _envscaler_command() -> str:
    """The ``envscaler`` program a host should start: this environment's own, as hosts do not share its PATH."""
    beside = Path(sys.executable).parent / "envscaler"
    return str(beside) if beside.exists() else "envscaler"


def config_blocks(url: str = "MCP_URL") -> str:
    """Ready-to-paste configuration for the common stdio hosts."""
    command = _envscaler_command()
    entry = {"command": command, "args": ["connect", url]}
    return "\n".join([
        "Claude Desktop (claude_desktop_config.json) and Cursor (~/.cursor/mcp.json):",
        json.dumps({"mcpServers": {"envscaler": entry}}, indent=2),
        "",
        "Codex (~/.codex/config.toml):",
        "[mcp_servers.envscaler]",
        f"command = {json.dumps(command)}",
        f'args = ["connect", {json.dumps(url)}]',
        "",
        "VS Code (.vscode/mcp.json):",
        json.dumps({"servers": {"envscaler": {"type": "stdio", **entry}}}, indent=2),
    ])


def _messages(response: httpx.Response) -> list[Any]:
    """The JSON-RPC messages of an answer: a JSON body, or the ``data:`` events of an SSE stream.

    Raises ValueError when the answer holds anything else: an HTTP error body (``{"error": "no live
    episode ..."}``) is no message, and a host given one would wait forever for its answer.
    """
    if not response.content.strip():
        return []
    try:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            events = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
            messages = [json.loads(event) for event in events if event]
        else:
            messages = [json.loads(response.content)]
    except ValueError:
        raise ValueError(_http_failure(response)) from None
    if not all(isinstance(m, dict) and m.get("jsonrpc") == "2.0" for m in messages):
        raise ValueError(_http_failure(response))
    return messages


def _http_failure(response: httpx.Response) -> str:
    """Why an answer is no MCP answer, in the words a host shows its user."""
    try:
        body = response.json()
        detail = body.get("error") if isinstance(body, dict) else None
    except ValueError:
        detail = None
    detail = str(detail) if detail else " ".join(response.text.split())[:300]
    if response.request.url.path.endswith("/sse"):
        why = "an /sse URL is for the HTTP+SSE transport; give connect the episode's /mcp URL"
    elif response.status_code in (404, 410):
        why = "no such episode: it ended, expired or the URL is mistyped ('envscaler episode new' makes a new one)"
    elif response.status_code in (401, 403):
        why = "refused: this is not an episode's MCP URL"
    else:
        why = "not an MCP answer"
    return f"HTTP {response.status_code}: {why} ({detail})" if detail else f"HTTP {response.status_code}: {why}"


class StdioRelay:
    """Relays JSON-RPC lines from stdin to one MCP URL and the answers to stdout."""

    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url
        self.http = http
        self.headers: dict[str, str] = {"Accept": _ACCEPT, "Content-Type": "application/json"}
        self._write_lock = anyio.Lock()

    async def write(self, message: Any) -> None:
        line = json.dumps(message, ensure_ascii=False, separators=(",", ":")) + "\n"
        async with self._write_lock:
            sys.stdout.write(line)
            sys.stdout.flush()

    async def relay(self, message: Any) -> None:
        """Send one message upstream; write what comes back (or, for a request, why nothing did)."""
        request_id = message.get("id") if isinstance(message, dict) else None
        try:
            response = await self.http.post(self.url, json=message, headers=self.headers)
            answers = _messages(response)
            if response.status_code >= 400 and not answers:
                raise ValueError(_http_failure(response))
        except httpx.HTTPError as e:
            await self._fail(request_id, f"the episode at {self.url} did not answer: {e}")
            return
        except ValueError as e:
            await self._fail(request_id, f"the episode at {self.url} cannot be used: {e}")
            return
        for answer in answers:
            self._remember(answer, response)
            await self.write(answer)

    async def _fail(self, request_id: Any, message: str) -> None:
        """Say why on stderr, and answer a request with a JSON-RPC error so that the host shows it."""
        print(f"envscaler connect: {message}", file=sys.stderr, flush=True)
        if request_id is not None:
            await self.write({"jsonrpc": "2.0", "id": request_id, "error": {"code": _INTERNAL_ERROR, "message": message}})

    def _remember(self, answer: Any, response: httpx.Response) -> None:
        """Carry the negotiated protocol version and any session id on later requests, as HTTP clients must."""
        result = answer.get("result") if isinstance(answer, dict) else None
        if isinstance(result, dict) and isinstance(result.get("protocolVersion"), str):
            self.headers["MCP-Protocol-Version"] = result["protocolVersion"]
        session = response.headers.get("mcp-session-id")
        if session:
            self.headers["Mcp-Session-Id"] = session

    async def run(self) -> None:
        stdin = anyio.wrap_file(sys.stdin.buffer)
        async with anyio.create_task_group() as tasks:
            async for raw in stdin:
                if not raw.strip():
                    continue
                try:
                    message = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    await self.write({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": f"parse error: {e}"}})
                    continue
                if isinstance(message, dict) and message.get("method") == "initialize":
                    await self.relay(message)  # the handshake settles the version before anything else goes out
                else:
                    tasks.start_soon(self.relay, message)


def _connect(args: argparse.Namespace) -> int:
    async def go() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10.0), trust_env=False) as http:
            await StdioRelay(args.mcp_url, http).run()

    print(f"envscaler connect: relaying stdio to {args.mcp_url}", file=sys.stderr, flush=True)
    anyio.run(go)
    return EXIT_OK


def register_connect(commands: argparse._SubParsersAction) -> None:
    """Add ``envscaler connect``."""
    parser = commands.add_parser(
        "connect", help="serve an episode's MCP URL over stdio, for hosts that start MCP servers as programs",
        description="Relays MCP over stdio (one JSON-RPC message per line) to an episode's MCP URL, as "
                    "printed by 'envscaler episode new'. Paste one of these into the host's configuration:",
        epilog=config_blocks(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("mcp_url", metavar="MCP_URL", help="the episode's MCP URL (http://.../episodes/ID/mcp)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for one answer (default: 300)")
    parser.set_defaults(func=_connect)
