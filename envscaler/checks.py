"""Checklist functions: compile, run with ``initial_state`` as a global, score."""

from __future__ import annotations

import builtins
import json
import traceback
from typing import Any

from envscaler.errors import ChecklistError
from envscaler.guard import TimeLimitExceeded, call_with_limit
from envscaler.models import CheckItem, CheckResult

_CHECK_FILE = "<check>"
_COMPILED: dict[str, Any] = {}


def _compile(source: str) -> Any:
    code = _COMPILED.get(source)
    if code is None:
        code = compile(source, _CHECK_FILE, "exec")
        _COMPILED[source] = code
    return code


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
    return f"{type(error).__name__}: {error}{where}"


def run_check(item: CheckItem, final_text: str, initial_text: str, limit_s: float) -> CheckResult:
    """Run one check on fresh copies of the states (serialised JSON), so checks cannot affect each other."""
    try:
        code = _compile(item.check_func)
    except SyntaxError as e:
        return CheckResult(check_item=item.check_item, passed=False, error=f"syntax error, line {e.lineno}: {e.msg}")
    namespace: dict[str, Any] = {"__builtins__": builtins, "initial_state": json.loads(initial_text)}
    try:
        exec(code, namespace)
        function = _check_function(namespace)
        outcome = call_with_limit(function, limit_s, json.loads(final_text))
    except TimeLimitExceeded:
        return CheckResult(check_item=item.check_item, passed=False, error=f"check ran longer than {limit_s:g} s")
    except Exception as e:  # noqa: BLE001 - check code is untrusted; any failure is reported
        return CheckResult(check_item=item.check_item, passed=False, error=_error_line(e))
    return CheckResult(check_item=item.check_item, passed=bool(outcome))


def run_checks(
    checklist: list[CheckItem] | None, final_text: str, initial_text: str, limit_s: float
) -> list[CheckResult]:
    """Every check's verdict. Raises ChecklistError when there is nothing to score with."""
    if not checklist:
        raise ChecklistError("the scenario has no checklist, so it cannot be scored")
    return [run_check(item, final_text, initial_text, limit_s) for item in checklist]


def score(results: list[CheckResult]) -> float:
    """Share of checks that passed."""
    if not results:
        raise ChecklistError("no check results to score")
    return sum(r.passed for r in results) / len(results)
