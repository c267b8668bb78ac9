"""Start one environment server with ``envscaler serve``'s flags, without loading every subcommand.

``envscaler`` loads all registered subcommands (and their imports) before it runs one; a farm starts
fifty servers, so each one skips that work and memory. Used by the farm's process backend and by the
runtime image (the Dockerfile's ENTRYPOINT).
"""

from __future__ import annotations

import argparse
import ctypes
import sys

from servers.cli import register_serve

_PR_SET_NO_NEW_PRIVS = 38


def no_new_privileges() -> None:
    """Make this process and its children unable to gain privileges (setuid binaries, file capabilities).

    Docker sets this for the docker backend's containers; Swarm before API 1.46 cannot, so the server
    sets it on itself. Without prctl (not Linux) there is nothing to do.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Parse ``serve`` arguments (ENV_DIR, --port, ...; the token from $ENVSCALER_TOKEN or --token-file) and serve."""
    no_new_privileges()
    parser = argparse.ArgumentParser(prog="envscaler-serve")
    register_serve(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
