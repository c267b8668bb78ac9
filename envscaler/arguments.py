"""Command-line helpers: argument types (a bad number is a one-line usage error, exit 2, not a traceback
or a hang) and ``--help`` examples.

argparse turns the ``ArgumentTypeError`` these raise into ``error: argument --flag: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn


def _number(parse: Callable[[str], float], what: str, minimum: float, inclusive: bool) -> Callable[[str], float]:
    def convert(text: str) -> float:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum or (value == minimum and not inclusive):
            bound = f"at least {minimum:g}" if inclusive else f"more than {minimum:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return convert


class OneLineParser(argparse.ArgumentParser):
    """A parser whose usage errors are one line (and a pointer to ``--help``), exit 2, not the whole usage.

    ``add_subparsers`` makes its commands' parsers of the same class, so every command gets it.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def with_examples(*lines: str) -> dict[str, Any]:
    """``add_parser`` arguments that end a command's ``--help`` with example command lines."""
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in lines)
    return {"epilog": epilog, "formatter_class": argparse.RawDescriptionHelpFormatter}


positive_int: Callable[[str], int] = _number(int, "a whole number", 1, True)  # type: ignore[assignment]
"""An int >= 1 (counts of things: concurrency, repeats, steps, jobs)."""
non_negative_int: Callable[[str], int] = _number(int, "a whole number", 0, True)  # type: ignore[assignment]
"""An int >= 0 (retries)."""


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An int >= ``minimum`` (a resource limit below which nothing could run)."""
    return _number(int, "a whole number", minimum, True)  # type: ignore[return-value]


positive_float: Callable[[str], float] = _number(float, "a number", 0, False)
"""A float > 0 (time limits)."""
non_negative_float: Callable[[str], float] = _number(float, "a number", 0, True)
"""A float >= 0 (delays)."""
