"""One environment as an MCP server, and many of them as a farm.

The folders say where things live:

- ``transport/``: the HTTP/1.1 server and the ASGI helpers every process here serves with;
- ``episodes/``: live episodes of one environment, their ids, the calls that run their code, their records;
- ``workers/``: the processes that run environment code and checks for a server, and what they say to it;
- ``protocols/``: what agents and trainers speak to a server: MCP (streamable HTTP, HTTP+SSE) and OpenEnv;
- ``farm/``: many servers (``backends/``: process, docker, swarm) behind one gateway (``gateway/``).

Beside them: ``app`` (one server's application: its routes, limits and episode store), ``serve`` (run
it), ``cli`` (``envscaler serve``, and ``python -m servers.cli``, the entry point a farm starts),
``errors`` and ``memory``.
"""
