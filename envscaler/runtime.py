"""The guarded environment runtime: load a spec once, run episodes of it.

Semantics follow EnvScaler, since its data assumes them: an instance is ``cls(init_config)``
(falling back to ``cls()``), then every init_config key is set as an attribute; the state is the
instance's public attributes; the tools are the public methods the spec lists.

Everything environment code does goes through a guard: only allowlisted tools are callable, arguments
are checked against the tool's schema first, and every call and check has a time limit. Failures come
back as values (``ToolOutcome.error``), never as exceptions, so the caller keeps its episode.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import time
import traceback
from typing import Any

from envscaler.checks import run_checks, score
from envscaler.errors import EnvCodeError
from envscaler.guard import TimeLimitExceeded, call_with_limit
from envscaler.loader import code_filename, load_class
from envscaler.models import CheckItem, EnvSpec, ErrorKind, ToolOutcome, ToolSchema, ValidationResult
from envscaler.schema import validate
from envscaler.state import diff, public_attributes, snapshot, state_hash, to_json_text
from envscaler.tools import derive_tools, public_methods

DEFAULT_CALL_TIMEOUT_S = 10.0
DEFAULT_CHECK_TIMEOUT_S = 5.0


class EnvRuntime:
    """One loaded environment: its class, its allowlisted tools and its limits."""

    def __init__(
        self,
        spec: EnvSpec,
        *,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        check_timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
    ) -> None:
        self.spec = spec
        self.env_id = spec.env_id
        self.env_class = load_class(spec)
        self.call_timeout_s = call_timeout_s
        self.check_timeout_s = check_timeout_s
        methods = public_methods(self.env_class)
        listed = spec.listed_tools()
        schemas = listed if listed is not None else derive_tools(self.env_class)
        # The allowlist: listed tools that really are public methods, nothing else `hasattr` finds.
        self.tools: dict[str, ToolSchema] = {t.name: t for t in schemas if t.name in methods}
        self._env_file = code_filename(spec.env_id)

    def tool_list(self) -> list[ToolSchema]:
        """The callable tools, in the spec's order."""
        return list(self.tools.values())

    def new_episode(self, init_config: dict[str, Any] | None = None) -> Episode:
        """A fresh instance built from ``init_config``. Raises EnvCodeError if it cannot be built."""
        return Episode(self, init_config or {})

    def instantiate(self, init_config: dict[str, Any]) -> Any:
        """EnvScaler's construction, under the call time limit. Raises EnvCodeError on failure."""
        config = json.loads(to_json_text(init_config)[0])
        try:
            return call_with_limit(_construct, self.call_timeout_s, self.env_class, config)
        except TimeLimitExceeded:
            raise EnvCodeError(f"{self.env_id}: constructor ran longer than {self.call_timeout_s:g} s") from None
        except Exception as e:  # noqa: BLE001 - constructor is untrusted code
            raise EnvCodeError(f"{self.env_id}: cannot instantiate: {self.describe_exception(e)}") from None

    def describe_exception(self, error: BaseException) -> str:
        """``Type: message (env code line N)`` for an exception raised by environment code."""
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == self._env_file]
        where = f" (env code line {frames[-1].lineno}, in {frames[-1].name})" if frames else ""
        return f"{type(error).__name__}: {error}{where}"


@functools.lru_cache(maxsize=256)
def _takes_config(cls: type) -> bool:
    try:
        inspect.signature(cls).bind({})
    except TypeError:
        return False
    except ValueError:  # no signature to inspect: let the call decide
        return True
    return True


def _construct(cls: type, config: dict[str, Any]) -> Any:
    # EnvScaler falls back to cls() when cls(init_config) fails; falling back only when the
    # constructor cannot take the argument keeps a TypeError inside __init__ visible.
    instance = cls(config) if _takes_config(cls) else cls()
    for key, value in config.items():
        setattr(instance, key, value)
    return instance


class Episode:
    """One live instance of an environment: call tools, read state, validate, reset in place."""

    def __init__(self, runtime: EnvRuntime, init_config: dict[str, Any]) -> None:
        self.runtime = runtime
        self.reset(init_config)

    def reset(self, init_config: dict[str, Any]) -> None:
        """Replace the instance with a fresh one built from ``init_config``."""
        self.instance = self.runtime.instantiate(init_config)
        text, self.conversions = self._state_text()
        # Episodes of one scenario share one copy of the initial state text.
        self.initial_text = sys.intern(text)
        self._last_text: str | None = self.initial_text

    def _state_text(self) -> tuple[str, list[str]]:
        return to_json_text(public_attributes(self.instance))

    def state(self) -> dict[str, Any]:
        """The current state as JSON-ready data (a copy)."""
        return snapshot(self.instance)[0]

    def initial_state(self) -> dict[str, Any]:
        """The state right after construction or the last reset."""
        return json.loads(self.initial_text)

    def call(self, name: str, arguments: Any = None, *, track_diff: bool = False) -> ToolOutcome:
        """Run one tool. Errors come back in the outcome; the episode always survives."""
        arguments = {} if arguments is None else arguments
        runtime = self.runtime
        tool = runtime.tools.get(name)
        if tool is None:
            known = ", ".join(runtime.tools)
            return _failed(name, arguments, "agent", f"Unknown tool {name!r}. Available tools: {known}")
        if not isinstance(arguments, dict):
            return _failed(name, arguments, "agent", f"Arguments of {name!r} must be a JSON object")
        problems = validate(arguments, tool.parameters)
        if problems:
            return _failed(name, arguments, "agent", f"Invalid arguments for {name!r}: " + "; ".join(problems))
        before = (self._last_text or self._state_text()[0]) if track_diff else None
        self._last_text = None
        method = getattr(self.instance, name)
        started = time.perf_counter()
        try:
            raw = call_with_limit(method, runtime.call_timeout_s, **arguments)
        except TimeLimitExceeded:
            message = f"Tool {name!r} ran longer than {runtime.call_timeout_s:g} s and was stopped"
            outcome = _failed(name, arguments, "timeout", message, time.perf_counter() - started)
        except Exception as e:  # noqa: BLE001 - environment code is untrusted; report, keep the episode
            message = f"Environment error in {name!r}: {runtime.describe_exception(e)}"
            outcome = _failed(name, arguments, "env", message, time.perf_counter() - started)
        else:
            latency = time.perf_counter() - started
            result = json.loads(to_json_text(raw)[0])
            outcome = ToolOutcome(name=name, arguments=arguments, result=result, latency_s=latency)
        if before is not None:
            # A failed call may still have changed the state: its diff is recorded too.
            after = self._state_text()[0]
            outcome.diff = [] if after == before else diff(json.loads(before), json.loads(after))
            self._last_text = after
        return outcome

    def validate(self, checklist: list[CheckItem] | None) -> ValidationResult:
        """Run the checklist on the current state. Raises ChecklistError when it is empty."""
        final_text = self._last_text or self._state_text()[0]
        results = run_checks(checklist, final_text, self.initial_text, self.runtime.check_timeout_s)
        return ValidationResult(
            score=score(results),
            checks=results,
            state_hash=state_hash(json.loads(final_text)),
            check_errors=sum(r.error is not None for r in results),
        )


def _failed(name: str, arguments: Any, kind: ErrorKind, message: str, latency: float = 0.0) -> ToolOutcome:
    args = arguments if isinstance(arguments, dict) else {"_raw": arguments}
    return ToolOutcome(name=name, arguments=args, error=message, error_kind=kind, latency_s=latency)
