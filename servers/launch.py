"""Start one environment server with ``envscaler serve``'s flags, without loading every subcommand.

``envscaler`` loads all registered subcommands (and their imports) before it runs one; a farm starts
fifty servers, so each one skips that work and memory. Used by the farm's process backend and by the
runtime image (the Dockerfile's ENTRYPOINT).
"""

from __future__ import annotations

import argparse
import sys

from servers.cli import register_serve


def main(argv: list[str] | None = None) -> int:
    """Parse ``serve`` arguments (ENV_DIR, --port, ...; the token comes from $ENVSCALER_TOKEN) and serve."""
    parser = argparse.ArgumentParser(prog="envscaler-serve")
    register_serve(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
