"""Scripted multi-turn scenarios: how the checks of turns and the final checks make one validation.

A scenario with ``turns`` is scored on every turn's checks (each run when the agent ended that turn, on
the state and the calls of that turn) and on its scenario-level checks (the final ones, on the final
state and all the calls). The server and the quality gates both score it here, so they agree.
"""

from __future__ import annotations

from envscaler.checks import score
from envscaler.models import CheckItem, CheckResult, ValidationResult

_UNREACHED = " was never reached: "


def of_turn(results: list[CheckResult], number: int) -> list[CheckResult]:
    """``results`` marked as the checks of turn ``number`` (1 for the first)."""
    return [r.model_copy(update={"turn": number}) for r in results]


def unreached(checklist: list[CheckItem] | None, number: int, total: int, ended: int) -> list[CheckResult]:
    """The checks of turn ``number`` of ``total``, which the episode never reached (``ended`` turns ended):
    each failed, with an error that says so."""
    error = (f"turn {number} of {total}{_UNREACHED}the agent ended {ended} turn(s) "
             f"(the harness ends a turn with POST /episodes/{{id}}/turn when the agent answers without a tool call)")
    return [CheckResult(check_item=item.check_item, passed=False, error=error, turn=number) for item in checklist or []]


def validation(results: list[CheckResult], state_hash: str) -> ValidationResult:
    """The validation made of ``results`` (every turn's checks, then the final ones). Raises ChecklistError when empty.

    ``check_errors`` counts the checks whose code failed, not those of turns never reached (the agent's doing)."""
    errors = sum(r.error is not None and not (r.turn is not None and _UNREACHED in r.error) for r in results)
    return ValidationResult(score=score(results), checks=results, state_hash=state_hash, check_errors=errors)
