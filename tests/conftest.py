"""Fixtures every test module shares.

Helpers that module-scoped fixtures call as well (the ``envscaler`` command runner, the servers
under test) live in ``tests/support`` as plain functions: a fixture cannot be called from a fixture
of a wider scope.
"""

from __future__ import annotations

import pytest

# Files written in benchmarks' own formats (tests/fixtures/tau_bench has a tasks_test.py): data, not tests.
collect_ignore = ["fixtures"]


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio only: the server and the harness use asyncio directly."""
    return "asyncio"
