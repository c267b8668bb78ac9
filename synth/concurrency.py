"""Task groups that fail like plain code: the first error comes out as itself, not as a group."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.abc import TaskGroup


def first_error(error: BaseException) -> BaseException:
    """The first leaf exception of a (possibly nested) exception group."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


@asynccontextmanager
async def task_group() -> AsyncIterator[TaskGroup]:
    """anyio's task group, re-raising the first failure itself (the others were cancelled by it)."""
    try:
        async with anyio.create_task_group() as group:
            yield group
    except BaseExceptionGroup as group_error:
        raise first_error(group_error) from None
