"""The guarded environment runtime: load a spec once, run episodes of it.

Semantics follow EnvScaler, since its data assumes them: an instance is ``cls(init_config)``
(falling back to ``cls()``), then every init_config key is set as an attribute; the state is the
instance's public attributes; the tools are the public methods the spec lists. An environment of
several classes (``EnvSpec.classes``) is one composed class (``envscaler.composite``).

Everything environment code does goes through a guard: only allowlisted tools are callable,
arguments are checked against the tool's schema first, and every call and check has a time limit.
Failures come back as values (``ToolOutcome.error``), never as exceptions, so the caller keeps its
episode.

A scenario is constructed once per process and its state shared by all its episodes
(``envscaler.overlay``): creating an episode, a call that changes nothing and a validation then cost
the same whatever the size of the state, and an episode's memory follows what it changed. State
that is not JSON-shaped (sets, tuples, objects, back-links up a tree) cannot be shared safely: such
episodes get a private instance built by the constructor, as EnvScaler does, and each call compares
the whole state as JSON (a back-link written as ``{"$ref": ...}``, see ``envscaler.state``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import time
import traceback
from collections import OrderedDict
from pathlib import Path
from typing import Any

from envscaler.annotations import tool_annotations
from envscaler.checks import check_states, score
from envscaler.composite import construct
from envscaler.env_globals import EnvGlobals, describe_change
from envscaler.errors import EnvCodeError, SchemaError
from envscaler.guard import GuardSignal, Preempted, TimeLimitExceeded, call_preemptibly, call_with_limit
from envscaler.loader import code_filename, load_class
from envscaler.models import (
    CheckContext,
    CheckItem,
    EnvSpec,
    Scenario,
    StateChange,
    ToolErrorPolicy,
    ToolOutcome,
    ToolSchema,
    ValidationResult,
)
from envscaler.data_files import DataFiles, references
from envscaler.overlay import MISSING, NotNative, Overlay, SharedState, plain, plain_graph, value_changes
from envscaler.schema import schema_problems, validate
from envscaler.strict import omit_nulls
from envscaler.state import changes_since, diff, json_ready, public_attributes, public_items, snapshot, state_hash, to_json_text
from envscaler.tools import derive_tools, public_methods, result_schema

log = logging.getLogger("envscaler.runtime")

DEFAULT_CALL_TIMEOUT_S = 10.0
DEFAULT_CHECK_TIMEOUT_S = 5.0
DEFAULT_MAX_RESULT_CHARS = 1_000_000
# Scenarios whose constructed state a process keeps, most recently used first.
_SHARED_SCENARIOS = 32

_OVERLAY_KEY = "__envscaler_overlay__"


class EnvRuntime:
    """One loaded environment: its class, its allowlisted tools, its limits and result policy."""

    def __init__(
        self,
        spec: EnvSpec,
        *,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        check_timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
        max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
        bundle_dir: Path | None = None,
    ) -> None:
        self.spec = spec
        self.env_id = spec.env_id
        self.env_class = load_class(spec)
        self.call_timeout_s = call_timeout_s
        self.check_timeout_s = check_timeout_s
        self.max_result_chars = max_result_chars
        self.error_policy = spec.tool_errors or ToolErrorPolicy()
        self._agent_errors = _declared_exceptions(self.error_policy.agent_errors)
        methods = public_methods(self.env_class)
        listed = spec.listed_tools()
        schemas = listed if listed is not None else derive_tools(self.env_class)
        # The allowlist: listed tools that really are public methods, nothing else `hasattr` finds.
        self.tools: dict[str, ToolSchema] = {t.name: t.model_copy(update={"output_schema": result_schema(methods[t.name])})
                                             for t in schemas if t.name in methods}
        # A schema the validator cannot enforce would let arguments it promises to refuse reach the code.
        problems = [f"tool {name!r}, {problem}" for name, tool in self.tools.items() for problem in schema_problems(tool.parameters)]
        if problems:
            raise SchemaError(f"{self.env_id}: " + "; ".join(problems))
        self.annotations = tool_annotations(spec, self.env_class, list(self.tools))
        self._parameters = {name: _accepted_parameters(methods[name]) for name in self.tools}
        self._env_file = code_filename(spec.env_class_code)
        self._shared: OrderedDict[str, SharedState | NotNative] = OrderedDict()
        self.data_files = DataFiles(bundle_dir, spec.env_id)
        # The digests of the data files' containers, for every scenario's state hashes (SharedState).
        self._data_digests: dict[int, bytes] = {}
        self._tracked_class = _tracked_subclass(self.env_class)
        self.env_globals = EnvGlobals(self.env_class, subclasses=(self._tracked_class,) if self._tracked_class else ())

    def load_data(self, scenarios: list[Scenario]) -> None:
        """Load the data files ``scenarios`` name and hash their content (``envscaler.data_files``): done before
        any episode, so that neither counts against an episode's time limits. BundleError for a bad file."""
        for content in self.data_files.load_all(scenarios):
            state_hash({"content": content}, self._data_digests)

    def tool_list(self) -> list[ToolSchema]:
        """The callable tools, in the spec's order."""
        return list(self.tools.values())

    def new_episode(self, init_config: dict[str, Any] | None = None, *, scenario_key: str | None = None) -> Episode:
        """A fresh episode built from ``init_config``. Raises EnvCodeError if it cannot be built.

        With ``scenario_key`` (a scenario id), the scenario is constructed once per process and its
        episodes share its state; without one the configuration is constructed for this episode.
        """
        config = init_config or {}
        shared = self._shared.get(scenario_key) if scenario_key is not None else None
        if shared is None:
            where = f"scenario {scenario_key!r}" if scenario_key is not None else "the episode's init_config"
            instance = self.instantiate(config, share_files=True, where=where)
            try:
                # With data files only: their digests' cache costs a lookup in Python for every container hashed.
                data = (self.data_files.container_ids, self._data_digests) if self.data_files.container_ids else (None, None)
                shared = SharedState(vars(instance), *data)
            except NotNative as e:
                shared = e
            except TypeError:  # no __dict__ (__slots__)
                shared = NotNative("the instance has no __dict__")
            if scenario_key is not None:
                self._shared[scenario_key] = shared
                if len(self._shared) > _SHARED_SCENARIOS:
                    self._shared.popitem(last=False)
            if isinstance(shared, NotNative):
                # Built on the data files' shared content, which a private instance would change: built again.
                return Episode(self, private=instance if not references(config) else self.instantiate(config, where=where))
        elif scenario_key is not None:
            self._shared.move_to_end(scenario_key)
        if isinstance(shared, NotNative):
            return Episode(self, private=self.instantiate(config))
        return Episode(self, shared=shared)

    def shares(self, scenario_key: str) -> bool:
        """Whether the scenario's state is built and shared: a new episode of it then runs no environment code."""
        return isinstance(self._shared.get(scenario_key), SharedState)

    def instantiate(self, init_config: dict[str, Any], *, share_files: bool = False, where: str = "the init_config") -> Any:
        """EnvScaler's construction, under the call time limit. Raises EnvCodeError on failure, BundleError
        when a data file it names cannot be loaded.

        A data file reference (``envscaler.data_files``) stands for the file's content: a private copy of it,
        or with ``share_files`` the file's shared content itself, which the constructor reads through a view
        that copies what it touches (``Overlay.view``), so that it cannot change what other scenarios share.
        """
        files = self.data_files.resolved(init_config, where)
        config = json.loads(to_json_text({k: v for k, v in init_config.items() if files[k] is v})[0])
        view: Overlay | None = None
        if files is not init_config:
            config = {k: config[k] if k in config else files[k] if share_files else plain(files[k]) for k in init_config}
            if share_files:
                view = Overlay(None)
                config = view.view(config)
        try:
            instance = call_with_limit(construct, self.call_timeout_s, self.env_class, config)
        except TimeLimitExceeded:
            raise EnvCodeError(f"{self.env_id}: constructor ran longer than {self.call_timeout_s:g} s") from None
        except GuardSignal:
            raise
        except BaseException as e:  # noqa: BLE001 - constructor is untrusted code, SystemExit included
            raise EnvCodeError(f"{self.env_id}: cannot instantiate: {self.describe_exception(e)}") from None
        finally:
            changed = self.env_globals.restore_changed()
        if changed:
            raise EnvCodeError(f"{self.env_id}: the constructor {describe_change(changed)}")
        if view is not None and hasattr(instance, "__dict__"):
            attributes = vars(instance)
            attributes.update({k: view.detach(v, self.data_files.container_ids) for k, v in attributes.items()})
        return instance

    def describe_exception(self, error: BaseException, *, where: bool = True) -> str:
        """``Type: message (env code line N)`` for an exception raised by environment code (``where``: with the line)."""
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == self._env_file] if where else []
        line = f" (env code line {frames[-1].lineno}, in {frames[-1].name})" if frames else ""
        try:
            message = str(error)
        except BaseException:  # noqa: BLE001 - an exception whose __str__ fails is still reported
            message = "(its message cannot be shown)"
        return f"{type(error).__name__}: {message}{line}"

    def exception_name(self, kind: type) -> str:
        """How env.json names an exception class: bare for Python's own and the environment's, else dotted."""
        module = kind.__module__
        return kind.__qualname__ if module in ("builtins", self.env_class.__module__) else f"{module}.{kind.__qualname__}"

    def is_agent_error(self, error: BaseException) -> bool:
        """Whether the environment declares ``error`` the caller's fault (``agent_errors``: its class or a base)."""
        classes, names = self._agent_errors
        if classes and isinstance(error, classes):
            return True
        return bool(names) and any(kind.__qualname__ in names or f"{kind.__module__}.{kind.__qualname__}" in names
                                   for kind in type(error).__mro__)

    def given_arguments(self, name: str, arguments: Any) -> Any:
        """The arguments the method gets: a null for an optional parameter that does not take null is left
        out, so the method uses its default (strict-mode clients send every parameter, null for "not given")."""
        tool = self.tools.get(name)
        return omit_nulls(arguments, tool.parameters) if tool is not None and isinstance(arguments, dict) else arguments

    def check_arguments(self, name: str, arguments: Any) -> str | None:
        """Why the agent's call cannot run (unknown tool, bad arguments), or None when it can."""
        tool = self.tools.get(name)
        if tool is None:
            return f"Unknown tool {name!r}. Available tools: {', '.join(self.tools)}"
        if not isinstance(arguments, dict):
            return f"Arguments of {name!r} must be a JSON object"
        problems = validate(arguments, tool.parameters)
        accepted = self._parameters[name]
        if accepted is not None:
            # The method's signature decides, whatever the schema lists: an argument it cannot take is
            # the caller's to fix, not a crash of the environment's code.
            closed = tool.parameters.get("additionalProperties") is False
            listed = tool.parameters.get("properties") or {}
            problems += [f"unexpected argument {key!r} (allowed: {', '.join(sorted(accepted)) or 'none'})"
                         for key in arguments if key not in accepted and not (closed and key not in listed)]
        if problems:
            return f"Invalid arguments for {name!r}: " + "; ".join(problems)
        return None

    def result_text(self, raw: Any) -> tuple[str, int | None]:
        """What the agent is shown for a result: a string as itself, anything else as JSON, cut at
        ``max_result_chars``; (text, the whole text's length when it was cut, else None)."""
        if isinstance(raw, str):
            text = raw
        else:
            try:
                value = plain(raw)
            except RecursionError:  # a result that holds a back-link (a tree node with its parent)
                value = json_ready(raw)
            text = to_json_text(value, ascii_only=False)[0]
        if len(text) > self.max_result_chars:
            return text[: self.max_result_chars], len(text)
        return text, None

    def reported_failure(self, raw: Any) -> str | None:
        """Why the result counts as a tool error under the environment's policy, or None."""
        policy = self.error_policy
        if policy.success_false and isinstance(raw, dict) and raw.get("success") is False:
            return "the tool reported success: false"
        if isinstance(raw, str):
            for prefix in policy.text_prefixes:
                if raw.startswith(prefix):
                    return f"the tool's answer starts with {prefix!r}"
        return None


