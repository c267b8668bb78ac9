"""The errors the core raises on purpose, and the exit code each one ends a command with.

Every package has one errors module; all of its errors hang under :class:`EnvScalerError`, and each
class carries the exit code that ``envscaler`` ends with when one reaches it (the README's rule:
0 success, 1 the work ran and found failures, 2 bad usage or input, 130 interrupted)::

    EnvScalerError              2   the base: bad usage or input unless a subclass says otherwise
    ├── BundleError             2   a bundle or import file is malformed (names the file and field)
    │   └── SchemaError         2   a tool schema uses a keyword the argument validator cannot enforce
    ├── EnvCodeError            2   environment code does not compile, load or construct
    ├── ChecklistError          2   a scenario cannot be scored (its checklist is missing or empty)
    └── InfraError              1   something the work depends on failed: a server, the network, an LLM endpoint
        └── LlmUnavailable      1   an LLM endpoint kept failing after every retry, or refused the request

    servers.errors, agent_client.errors, synth.errors: the rest of the tree, under these.

Two exceptions stay outside on purpose: ``envscaler.guard.TimeLimitExceeded`` and ``Preempted``
derive from BaseException so that environment code's ``except Exception`` cannot swallow them; the
guard turns them into tool errors before anyone else sees them.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class EnvScalerError(Exception):
    """Base of every error this project raises on purpose."""

    # What ``envscaler`` exits with when this error ends a command.
    exit_code: int = EXIT_USAGE


class BundleError(EnvScalerError):
    """A bundle or import file is malformed: the message names the file and the field."""


class SchemaError(BundleError):
    """A tool's argument schema cannot be enforced: the message names the tool, the argument and the keyword."""


class EnvCodeError(EnvScalerError):
    """Environment class code does not compile, does not define the class it names, or cannot be built."""


class ChecklistError(EnvScalerError):
    """A scenario cannot be scored (for example, its checklist is empty or missing)."""


class InfraError(EnvScalerError):
    """A server, the network or an LLM endpoint failed: the work could not be judged, the input may be fine."""

    exit_code = EXIT_FAILED


class LlmUnavailable(InfraError):
    """An OpenAI-compatible endpoint kept failing after every retry, or refused the request (``status``).

    ``attempts`` says how many requests were sent; ``status`` is the HTTP status of a refusal, None
    when the endpoint kept failing (timeouts, connection errors, 429, 5xx).
    """

    def __init__(self, message: str, *, attempts: int = 1, status: int | None = None) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.status = status
