"""The loopback ports a farm's daemon holds for its environments, whatever starts their servers.

The CLI plans free ports; by the time the daemon binds them, another program (often a client's
ephemeral port) may have taken one. The daemon then listens on a free port instead, and the plan, so
the catalog's URL, follows the port it holds: a farm never fails from that race.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from servers.errors import CannotListen, PortTaken
from servers.farm.board import Board
from servers.farm.models import EnvPlan, FarmPlan
from servers.serve import bind

log = logging.getLogger("envscaler.farm")


@dataclass
class Listeners:
    """The listening sockets the daemon holds for one environment, for as long as the farm runs: its
    server inherits them at every start (or the daemon relays them to its container), so a restart
    never binds again, and connections that arrive while it restarts wait in the backlog."""

    main: socket.socket
    openenv: socket.socket | None = None

    @property
    def sockets(self) -> list[socket.socket]:
        """The main socket, then the OpenEnv one when there is one (the order a server inherits them in)."""
        return [self.main] if self.openenv is None else [self.main, self.openenv]

    def close(self) -> None:
        """Stop listening (the farm is stopping)."""
        for sock in self.sockets:
            sock.close()


def hold_plan_ports(plan: FarmPlan, board: Board) -> dict[str, Listeners]:
    """Hold every environment's ports (:func:`hold_ports`): ``plan.envs`` become the plans as bound, so that the
    catalog gives the ports held. The listeners of the environments that listen, by env_id."""
    held: dict[str, Listeners] = {}
    for number, env in enumerate(plan.envs):
        holding = hold_ports(env, board)
        if holding is not None:
            plan.envs[number], held[env.env_id] = holding
    return held


def hold_ports(env: EnvPlan, board: Board) -> tuple[EnvPlan, Listeners] | None:
    """Bind ``env``'s planned loopback ports, each replaced by a free one when another program took it
    since the plan was made: the plan as bound (its ports, so its URLs) and the sockets. None when it
    cannot listen at all; it is then marked failed on ``board``, with why."""
    try:
        main = _bind_or_free(env, env.port, "port")
        openenv = _bind_or_free(env, env.openenv_port, "OpenEnv port") if env.openenv_port is not None else None
    except CannotListen as e:
        board.update(env.env_id, status="failed", last_exit=str(e))
        log.error("an environment cannot listen", extra={"env": env.env_id, "error": str(e)})
        return None
    bound = env.model_copy(update={"port": main.getsockname()[1],
                                   "openenv_port": openenv.getsockname()[1] if openenv is not None else None})
    if bound.port != env.port:
        board.update(env.env_id, url=bound.url)
    return bound, Listeners(main, openenv)


def _bind_or_free(env: EnvPlan, port: int, what: str) -> socket.socket:
    try:
        return bind("127.0.0.1", port)
    except PortTaken:
        pass
    sock = bind("127.0.0.1", 0)
    log.warning(f"the planned {what} was taken by another program; the environment listens on another",
                extra={"env": env.env_id, "planned": port, "port": sock.getsockname()[1]})
    return sock