def _declared_exceptions(names: list[str]) -> tuple[tuple[type, ...], frozenset[str]]:
    """``agent_errors`` as (the classes dotted names import as, the names to match by name).

    ``json.JSONDecodeError`` is the class ``json`` exports (defined in ``json.decoder``): imported, it
    matches as the class. A bare name (``ValueError``, a class of the environment's code) and a dotted
    one that does not import match an exception's class or bases by name.
    """
    classes: list[type] = []
    by_name: set[str] = set()
    for name in names:
        module, _, attribute = name.rpartition(".")
        found = None
        if module:
            try:
                found = getattr(importlib.import_module(module), attribute, None)
            except Exception:  # noqa: BLE001 - a module that does not import (any error in it) leaves the name to match
                pass
        if isinstance(found, type) and issubclass(found, BaseException):
            classes.append(found)
        else:
            by_name.add(name)
    return tuple(classes), frozenset(by_name)


def _accepted_parameters(function: Any) -> set[str] | None:
    """Keyword arguments a method takes (without self); None when it takes any (**kwargs)."""
    params = list(inspect.signature(function).parameters.values())[1:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _tracked_subclass(cls: type) -> type | None:
    """A subclass whose instances read their not-yet-copied attributes from a shared state.

    Attributes live in the instance's ``__dict__`` once read; before that, a miss comes to
    ``__getattr__``, which copies the shared container for this episode. None when the class
    cannot be subclassed that way (``__slots__``, a custom ``__getattribute__``).
    """
    if "__slots__" in vars(cls) or cls.__getattribute__ is not object.__getattribute__:
        return None
    inherited = getattr(cls, "__getattr__", None)

    def __getattr__(self: Any, name: str) -> Any:
        attributes = object.__getattribute__(self, "__dict__")
        overlay = attributes.get(_OVERLAY_KEY)
        if overlay is not None and name in overlay.shared.attributes and name not in overlay.deleted:
            return overlay.resolve(attributes, name, overlay.shared.attributes[name])
        if inherited is not None:
            return inherited(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self: Any, name: str) -> None:
        attributes = object.__getattribute__(self, "__dict__")
        overlay = attributes.get(_OVERLAY_KEY)
        if overlay is not None and name in overlay.shared.attributes and name not in overlay.deleted:
            overlay.deleted.add(name)
            attributes.pop(name, None)
            return
        super(tracked, self).__delattr__(name)

    tracked = type(cls)(cls.__name__, (cls,), {"__getattr__": __getattr__, "__delattr__": __delattr__,
                                               "__qualname__": cls.__qualname__, "__module__": cls.__module__})
    return tracked


class _EpisodeOverlay(Overlay):
    """An episode's overlay, plus the shared attributes it deleted."""

    __slots__ = ("deleted",)

    def __init__(self, shared: SharedState, attributes: dict[str, Any]) -> None:
        super().__init__(shared, attributes)
        self.deleted: set[str] = set()


class Episode:
    """One live instance of an environment: call tools, read state, validate.

    Built on the scenario's shared state when it allows (``shared``), else on a private instance.
    """

    def __init__(self, runtime: EnvRuntime, *, shared: SharedState | None = None, private: Any = None) -> None:
        self.runtime = runtime
        # How the state was converted for JSON (only a private instance needs any: shared state is JSON-shaped).
        self.conversions: list[str] = []
        self._shared = shared
        self._overlay: _EpisodeOverlay | None = None
        if shared is not None and runtime._tracked_class is not None:
            instance = object.__new__(runtime._tracked_class)
            attributes = instance.__dict__
            self._overlay = _EpisodeOverlay(shared, attributes)
            attributes[_OVERLAY_KEY] = self._overlay
            for name, value in shared.attributes.items():
                if type(value) is not dict and type(value) is not list:
                    attributes[name] = value
            self.instance = instance
        else:
            self.instance = private if private is not None else _private_copy(runtime, shared)
            self._private_text = self._public_text()
            self.initial_text = self._private_text

    @property
    def shares_state(self) -> bool:
        """Whether the episode reads its scenario's shared state (rather than a private instance)."""
        return self._overlay is not None

    # -- state ---------------------------------------------------------------------------------------

    def _logical_attributes(self) -> dict[str, Any]:
        """Every attribute as env code would see it now, shared ones not yet read included (no copies made)."""
        overlay = self._overlay
        assert overlay is not None
        attributes = {k: v for k, v in overlay.shared.attributes.items() if k not in overlay.deleted}
        attributes.update(self.instance.__dict__)
        attributes.pop(_OVERLAY_KEY, None)
        return attributes

    def _public_now(self) -> dict[str, Any]:
        """The public attributes as env code would see them now (no copies made)."""
        return public_items(self._logical_attributes())

    def _public_initial(self) -> dict[str, Any]:
        """The public attributes of the scenario's shared state: the episode's initial state."""
        assert self._overlay is not None
        return public_items(self._overlay.shared.attributes)

    def _public_text(self) -> str:
        text, self.conversions = to_json_text(public_attributes(self.instance))
        return text

    def state(self) -> dict[str, Any]:
        """The current state (public attributes) as JSON-ready data (a copy)."""
        if self._overlay is None:
            return snapshot(self.instance)[0]
        return {k: plain(v) for k, v in self._public_now().items()}

    def initial_state(self) -> dict[str, Any]:
        """The state right after construction."""
        if self._overlay is None:
            return json.loads(self.initial_text)
        return {k: plain(v) for k, v in self._public_initial().items()}

    def initial_by_reference(self) -> dict[str, Any]:
        """The initial state as :meth:`initial_state` has it, but for the values that are a data file's content
        as loaded (``envscaler.data_files``): those as the file's reference, which costs nothing to send."""
        if self._overlay is None:
            return self.initial_state()
        files = self.runtime.data_files
        return {k: files.reference(v) or plain(v) for k, v in self._public_initial().items()}

    def state_hash(self) -> str:
        """A digest equal for equal states, whatever their key order or history."""
        if self._overlay is None:
            return state_hash(json.loads(self._private_text))
        return state_hash(self._public_now(), self._overlay.shared.digests)

    # -- calls ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Let go of the episode's state now (an ended episode): its copies would otherwise wait for the collector."""
        if self._overlay is not None:
            self._overlay.release()
            self.instance.__dict__.clear()

    @property
    def preemptible(self) -> bool:
        """Whether a call can run with an ``inline_budget_s``: its changes can then be undone exactly."""
        return self._overlay is not None

    def call(
        self, name: str, arguments: Any = None, *, limit_s: float | None = None, inline_budget_s: float | None = None,
        check_shared: bool = True,
    ) -> ToolOutcome:
        """Run one tool under its time limit (``limit_s``, default the runtime's). Errors come back in the outcome.

        The outcome lists what the call changed in the state (``diff``), a failed call included.

        With ``inline_budget_s`` (main thread only) a call still running when the budget runs out is
        stopped, everything it changed is undone, and Preempted is raised: the caller runs it again
        where it may take its whole limit. An episode that is not ``preemptible`` raises Preempted
        before running anything.

        Without ``check_shared`` the call is not checked for changes to what every episode shares
        (module globals, class attributes): for a call that ran while others ran on threads, which may
        have made the change; theirs is checked when they end.
        """
        runtime = self.runtime
        arguments = {} if arguments is None else runtime.given_arguments(name, arguments)
        problem = runtime.check_arguments(name, arguments)
        if problem is not None:
            return ToolOutcome.failure(name, arguments, "agent", problem)
        if inline_budget_s is not None and not self.preemptible:
            raise Preempted()
        limit = runtime.call_timeout_s if limit_s is None else limit_s
        before = dict(self.instance.__dict__) if self._overlay is not None else None
        deleted = set(self._overlay.deleted) if self._overlay is not None else None
        started = time.perf_counter()
        try:
            if inline_budget_s is not None:
                outcome = call_preemptibly(self._run, min(inline_budget_s, limit), name, arguments)
            else:
                outcome = call_with_limit(self._run, limit, name, arguments)
        except Preempted:
            self._undo(before, deleted)
            runtime.env_globals.restore_changed()  # the run again must not find this run's changes
            raise
        except TimeLimitExceeded:
            message = f"Tool {name!r} ran longer than {limit:g} s and was stopped"
            outcome = ToolOutcome.failure(name, arguments, "timeout", message)
        except GuardSignal:
            raise
        except BaseException as e:  # noqa: BLE001 - environment code is untrusted; report, keep the episode
            if runtime.is_agent_error(e):  # bad input, as the environment says its tools answer it
                outcome = ToolOutcome.failure(name, arguments, "agent", f"Error in {name!r}: {runtime.describe_exception(e, where=False)}")
            else:
                outcome = ToolOutcome.failure(name, arguments, "env", f"Environment error in {name!r}: {runtime.describe_exception(e)}")
            outcome.exception = runtime.exception_name(type(e))
        changed = runtime.env_globals.restore_changed() if check_shared else []
        if changed:
            outcome = ToolOutcome.failure(name, arguments, "env", f"Environment error in {name!r}: the call {describe_change(changed)}")
        outcome.latency_s = time.perf_counter() - started
        outcome.diff = self._finish(before, deleted)
        return outcome

    def _run(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """The method call and the serialisation of its result (both are env code: both run under the limit)."""
        runtime = self.runtime
        # A copy for every run: a method that keeps an argument (``self.tags = tags``) and changes it later
        # would otherwise change the caller's value, the recorded call, or a preempted call's rerun.
        raw = getattr(self.instance, name)(**plain(arguments))
        text, whole_chars = runtime.result_text(raw)
        truncated = whole_chars is not None
        reported = runtime.reported_failure(raw)
        result = text if truncated else raw if isinstance(raw, str) else json.loads(text)
        promised = runtime.tools[name].output_schema
        if promised is not None and not truncated and (problems := validate(result, promised, "result")):
            # Its outputSchema promises clients this shape (MCP clients check it): breaking it is the environment's bug.
            message = f"Environment error in {name!r}: the result breaks the method's return annotation: {problems[0]}"
            return ToolOutcome.failure(name, arguments, "env", message)
        return ToolOutcome(name=name, arguments=arguments, result=result, result_text=text, truncated=truncated,
                           result_chars=whole_chars, error=reported, error_kind="tool" if reported else None)

    def _finish(self, before: dict[str, Any] | None, deleted: set[str] | None) -> list[StateChange]:
        """What the call changed, with the shared-state bookkeeping (adoption, giving back copies)."""
        overlay = self._overlay
        if overlay is None:
            old, self._private_text = self._private_text, self._public_text()
            return [] if old == self._private_text else diff(json.loads(old), json.loads(self._private_text))
        assert before is not None and deleted is not None
        changes, problem = self._top_level_changes(overlay, before, deleted)
        nested, nested_problem = overlay.finish_call()
        if problem or nested_problem:
            self._go_private()
        return sorted(changes + nested, key=lambda c: [str(p) for p in c.path])

    def _undo(self, before: dict[str, Any] | None, deleted: set[str] | None) -> None:
        """Put the state back as it was before a preempted call."""
        overlay = self._overlay
        assert overlay is not None and before is not None and deleted is not None
        attributes = self.instance.__dict__
        attributes.clear()
        attributes.update(before)
        overlay.deleted.clear()
        overlay.deleted.update(deleted)
        overlay.undo_call()

    def _top_level_changes(
        self, overlay: _EpisodeOverlay, before: dict[str, Any], deleted: set[str]
    ) -> tuple[list[StateChange], NotNative | None]:
        attributes = self.instance.__dict__
        shared = overlay.shared.attributes
        adopted: dict[int, Any] = {}
        changes: list[StateChange] = []
        problem: NotNative | None = None
        names = before.keys() | attributes.keys() | (overlay.deleted - deleted)
        for name in sorted(names - {_OVERLAY_KEY}):
            old = before.get(name, MISSING)
            if old is MISSING and name in shared and name not in deleted:
                old = shared[name]
            new = attributes.get(name, MISSING)
            if new is MISSING and name in shared and name not in overlay.deleted:
                new = shared[name]
            if new is old or (old is not MISSING and overlay.memo.get(id(old)) is new):
                continue  # unchanged, or the shared value was only copied for this episode
            try:
                if type(new) is dict or type(new) is list:
                    new = attributes[name] = overlay.adopt(new, (name,), adopted)
                elif new is not MISSING:
                    overlay.adopt(new, (name,), adopted)  # NotNative for what JSON cannot hold
            except NotNative as e:
                problem = problem or e
            if not name.startswith("_"):
                changes.extend(value_changes([name], old, new))
        return changes, problem

    def _go_private(self) -> None:
        """The call stored state JSON cannot hold: carry on with a private instance of the current state."""
        overlay = self._overlay
        assert overlay is not None
        memo: dict[int, Any] = {}
        attributes = {k: plain_graph(v, memo) for k, v in self._logical_attributes().items()}
        self.initial_text = to_json_text(self.initial_state())[0]
        self.instance = object.__new__(self.runtime.env_class)
        self.instance.__dict__.update(attributes)
        self._overlay = None
        self._private_text = self._public_text()

    def initial_hash(self) -> str | None:
        """The hash of the scenario's initial state this episode started from (None: a private instance)."""
        if self._overlay is None:
            return None
        return state_hash(self._public_initial(), self._overlay.shared.digests)

    def changes(self) -> list[StateChange] | None:
        """What the episode changed in its scenario's initial state (``state.changes_since``), at a cost
        that follows what it changed; None for a private instance (send its whole state)."""
        if self._overlay is None:
            return None
        return changes_since(self._public_initial(), self._public_now())

    # -- checks --------------------------------------------------------------------------------------

    def validate(self, checklist: list[CheckItem] | None, context: CheckContext | None = None) -> ValidationResult:
        """Run the checklist on the current state, the checks reading ``context``'s globals (``turn_results``,
        ``agent_replies``; empty when None). Raises ChecklistError when it is empty."""
        patched = self.runtime.env_globals.restore_checker()
        if patched:
            log.warning("environment code replaced the checker's own code; put back before scoring",
                        extra={"env": self.runtime.env_id, "patched": ", ".join(patched)})
        if self._overlay is None:
            final: Any = json.loads(self._private_text)
            initial: Any = json.loads(self.initial_text)
        else:
            final = self._public_now()
            initial = self._public_initial()

        results = check_states(checklist, final, initial, self.runtime.check_timeout_s, context)
        return ValidationResult(
            score=score(results),
            checks=results,
            state_hash=self.state_hash(),
            check_errors=sum(r.error is not None for r in results),
        )


def _private_copy(runtime: EnvRuntime, shared: SharedState | None) -> Any:
    """A private instance holding a deep copy of a shared state (for a class that cannot be tracked)."""
    assert shared is not None
    instance = object.__new__(runtime.env_class)
    instance.__dict__.update({k: plain(v) for k, v in shared.attributes.items()})
    return instance

