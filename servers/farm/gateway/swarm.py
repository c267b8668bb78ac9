"""The farm's gateway as a replicated service: ``python -m servers.farm.gateway.swarm ROUTES_FILE [--port 8080]``.

The swarm backend runs this in the runtime image, one or more replicas published on the swarm's
ingress (or on every node's port), as the farm's one URL. ROUTES_FILE (a Docker config) names each
environment's service; every gateway replica finds that service's replicas by itself
(``servers.farm.gateway.routing``) and shares nothing with the others, so any of them serves any request. It
holds no tokens: the caller's Authorization header passes through to the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from envscaler import logs
from envscaler.bundle import describe_validation_error
from servers.farm.gateway.app import MAX_BODY, Gateway
from servers.farm.gateway.routing import ReplicaRouter, dns_discovery
from servers.transport.http_server import HttpServer
from envscaler.sandbox import no_new_privileges
from servers.transport.event_loop import loop_factory
from servers.serve import bind

GATEWAY_PORT = 8080


class GatewayRoutes(BaseModel):
    """The routes file: which service runs each environment, and where its servers listen."""

    services: dict[str, str] = Field(description="env_id -> the DNS name of its service")
    port: int = Field(default=8000, description="the port every environment server listens on")
    poll_s: float = Field(default=1.0, gt=0, description="seconds between two looks at the replicas")


async def serve_gateway(routes: GatewayRoutes, port: int) -> None:
    """Serve the gateway on every address at ``port`` until SIGTERM or SIGINT."""
    router = ReplicaRouter(list(routes.services), dns_discovery(routes.services, routes.port), poll_s=routes.poll_s)
    gateway = Gateway(routes.services, router=router)
    server = HttpServer(gateway, max_body_bytes=MAX_BODY)
    sock = bind("0.0.0.0", port)
    poller = asyncio.create_task(router.run())

    def announce() -> None:
        print(json.dumps({"event": "listening", "port": sock.getsockname()[1], "envs": len(routes.services)}), flush=True)

    try:
        await server.serve(sock, on_ready=announce)
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the gateway service."""
    no_new_privileges()
    parser = argparse.ArgumentParser(prog="envscaler-gateway", description=__doc__.splitlines()[0])
    parser.add_argument("routes", metavar="ROUTES_FILE", help="JSON: {\"services\": {env_id: service}, \"port\": 8000}")
    parser.add_argument("--port", type=int, default=GATEWAY_PORT, help=f"port to serve on (default: {GATEWAY_PORT})")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    try:
        routes = GatewayRoutes.model_validate_json(Path(args.routes).read_text(encoding="utf-8"))
    except OSError as e:
        print(f"error: {args.routes}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        print(f"error: {args.routes}: {describe_validation_error(e)}", file=sys.stderr)
        return 2
    logs.configure(args.log_level)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve_gateway(routes, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
