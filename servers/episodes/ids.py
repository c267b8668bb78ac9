"""Episode ids: unguessable capabilities that, on a replicated environment, also name their replica.

An episode lives in the memory of one server process. When an environment runs as several replicas
behind gateways that share nothing (``servers.farm.gateway.routing``), the id itself says which replica holds
the episode: ``<replica_id>.<secret>``. A server started without a replica id hands out the bare
secret, as it always did. The secret alone is the capability; the replica id is not a secret.
"""

from __future__ import annotations

import re
import secrets

SEPARATOR = "."
# Letters, digits, '-' and '_' (URL-safe, no separator): what ``new_replica_id`` makes and ``serve --replica-id`` takes.
REPLICA_ID_PATTERN = r"^[A-Za-z0-9_-]{1,40}$"
_REPLICA_ID = re.compile(REPLICA_ID_PATTERN)


def new_replica_id() -> str:
    """A fresh id for one server process: a restarted server is a new replica, since its episodes are gone."""
    return secrets.token_hex(6)


def new_episode_id(replica_id: str | None) -> str:
    """A new unguessable episode id, prefixed with ``replica_id`` when there is one."""
    secret = secrets.token_urlsafe(24)
    return f"{replica_id}{SEPARATOR}{secret}" if replica_id else secret


def replica_of(episode_id: str) -> str | None:
    """The replica named in ``episode_id``, or None when it names none."""
    replica, separator, _ = episode_id.partition(SEPARATOR)
    return replica if separator and _REPLICA_ID.match(replica) else None
