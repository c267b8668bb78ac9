"""Checklist functions: compile, run with ``initial_state``, ``turn_results`` and ``agent_replies`` as globals, score.

Each check gets its own copy-on-access views of the final and initial states
(``envscaler.overlay``): what a check changes stays in its views, so checks cannot affect each
other or the episode, and a check costs in proportion to what it reads, not to the state's size.
"""

from __future__ import annotations

import builtins
import traceback
from collections.abc import Callable
from typing import Any

from envscaler.errors import ChecklistError
from envscaler.guard import GuardSignal, TimeLimitExceeded, call_with_limit
from envscaler.models import CheckContext, CheckItem, CheckResult
from envscaler.overlay import Overlay

_CHECK_FILE = "<check>"
_TIMEOUT_ERROR = "check ran longer than "
# Compiled checks by source, oldest first: a long-lived process (a check zygote) sees every checklist a
# trainer sends, so the cache is bounded.
_COMPILED: dict[str, Any] = {}
_KEPT_COMPILED = 512
# A source compiled ahead is one of a checklist's functions, not a program: one larger is compiled where it runs.
_AHEAD_MAX_CHARS = 16384
_NO_GLOBALS = CheckContext().check_globals()

Views = Callable[[], tuple[Any, Any, Callable[[], None]]]
"""Makes fresh (final_state, initial_state) views for one check, and what releases them after it."""


def _compile(source: str) -> Any:
    code = _COMPILED.get(source)
    if code is None:
        code = compile(source, _CHECK_FILE, "exec")
        _COMPILED[source] = code
        if len(_COMPILED) > _KEPT_COMPILED:
            del _COMPILED[next(iter(_COMPILED))]
    return code


def compile_checks_ahead(checklist: list[CheckItem] | None) -> None:
    """Compile ``checklist``'s functions into this process's cache, running none of them, so that the
    processes forked from it later find the code compiled (a check zygote: half of a validation's checks
    time was compiling them, in every child again). A source that does not compile, or is long, is left
    to the process that runs it: it reports the error there, and this process's time stays short."""
    for item in checklist or []:
        if len(item.check_func) <= _AHEAD_MAX_CHARS:
            try:
                _compile(item.check_func)
            except (SyntaxError, RecursionError, MemoryError):
                continue


def _check_function(namespace: dict[str, Any]) -> Any:
    function = namespace.get("check_func")
    if callable(function):
        return function
    defined = [v for k, v in namespace.items() if callable(v) and not k.startswith("__") and k != "initial_state"]
    if len(defined) == 1:
        return defined[0]
    raise ChecklistError("check code defines no check_func(final_state)")


def _error_line(error: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == _CHECK_FILE]
    where = f" (check line {frames[-1].lineno})" if frames else ""
    try:
        message = str(error)
    except BaseException:  # noqa: BLE001 - an exception whose __str__ fails is still reported
        message = "(its message cannot be shown)"
    return f"{type(error).__name__}: {message}{where}"


def run_check(item: CheckItem, views: Views, limit_s: float, check_globals: dict[str, Any] | None = None) -> CheckResult:
    """Run one check on fresh views of the final and initial states, under ``limit_s``, with fresh views of
    ``check_globals`` (``CheckContext.check_globals``; empty ones when None) as its globals."""
    try:
        code = _compile(item.check_func)
    except SyntaxError as e:
        return CheckResult(check_item=item.check_item, passed=False, error=f"syntax error, line {e.lineno}: {e.msg}")
    except (RecursionError, MemoryError) as e:  # nesting too deep for the compiler, or for its parser
        return CheckResult(check_item=item.check_item, passed=False, error=f"the check cannot be compiled: {type(e).__name__}: {e}")
    final_state, initial_state, release = views()
    # Copied on access, as the states are: what one check changes in them, no other check sees.
    context = Overlay(None)
    namespace: dict[str, Any] = {"__builtins__": builtins, "initial_state": initial_state,
                                 **context.view(check_globals or _NO_GLOBALS)}

    def decide() -> bool:
        exec(code, namespace)
        return bool(_check_function(namespace)(final_state))

    try:
        passed = call_with_limit(decide, limit_s)
    except TimeLimitExceeded:
        return CheckResult(check_item=item.check_item, passed=False, error=f"{_TIMEOUT_ERROR}{limit_s:g} s")
    except GuardSignal:
        raise
    except BaseException as e:  # noqa: BLE001 - check code is untrusted; any failure is reported
        return CheckResult(check_item=item.check_item, passed=False, error=_error_line(e))
    finally:
        # The check function's globals are this namespace, and views point back at their copies:
        # reference cycles that would otherwise keep the copies until the garbage collector runs.
        namespace.clear()
        release()
        context.release()
    return CheckResult(check_item=item.check_item, passed=passed)


def timed_out(result: CheckResult) -> bool:
    """Whether the check was stopped at its time limit (rather than answering, or failing by itself)."""
    return result.error is not None and result.error.startswith(_TIMEOUT_ERROR)


def run_checks(checklist: list[CheckItem] | None, views: Views, limit_s: float, context: CheckContext | None = None) -> list[CheckResult]:
    """Every check's verdict. Raises ChecklistError when there is nothing to score with."""
    if not checklist:
        raise ChecklistError("the scenario has no checklist, so it cannot be scored")
    check_globals = context.check_globals() if context is not None else _NO_GLOBALS
    return [run_check(item, views, limit_s, check_globals) for item in checklist]


def check_states(checklist: list[CheckItem] | None, final: Any, initial: Any, limit_s: float,
                 context: CheckContext | None = None) -> list[CheckResult]:
    """Every check's verdict on ``final`` with ``initial_state`` (and ``context``'s globals), each on views of its own.

    The states are plain JSON-shaped data (or an episode's attributes): no check can change them, or
    see what another check changed. Raises ChecklistError when there is nothing to score with.
    """

    def make_views() -> tuple[Any, Any, Callable[[], None]]:
        # Separate overlays: a check that changes one state must not see that in the other.
        final_overlay, initial_overlay = Overlay(None), Overlay(None)

        def release() -> None:
            final_overlay.release()
            initial_overlay.release()

        return final_overlay.view(final), initial_overlay.view(initial), release

    return run_checks(checklist, make_views, limit_s, context)


def score(results: list[CheckResult]) -> float:
    """Share of checks that passed."""
    if not results:
        raise ChecklistError("no check results to score")
    return sum(r.passed for r in results) / len(results)
