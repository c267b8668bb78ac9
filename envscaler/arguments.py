"""Command-line helpers: argument types (a bad number is a one-line usage error, exit 2, not a traceback
or a hang) and ``--help`` examples.

argparse turns the ``ArgumentTypeError`` these raise into ``error: argument --flag: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


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


def examples(*lines: str) -> str:
    """An ``--help`` epilog of example command lines (use with ``RawDescriptionHelpFormatter``)."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


positive_int: Callable[[str], int] = _number(int, "a whole number", 1, True)  # type: ignore[assignment]
"""An int >= 1 (counts of things: concurrency, repeats, steps, jobs)."""
non_negative_int: Callable[[str], int] = _number(int, "a whole number", 0, True)  # type: ignore[assignment]
"""An int >= 0 (retries)."""
positive_float: Callable[[str], float] = _number(float, "a number", 0, False)
"""A float > 0 (time limits)."""
non_negative_float: Callable[[str], float] = _number(float, "a number", 0, True)
"""A float >= 0 (delays)."""
