"""The errors the environment server and the farm raise on purpose.

Part of the tree drawn in ``envscaler.errors``; the exit code applies when one reaches a command::

    EnvScalerError (envscaler.errors)
    ├── ErrorReply              -   ends one HTTP request with a status and ``{"error": message}``
    ├── LimitReached            -   the server already holds its maximum of live episodes (HTTP 429)
    ├── UnknownEpisode          -   no live episode has this id (HTTP 404)
    ├── UnknownScenario         -   the environment has no scenario with this id (HTTP 404)
    ├── OutOfMemory             -   no memory is left for another episode (HTTP 507)
    ├── CallAbandoned           -   a call on a worker thread outlived its deadline and was left behind
    ├── Overloaded              -   no room to run it now: a call waited too long for a thread, checks found no process (HTTP 503; a tool call: an error result)
    ├── EpisodeLost             -   the episode's state went with its worker process and could not be rebuilt (HTTP 410)
    ├── NoTurnLeft              -   the episode has no scripted user turn to end (HTTP 409)
    ├── OpenEnvSessionError     -   an OpenEnv reset or step that cannot be done (sent back to the session)
    ├── CannotListen            2   a port to serve on is taken or cannot be bound
    │   └── PortTaken           2   another program holds it
    └── FarmError               2   the farm cannot do what was asked: bad input, no engine, unreadable farm files

The server-side errors never end a command: the application turns them into HTTP statuses.
"""

from __future__ import annotations

from envscaler.errors import EnvScalerError


class ErrorReply(EnvScalerError):
    """Ends the request being served with ``status`` and a JSON ``{"error": message}`` body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class LimitReached(EnvScalerError):
    """The server already holds its maximum number of live episodes."""


class UnknownEpisode(EnvScalerError):
    """No live episode has this id (never created, ended, or expired)."""


class UnknownScenario(EnvScalerError):
    """The environment has no scenario with this id."""


class OutOfMemory(EnvScalerError):
    """The server has no memory left for another episode."""


class CallAbandoned(EnvScalerError):
    """The call did not finish by its deadline; its thread was left behind."""


class Overloaded(EnvScalerError):
    """Refused for want of room: a call waited too long for a thread to run it, or a validation's checks could
    not get a process of their own. It never ran, so it can be asked again."""


class EpisodeLost(EnvScalerError):
    """The episode's state is gone: the worker process that held it was killed or died, and replaying
    the episode's calls in a new one could not bring it back."""


class NoTurnLeft(EnvScalerError):
    """The episode has no scripted user turn to end: its scenario has none, or all have ended."""


class CannotListen(EnvScalerError):
    """A port to serve on is taken or cannot be bound (``serve --port``, ``farm up --gateway-port``)."""


class PortTaken(CannotListen):
    """The port to serve on is held by another program (EADDRINUSE)."""


class FarmError(EnvScalerError):
    """The farm cannot do what was asked (bad input, missing engine, unreadable farm files)."""


class OpenEnvSessionError(EnvScalerError):
    """An OpenEnv reset or step that cannot be done: no episode yet, episode over, unknown scenario."""
