"""The OpenEnv protocol for one environment server: each OpenEnv session drives one farm episode.

``envscaler serve ENV_DIR --openenv-port PORT`` opens a second listener in the server's own process,
next to the control API and the per-episode MCP endpoints, on the same event loop and episode store:
a step is then one round trip to the process that runs the tool, like a direct MCP call. A proxy
process in front of the farm would add a second round trip per step, past the 0.3 ms the protocol
may add (measured in ``benchmarks/openenv_step.py``).

Only :mod:`servers.protocols.openenv.config` is imported by the server itself; the rest imports
``openenv-core`` (the ``[openenv]`` extra) and is loaded only when the listener is asked for.
"""
