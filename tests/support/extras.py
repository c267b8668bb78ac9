"""Tests of the optional extras ([openenv], [trl]) skip when those are not installed, unless
ENVSCALER_REQUIRE_EXTRAS=1 (set by .ci/run, which installs them): then they fail."""

from __future__ import annotations

import importlib
import os

import pytest


def require(*modules: str, extra: str) -> None:
    """Skip the calling test module when a module of ``extra`` is missing (fail under ENVSCALER_REQUIRE_EXTRAS=1)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            if os.environ.get("ENVSCALER_REQUIRE_EXTRAS") == "1":
                raise RuntimeError(f"ENVSCALER_REQUIRE_EXTRAS=1 but {module} is missing: pip install -e '.[{extra}]'") from e
            pytest.skip(f"needs the [{extra}] extra ({module} is missing)", allow_module_level=True)
