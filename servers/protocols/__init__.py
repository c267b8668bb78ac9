"""What agents and trainers speak to an environment server.

- :mod:`.mcp`: :class:`McpEndpoint`, each episode's MCP endpoint (JSON-RPC over streamable HTTP);
- :mod:`.sse`: :class:`SseSessions`, the same endpoint over the 2024-11-05 HTTP+SSE transport;
- :mod:`.openenv`: the OpenEnv protocol (``serve --openenv-port``; needs the ``[openenv]`` extra).
"""

from servers.protocols.mcp import McpEndpoint
from servers.protocols.sse import SseSessions

__all__ = ["McpEndpoint", "SseSessions"]
