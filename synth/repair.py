"""The bounded repair loop shared by every stage whose answer is checked.

A draft that fails its check goes back to the same stage with the problems and the rejected answer,
at most ``max_repairs`` times; then the draft is dropped with Rejected, naming the last problems.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from synth.errors import Rejected
from synth.llm import StageLlm
from synth.prompts import render

M = TypeVar("M", bound=BaseModel)
Check = Callable[[M], "list[str] | Awaitable[list[str]]"]
log = logging.getLogger("synth.repair")


async def ask_checked(
    llm: StageLlm,
    stage: str,
    answer: type[M],
    check: Check,
    *,
    subject: str,
    max_repairs: int,
    feedback: list[str] | None = None,
    previous: Any = None,
    **values: Any,
) -> M:
    """Ask ``stage`` until ``check`` finds no problem, repairing at most ``max_repairs`` times."""
    stats = llm.stats(stage)
    problems = list(feedback or [])
    for round_number in range(max_repairs + 1):
        messages = render(stage, problems, previous, round_number + (1 if feedback else 0), **values)
        draft = await llm.ask(stage, answer, messages, subject)
        stats.attempts += 1
        found = check(draft)
        problems = await found if inspect.isawaitable(found) else found
        if not problems:
            stats.accepted += 1
            return draft
        previous = draft.model_dump(mode="json")
        log.info("draft rejected", extra={"stage": stage, "subject": subject, "round": round_number,
                                          "problems": problems[:5]})
    raise Rejected(stage, f"still failing after {max_repairs} repair(s): {'; '.join(problems[:5])}")
