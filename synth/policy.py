"""The policy every piece of generated code must pass before it runs anywhere.

A static AST check: imports only from an allowlist; no builtins that reach files, processes, the
interpreter or other code (``open``, ``eval``, ``exec``, ``__import__``...); no dunder attributes or
names, frame/code attributes, or format strings that read them (the usual ways out of a sandbox);
``getattr``/``setattr``/``delattr`` only with literal, non-dunder names; module level holds only
imports, definitions and constants, so loading the code runs nothing.

It is a first line, not the only one: generated code still runs only through the runtime's guards
in a limited child process.
"""

from __future__ import annotations

import ast
import re

ALLOWED_IMPORTS = frozenset({
    "__future__", "typing", "typing_extensions", "copy", "datetime", "re", "math", "uuid", "json",
    "collections", "itertools", "functools", "dataclasses", "enum", "decimal", "fractions", "string",
    "statistics", "operator", "heapq", "bisect", "calendar",
})
BANNED_NAMES = frozenset({
    "open", "eval", "exec", "compile", "__import__", "globals", "locals", "vars", "dir", "input",
    "breakpoint", "exit", "quit", "help", "memoryview", "os", "sys", "subprocess", "socket", "shutil",
    "pathlib", "importlib", "builtins", "ctypes", "signal", "threading", "multiprocessing", "pickle",
    "marshal", "inspect", "gc", "__builtins__", "__loader__", "__spec__",
})
# Attributes that lead from an ordinary object to frames, code or globals.
BANNED_ATTRIBUTES = frozenset({
    "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "gi_frame", "gi_code", "cr_frame",
    "cr_code", "ag_frame", "tb_frame", "tb_next", "co_code", "func_globals",
})
ALLOWED_DUNDERS = frozenset({"__init__", "__name__", "__future__"})
_DYNAMIC_ATTRIBUTE_BUILTINS = frozenset({"getattr", "setattr", "delattr", "hasattr"})
_FORMAT_DUNDER = re.compile(r"\{[^{}]*\b__\w+__")
_MODULE_LEVEL = (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef, ast.Assign, ast.AnnAssign)

RETURNS_NOTE = "return values must be JSON-serialisable (dict, list, str, int, float, bool, None)"


def allowed_imports_text() -> str:
    """The allowlist as prompt text."""
    return ", ".join(sorted(ALLOWED_IMPORTS - {"__future__", "typing_extensions"}))


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


class _Visitor(ast.NodeVisitor):
    def __init__(self) -> None:
        self.problems: list[str] = []

    def _add(self, node: ast.AST, message: str) -> None:
        self.problems.append(f"line {getattr(node, 'lineno', '?')}: {message}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._check_module(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            self._add(node, "relative imports are not allowed")
        self._check_module(node, node.module or "")
        for alias in node.names:
            if alias.name == "*":
                self._add(node, f"'from {node.module} import *' is not allowed; import the names you use")

    def _check_module(self, node: ast.AST, module: str) -> None:
        root = module.split(".")[0]
        if root not in ALLOWED_IMPORTS:
            self._add(node, f"import of {module!r} is not allowed (allowed: {allowed_imports_text()})")

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in BANNED_NAMES:
            self._add(node, f"use of {node.id!r} is not allowed in environment code")
        elif _is_dunder(node.id) and node.id not in ALLOWED_DUNDERS:
            self._add(node, f"dunder name {node.id!r} is not allowed")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in BANNED_ATTRIBUTES or (_is_dunder(node.attr) and node.attr not in ALLOWED_DUNDERS):
            self._add(node, f"attribute {node.attr!r} is not allowed (dunder and frame attributes reach outside the sandbox)")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        if isinstance(function, ast.Name) and function.id in _DYNAMIC_ATTRIBUTE_BUILTINS:
            name = node.args[1] if len(node.args) > 1 else None
            literal = isinstance(name, ast.Constant) and isinstance(name.value, str)
            on_self = bool(node.args) and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
            if literal and _is_dunder(name.value):
                self._add(node, f"{function.id}() of dunder attribute {name.value!r} is not allowed")
            elif not literal and not on_self:
                self._add(node, f"{function.id}() needs a literal attribute name (or self as the object)")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and _FORMAT_DUNDER.search(node.value):
            self._add(node, "format strings that read dunder attributes are not allowed")

    def visit_Global(self, node: ast.Global) -> None:
        self._add(node, "'global' is not allowed: keep state on the instance")


def check_code(source: str) -> list[str]:
    """Policy problems of ``source``, one line each (empty when it passes). Syntax errors are problems too."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return [f"line {e.lineno}: syntax error: {e.msg}"]
    visitor = _Visitor()
    for statement in tree.body:
        docstring = isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
        if not (isinstance(statement, _MODULE_LEVEL) or docstring):
            visitor._add(statement, f"module-level {type(statement).__name__} is not allowed: only imports, "
                                    "classes, functions and constants")
    visitor.visit(tree)
    return visitor.problems


def check_class(source: str, class_name: str) -> list[str]:
    """Policy problems of an environment class, plus the structure the runtime needs."""
    problems = check_code(source)
    if problems:
        return problems
    classes = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name]
    if not classes:
        return [f"the code defines no class {class_name!r}"]
    init = next((n for n in classes[0].body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None or [a.arg for a in init.args.args][:2] != ["self", "init_config"]:
        problems.append(f"{class_name} needs `def __init__(self, init_config: dict)`")
    return problems


def check_method(source: str, name: str) -> list[str]:
    """Policy problems of one method's source: exactly ``def name(self, ...)`` and nothing else."""
    problems = check_code(source)
    if problems:
        return problems
    body = ast.parse(source).body
    functions = [n for n in body if isinstance(n, ast.FunctionDef)]
    if len(body) != 1 or len(functions) != 1 or functions[0].name != name:
        return [f"answer with exactly one function, `def {name}(self, ...)`, and nothing around it"]
    arguments = functions[0].args
    if not arguments.args or arguments.args[0].arg != "self":
        problems.append(f"{name} must take self first")
    if ast.get_docstring(functions[0]) is None:
        problems.append(f"{name} needs a docstring with an Args: section (the tool schema comes from it)")
    return problems


def check_check_function(source: str) -> list[str]:
    """Policy problems of one check function: it must define ``check_func(final_state)``."""
    problems = check_code(source)
    if problems:
        return problems
    names = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    if "check_func" not in names:
        problems.append("define `def check_func(final_state) -> bool`")
    return problems
