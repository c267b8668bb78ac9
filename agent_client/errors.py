"""The errors the harness raises on purpose.

Part of the tree drawn in ``envscaler.errors``; the exit code applies when one reaches a command::

    EnvScalerError (envscaler.errors)
    ├── HarnessError            2   the harness cannot start: bad catalog, unknown scenario, bad flags,
    │                               another run writing the same --out
    ├── RecordsUnwritable       1   the run file cannot be written (a full disk): the run stopped cleanly
    ├── WorkersLost             1   every worker process of a --procs run died with episodes still to run
    └── InfraError (envscaler)  1   a server, the network or an LLM endpoint failed: the episode cannot be judged
        ├── TransportError      1   an HTTP request could not be sent, or no complete response came back
        └── EnvServerError      1/2 an environment server (or the gateway) answered with an error status;
                                    exit 2 for a client error (401, 404, ...: the input was wrong), else 1

Inside ``envscaler run`` an InfraError never ends the command: the episode is recorded with
``termination: infra_error`` and the run goes on.
"""

from __future__ import annotations

from envscaler.errors import EXIT_FAILED, EXIT_USAGE, EnvScalerError, InfraError

class HarnessError(EnvScalerError):
    """The harness cannot start (bad catalog, unknown scenario, bad flags)."""


class RecordsUnwritable(EnvScalerError):
    """The run file cannot be written (a full disk, a quota): the run stopped, its episodes in flight
    were ended, and the file holds whole records only; the same command finishes it once there is room."""

    exit_code = EXIT_FAILED


class WorkersLost(EnvScalerError):
    """Every worker process of a ``--procs`` run died with episodes still to run: the records written are
    whole, the episodes the workers had in flight are recorded as infra errors, and a rerun of the same
    command runs the rest."""

    exit_code = EXIT_FAILED


class TransportError(InfraError):
    """The request could not be sent, or no complete response came back (refused, reset, timed out)."""


class EnvServerError(InfraError):
    """An environment server or the gateway answered with an error ``status``; the message has its reason."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
        # A client error (bad token, ended episode, unknown scenario) means the input was wrong; a
        # rate limit, a timeout or a 5xx means the server failed.
        self.exit_code = EXIT_USAGE if 400 <= status < 500 and status not in (408, 429) else EXIT_FAILED
