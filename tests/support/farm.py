"""A real process farm of the counter environment for a test: ``farm up``, the catalog, ``farm down``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.bundles import counter_bundle
from tests.support.cli import envscaler


@contextmanager
def counter_farm(root: Path, *flags: str) -> Iterator[dict[str, Any]]:
    """``farm up`` (process backend, extra ``flags``) of the counter bundle; yields the catalog; ``farm down`` after."""
    catalog = root / "farm.json"
    up = envscaler("farm", "up", str(counter_bundle(root / "bundles")), "--backend", "process", "--catalog", str(catalog), *flags)
    assert up.returncode == 0, up.stderr
    try:
        yield json.loads(catalog.read_text())
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))
