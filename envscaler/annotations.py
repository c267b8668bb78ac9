"""MCP tool annotations (read-only, destructive, idempotent, title) read from the methods' code.

Clients such as Codex run a tool unprompted only when it says it is read-only, so every tool carries
hints. They are derived from the environment class's source: a method writes the state when it
assigns or deletes an attribute or item of something reached from ``self`` (directly, or through a
local name bound to such a thing), calls a mutating method on it (``append``, ``pop``, ``update``...),
calls ``setattr``/``delattr`` on ``self``, or calls another method of the class that does. A method
that does none of these is read-only. The hints are a best guess from the code; an explicit value in
env.json (``tool_annotations``) wins, and the ``read_only_tools`` gate refuses a read-only tool whose
reference-run call changed the state.
"""

from __future__ import annotations

import ast
import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envscaler.composite import part_classes
from envscaler.models import EnvSpec, ToolAnnotations
from envscaler.tools import public_methods

# Methods of list, dict and set that change the object they are called on.
_ADDING = {"append", "extend", "insert", "add", "setdefault"}
_REMOVING = {"pop", "popitem", "remove", "discard", "clear"}
_REPLACING = {"update", "sort", "reverse", "difference_update", "intersection_update",
              "symmetric_difference_update", "__setitem__", "__delitem__", "__setattr__", "__delattr__"}
# Builtins that build a new container of the objects they are given.
_COPYING = {"list", "tuple", "sorted", "reversed", "set", "frozenset", "dict", "filter", "enumerate", "zip", "map"}
# What a name or expression may hold: an object of the state, or a new container of such objects
# (sorting or appending to it changes nothing, changing one of its elements does).
_STATE = 2
_HOLDER = 1
# Functions and methods whose result holds nothing of their argument that could be written through.
_DETACHING = {"len", "str", "int", "float", "bool", "sum", "round", "abs", "isinstance", "any", "all",
              "repr", "deepcopy", "dumps", "format", "hash", "id", "type", "count", "index", "startswith",
              "endswith", "lower", "upper", "strip", "split", "join", "isoformat", "strftime"}


@dataclass(frozen=True)
class _Writes:
    """What one method's body does to the state."""

    writes: bool = False
    removes_or_replaces: bool = False
    accumulates: bool = False


