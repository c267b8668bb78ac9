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
import pickle
import sys
import time
import traceback
from typing import Any

from envscaler.checks import run_checks, score
from envscaler.errors import EnvCodeError, SchemaError
from envscaler.guard import Preempted, TimeLimitExceeded, call_preemptibly, call_with_limit
from envscaler.loader import code_filename, load_class
from envscaler.models import CheckItem, EnvSpec, StateChange, ToolOutcome, ToolSchema, ValidationResult
from envscaler.schema import schema_problems, validate
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
        # A schema the validator cannot enforce would let arguments it promises to refuse reach the code.
        problems = [f"tool {name!r}, {problem}" for name, tool in self.tools.items() for problem in schema_problems(tool.parameters)]
        if problems:
            raise SchemaError(f"{self.env_id}: " + "; ".join(problems))
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
        # JSON of the public state, when known to be current (diffs and checks start from it).
        self._last_text: str | None = self.initial_text
        # Pickle of the whole instance dict, when known to be current: undoes a preempted call and
        # tells in ~10 us whether a call changed anything (JSON of the state costs 5x more).
        self._pickled: bytes | None = None
        self._picklable = True

    def _state_text(self) -> tuple[str, list[str]]:
        return to_json_text(public_attributes(self.instance))

    def state(self) -> dict[str, Any]:
        """The current state as JSON-ready data (a copy)."""
        return snapshot(self.instance)[0]

    def initial_state(self) -> dict[str, Any]:
        """The state right after construction or the last reset."""
        return json.loads(self.initial_text)

    def call(
        self, name: str, arguments: Any = None, *, track_diff: bool = False, inline_budget_s: float | None = None
    ) -> ToolOutcome:
        """Run one tool. Errors come back in the outcome; the episode always survives.

        ``track_diff`` records in the outcome what the call changed in the state. ``inline_budget_s``
        (main thread only) undoes a call that runs longer than that: the state is restored and
        :class:`Preempted` raised, for the caller to run the call again without a budget elsewhere.
        Preempted is also raised, before anything runs, when this episode's state cannot be saved.
        """
        arguments = {} if arguments is None else arguments
        runtime = self.runtime
        tool = runtime.tools.get(name)
        if tool is None:
            known = ", ".join(runtime.tools)
            return ToolOutcome.failure(name, arguments, "agent", f"Unknown tool {name!r}. Available tools: {known}")
        if not isinstance(arguments, dict):
            return ToolOutcome.failure(name, arguments, "agent", f"Arguments of {name!r} must be a JSON object")
        problems = validate(arguments, tool.parameters)
        if problems:
            return ToolOutcome.failure(name, arguments, "agent", f"Invalid arguments for {name!r}: " + "; ".join(problems))
        saved = self._save() if track_diff or inline_budget_s is not None else None
        if inline_budget_s is not None and saved is None:
            raise Preempted()
        before_text = (self._last_text or self._state_text()[0]) if track_diff else None
        self._last_text = None
        method = getattr(self.instance, name)
        started = time.perf_counter()
        try:
            if inline_budget_s is not None:
                raw = call_preemptibly(method, min(inline_budget_s, runtime.call_timeout_s), **arguments)
            else:
                raw = call_with_limit(method, runtime.call_timeout_s, **arguments)
        except Preempted:
            self._restore(saved, before_text)  # type: ignore[arg-type]
            raise
        except TimeLimitExceeded:
            message = f"Tool {name!r} ran longer than {runtime.call_timeout_s:g} s and was stopped"
            outcome = ToolOutcome.failure(name, arguments, "timeout", message, time.perf_counter() - started)
        except Exception as e:  # noqa: BLE001 - environment code is untrusted; report, keep the episode
            message = f"Environment error in {name!r}: {runtime.describe_exception(e)}"
            outcome = ToolOutcome.failure(name, arguments, "env", message, time.perf_counter() - started)
        else:
            latency = time.perf_counter() - started
            text = to_json_text(raw, ascii_only=False)[0]
            outcome = ToolOutcome(name=name, arguments=arguments, result=json.loads(text), result_text=text, latency_s=latency)
        if before_text is not None:
            # A failed call may still have changed the state: its diff is recorded too.
            outcome.diff = self._changes(saved, before_text)
        else:
            self._pickled = None
        return outcome

    @property
    def restorable(self) -> bool:
        """False once the state turned out not to pickle: calls then cannot be preempted and undone."""
        return self._picklable

    def _save(self) -> bytes | None:
        """The pickled instance dict (cached while current); None when the state cannot be pickled."""
        if self._pickled is None and self._picklable:
            try:
                self._pickled = pickle.dumps(self.instance.__dict__, pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001 - any object may refuse pickling; fall back to JSON only
                self._picklable = False
        return self._pickled

    def _restore(self, saved: bytes, before_text: str | None) -> None:
        state = vars(self.instance)
        state.clear()
        state.update(pickle.loads(saved))
        self._pickled = saved
        self._last_text = before_text

    def _changes(self, saved: bytes | None, before_text: str) -> list[StateChange]:
        """What the last call changed, leaving the saved pickle and JSON text current."""
        self._pickled = None
        after = self._save() if saved is not None else None
        if after is not None and after == saved:
            self._last_text = before_text
            return []
        after_text = self._state_text()[0]
        self._last_text = after_text
        return [] if after_text == before_text else diff(json.loads(before_text), json.loads(after_text))

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
