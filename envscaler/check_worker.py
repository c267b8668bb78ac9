"""The isolated worker behind ``envscaler catalog check``.

``python -m envscaler.check_worker BUNDLE_DIR`` runs every gate on one bundle and prints its
EnvReport as one JSON line (or ``{"error": ...}`` when the bundle cannot be read). It is its own
module, not imported by the package, so that ``-m`` runs it without importing it twice.
"""

from __future__ import annotations

import json
import sys

from envscaler.bundle import load_bundle
from envscaler.errors import EnvScalerError
from envscaler.gates import check_bundle


def main(argv: list[str] | None = None) -> int:
    """Check one bundle directory and print its EnvReport as JSON (the CLI's isolated worker)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m envscaler.check_worker BUNDLE_DIR", file=sys.stderr)
        return 2
    try:
        bundle = load_bundle(args[0])
    except EnvScalerError as e:
        print(json.dumps({"error": str(e)}))
        return 1
    report = check_bundle(bundle)
    print(report.model_dump_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