@dataclass
class _MethodScan(ast.NodeVisitor):
    """Walks one method body, noting its writes to state reached from ``self``."""

    self_name: str
    parameters: set[str]
    aliases: dict[str, int] = field(default_factory=dict)
    # The least that each name read had among the aliases when it was read (see :func:`_body_scan`).
    read_as: dict[str, int] = field(default_factory=dict)
    calls_own: set[str] = field(default_factory=set)
    # Own methods called with a state object among their arguments.
    hands_state_to: set[str] = field(default_factory=set)
    writes: bool = False
    removes_or_replaces: bool = False
    accumulates: bool = False

    def found(self) -> _Writes:
        """What the walk found the body does to the state."""
        return _Writes(self.writes, self.removes_or_replaces, self.accumulates)

    def visit(self, node: ast.AST) -> None:
        # ast.NodeVisitor looks its method up by name for every node, and walks the fields through two generators:
        # this table and loop scan a class in half the time, which a worker spends before its first call.
        method = _VISITS.get(type(node))
        if method is None:
            method = _VISITS[type(node)] = getattr(_MethodScan, f"visit_{type(node).__name__}", _MethodScan.generic_visit)
        method(self, node)

    def generic_visit(self, node: ast.AST) -> None:
        for name in node._fields:
            value = getattr(node, name, None)
            if isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        self.visit(item)
            elif isinstance(value, ast.AST):
                self.visit(value)

    def _level(self, node: ast.AST | None) -> int:
        """What ``node`` may evaluate to: :data:`_STATE`, a :data:`_HOLDER` of state objects, or neither (0)."""
        if isinstance(node, ast.Name):
            if node.id == self.self_name:
                return _STATE
            level = self.aliases.get(node.id, 0)
            self.read_as[node.id] = min(level, self.read_as.get(node.id, level))
            return level
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred, ast.Await, ast.NamedExpr)):
            return _STATE if self._level(node.value) else 0  # an element of a holder is state
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                # state.get(k), state.values(), self._find(...): what a state object's method gives back.
                if not self._level(func.value) or func.attr in _DETACHING:
                    return 0
                return _HOLDER if func.attr == "copy" else _STATE
            if isinstance(func, ast.Name) and func.id not in _DETACHING:
                if not any(self._level(a) for a in [*node.args, *(k.value for k in node.keywords)]):
                    return 0
                # list(...) and sorted(...) build a new list of the same objects; next(...) or a helper may give one back.
                return _HOLDER if func.id in _COPYING else _STATE
            return 0
        if isinstance(node, ast.BoolOp):
            return max(self._level(v) for v in node.values)
        if isinstance(node, ast.IfExp):
            return max(self._level(node.body), self._level(node.orelse))
        if isinstance(node, ast.BinOp):
            return _HOLDER if self._level(node.left) or self._level(node.right) else 0
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for generator in node.generators:
                self._bind(generator.target, _STATE if self._level(generator.iter) else 0)
            element = node.value if isinstance(node, ast.DictComp) else node.elt  # keys are immutable
            return _HOLDER if self._level(element) else 0
        # Literals, comparisons, f-strings and new containers built from parts hold no state object.
        return 0

    def _bind(self, target: ast.AST, level: int) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and level:
                self.aliases[node.id] = max(level, self.aliases.get(node.id, 0))

    def _store(self, target: ast.AST, *, augmented: bool = False) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._store(element, augmented=augmented)
            return
        if isinstance(target, (ast.Attribute, ast.Subscript)) and self._level(target.value) == _STATE:
            self.writes = True
            if augmented:
                self.accumulates = True
            # self.records[key] = new: an addition; anything deeper, or a whole attribute, replaces.
            additive = (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute)
                        and isinstance(target.value.value, ast.Name) and target.value.value.id == self.self_name)
            if augmented or not additive:
                self.removes_or_replaces = True
            elif not (isinstance(target.slice, ast.Name) and target.slice.id in self.parameters):
                self.accumulates = True  # a key the method makes up (a new id) adds a record per call
        elif isinstance(target, ast.Starred):
            self._store(target.value, augmented=augmented)

    def _bind_value(self, target: ast.AST, value: ast.AST) -> None:
        """Bind ``target`` to what ``value`` holds; ``a, b = x.a, 0`` pair by pair."""
        pairs = isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List))
        if pairs and len(target.elts) == len(value.elts) and not any(isinstance(e, ast.Starred) for e in [*target.elts, *value.elts]):
            for element, part in zip(target.elts, value.elts):
                self._bind_value(element, part)
        else:
            self._bind(target, self._level(value))

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._store(target)
            self._bind_value(target, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._store(node.target)
            self._bind(node.target, self._level(node.value))
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._store(node.target, augmented=True)
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._bind(node.target, self._level(node.value))
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            if isinstance(target, (ast.Attribute, ast.Subscript)) and self._level(target.value) == _STATE:
                self.writes = self.removes_or_replaces = True
        self.generic_visit(node)

    def _loop_target(self, target: ast.AST, iterable: ast.AST) -> None:
        self._bind(target, _STATE if self._level(iterable) else 0)

    def visit_For(self, node: ast.For) -> None:
        self._loop_target(node.target, node.iter)
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._loop_target(node.target, node.iter)
        self.generic_visit(node)

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            if item.optional_vars is not None:
                self._bind(item.optional_vars, self._level(item.context_expr))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            if isinstance(func.value, ast.Name) and func.value.id == self.self_name:
                self.calls_own.add(func.attr)
                if any(self._level(a) == _STATE for a in [*node.args, *(k.value for k in node.keywords)]):
                    self.hands_state_to.add(func.attr)
            elif self._level(func.value) == _STATE and func.attr in _ADDING | _REMOVING | _REPLACING:
                self.writes = True
                if func.attr in _REMOVING | _REPLACING:
                    self.removes_or_replaces = True
                if func.attr in {"append", "extend", "insert", "pop", "popitem"}:
                    self.accumulates = True
        elif isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args and self._level(node.args[0]) == _STATE:
            self.writes = self.removes_or_replaces = True
        self.generic_visit(node)


# Node class -> the _MethodScan method that visits it.
_VISITS: dict[type, Callable[[_MethodScan, Any], None]] = {}


class _MethodFacts:
    """One method's own writes to ``self``'s state, its writes to its arguments, and the own methods it calls.

    It keeps the method's code, not its syntax tree: parsed again in the rare case its writes through its
    arguments are asked for, so that only one method's tree is in memory at a time (all of a class's
    trees at once are megabytes that, freed, stay scattered through a worker's heap)."""

    def __init__(self, function: ast.FunctionDef | ast.AsyncFunctionDef, code: types.CodeType, lines: list[str]) -> None:
        self._code = code
        self._lines = lines
        self.own = _Writes()
        self.calls: frozenset[str] = frozenset()
        self.hands_state_to: frozenset[str] = frozenset()
        if function.args.posonlyargs + function.args.args:
            scan = _body_scan(function, arguments_are_state=False)
            self.own = scan.found()
            self.calls = frozenset(scan.calls_own)
            self.hands_state_to = frozenset(scan.hands_state_to)

    @classmethod
    def read(cls, code: types.CodeType, lines: list[str]) -> _MethodFacts | None:
        """The facts of the method compiled to ``code``, from the ``lines`` of its source; None where they
        hold no definition of its own."""
        function = _parse_function(code, lines)
        return None if function is None else cls(function, code, lines)

    @functools.cached_property
    def to_arguments(self) -> _Writes:
        """What it writes through its arguments: read only for a method that another hands state to."""
        function = _parse_function(self._code, self._lines)
        if function is None or not (function.args.posonlyargs + function.args.args):
            return _Writes()
        scan = _body_scan(function, arguments_are_state=True)
        return scan.found()


# A method's code -> its facts, read ahead (``read_ahead``) by the process that compiled the code, and shared
# with the processes forked from it; a method not found here is read where its annotations are derived.
_FACTS: dict[types.CodeType, _MethodFacts | None] = {}


def read_ahead(module_code: types.CodeType, source: str) -> None:
    """Read the facts of every method that the top-level classes of ``module_code`` (compiled from ``source``)
    define, running none of it: a process forked after this derives those classes' annotations without
    parsing them (the farm's zygote calls it, where it compiles each class ahead). A method that cannot be
    read here is left to whoever derives its annotations."""
    lines = source.splitlines(keepends=True)
    for body in module_code.co_consts:
        if not isinstance(body, types.CodeType) or body.co_flags & inspect.CO_OPTIMIZED:
            continue  # not a class statement's body
        read: dict[str, _MethodFacts] = {}
        for code in body.co_consts:
            if isinstance(code, types.CodeType) and code.co_flags & inspect.CO_OPTIMIZED and code not in _FACTS:
                try:
                    facts = _FACTS[code] = _MethodFacts.read(code, lines)
                except (RecursionError, MemoryError, ValueError):
                    continue  # nested past what the parser or the scan can follow: read where it is needed
                if facts is not None:
                    read[code.co_name] = facts
        for facts in read.values():
            for callee in facts.hands_state_to & read.keys():
                read[callee].to_arguments  # noqa: B018 - read now, where its parse is shared


def _body_scan(function: ast.FunctionDef | ast.AsyncFunctionDef, arguments_are_state: bool) -> _MethodScan:
    arguments = function.args.posonlyargs + function.args.args
    names = {a.arg for a in arguments[1:] + function.args.kwonlyargs}
    scan = _MethodScan(self_name=arguments[0].arg, parameters=names)
    if arguments_are_state:
        scan.self_name = ""  # only what the arguments reach counts
        scan.aliases = dict.fromkeys(names, _STATE)
    for statement in function.body:
        scan.visit(statement)
    # An alias found late (a loop binding used above it in a while loop) is caught by a second pass. Where every
    # name read then already held what it holds now, a second pass would read the same and find nothing new.
    if any(scan.aliases.get(name, 0) > level for name, level in scan.read_as.items()):
        for statement in function.body:
            scan.visit(statement)
    return scan


def _merge(a: _Writes, b: _Writes) -> _Writes:
    return _Writes(a.writes or b.writes, a.removes_or_replaces or b.removes_or_replaces, a.accumulates or b.accumulates)


def _method_codes(classes: list[type]) -> dict[str, types.CodeType]:
    """Method name -> its code, for the functions ``classes`` (the most derived first) define, the most
    derived class winning."""
    methods: dict[str, types.CodeType] = {}
    for klass in reversed(classes):
        for value in vars(klass).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if not inspect.isfunction(value):
                continue
            try:
                wrapped = inspect.unwrap(value)  # a decorated method: the code its decorator wrapped
            except ValueError:
                wrapped = value  # a cycle of __wrapped__
            code = getattr(wrapped, "__code__", None)
            if not isinstance(code, types.CodeType):
                code = value.__code__  # it wraps something with no code of its own (a builtin)
            methods[code.co_name] = code
    return methods


def _parse_function(code: types.CodeType, lines: list[str]) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The definition of the function compiled to ``code`` (its decorators' lines first), read from ``lines``."""
    # Under an `if` of its own, an indented definition parses as it stands (a string's lines may start anywhere).
    segment = "if 1:\n" + "".join(lines[code.co_firstlineno - 1:_last_line(code)])
    try:
        statement = ast.parse(segment).body[0]
    except (SyntaxError, IndexError):
        return None  # not a definition of its own in the source (made by another function, say)
    node = statement.body[0] if isinstance(statement, ast.If) and statement.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _last_line(code: types.CodeType) -> int:
    """The last line of the source that ``code`` and the functions defined in it span."""
    last = max((end for _, end, _, _ in code.co_positions() if end is not None), default=code.co_firstlineno)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            last = max(last, _last_line(constant))
    return last


def title_of(tool_name: str) -> str:
    """``get_order_details`` -> ``Get order details``."""
    words = tool_name.replace("_", " ").strip()
    return words[:1].upper() + words[1:]


def derive_annotations(source: str, cls: type, tool_names: list[str]) -> dict[str, ToolAnnotations]:
    """Hints for each tool, from the code of ``cls`` (and its bases defined in ``source``).

    A method whose source cannot be found is left without read-only or idempotent claims, so clients
    treat it as the MCP defaults say (may write, may destroy). A composed class (``envscaler.composite``)
    is read part by part.
    """
    classes = part_classes(cls)
    if len(classes) == 1:
        return _class_annotations(source, cls, tool_names)
    derived: dict[str, ToolAnnotations] = {}
    for part in classes:  # a composed class: each tool is read in the class that defines it
        derived.update(_class_annotations(source, part, [name for name in tool_names if name in public_methods(part)]))
    return {name: derived[name] for name in tool_names if name in derived}


def _class_annotations(source: str, cls: type, tool_names: list[str]) -> dict[str, ToolAnnotations]:
    lines = source.splitlines(keepends=True)
    codes = _method_codes([klass for klass in cls.__mro__ if klass.__module__ == cls.__module__])
    own = {name: facts for name, code in codes.items()
           if (facts := _FACTS[code] if code in _FACTS else _MethodFacts.read(code, lines)) is not None}
    annotations: dict[str, ToolAnnotations] = {}
    for name in tool_names:
        if name not in own:
            annotations[name] = ToolAnnotations(title=title_of(name), openWorldHint=False)
            continue
        annotations[name] = _hints(name, _effective(own, name, frozenset({name})))
    return annotations


def _effective(own: dict[str, _MethodFacts], name: str, seen: frozenset[str]) -> _Writes:
    """What method ``name`` writes, itself or through the own methods it calls (``seen``: those on the way).

    A function of the module, not one nested in the caller that calls itself: that cycle kept every
    method's syntax tree alive until the collector's next full pass."""
    facts = own[name]
    writes = facts.own
    for callee in facts.calls - seen:
        if callee in own:
            writes = _merge(writes, _effective(own, callee, seen | {callee}))
            if callee in facts.hands_state_to:
                writes = _merge(writes, own[callee].to_arguments)
    return writes


def state_function_annotations(function: ast.FunctionDef | ast.AsyncFunctionDef, tool_name: str) -> ToolAnnotations:
    """Hints for a tool written as a function of the state it is handed as its first parameter
    (tau-bench's ``invoke(data, ...)``): it writes the state when it writes through that parameter."""
    if not (function.args.posonlyargs + function.args.args):
        return _hints(tool_name, _Writes())
    scan = _body_scan(function, arguments_are_state=False)
    return _hints(tool_name, scan.found())


def _hints(name: str, writes: _Writes) -> ToolAnnotations:
    if not writes.writes:
        return ToolAnnotations(title=title_of(name), readOnlyHint=True, destructiveHint=False, idempotentHint=True,
                               openWorldHint=False)
    return ToolAnnotations(
        title=title_of(name),
        readOnlyHint=False,
        destructiveHint=writes.removes_or_replaces,
        idempotentHint=not writes.accumulates,
        openWorldHint=False,  # the environment is a closed simulation
    )


def tool_annotations(spec: EnvSpec, cls: type, tool_names: list[str]) -> dict[str, ToolAnnotations]:
    """Each tool's hints: derived from the code, with every field ``spec.tool_annotations`` sets winning."""
    derived = derive_annotations(spec.env_class_code, cls, tool_names)
    for name, explicit in (spec.tool_annotations or {}).items():
        if name in derived:
            derived[name] = derived[name].model_copy(update=explicit.model_dump(exclude_none=True))
    return derived
