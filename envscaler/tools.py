"""Which methods are tools, their schemas, and whether a listed schema fits its method.

A tool is a public method defined by the environment class (never ``_private``, never a dunder,
never something inherited from ``object``). When a spec lists no tools, schemas are derived from
signatures and Google-style docstrings, as EnvScaler's own extraction does.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from typing import Any

from envscaler.models import ToolSchema

_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters|Params)\s*:\s*$")
_SECTION_HEADER = re.compile(r"^\s*[A-Z][A-Za-z ]*:\s*$")
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def public_methods(cls: type) -> dict[str, Any]:
    """Public functions defined on ``cls`` or its own bases (not ``object``), by name."""
    methods: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value):
                methods[name] = value
            else:
                methods.pop(name, None)
    return methods


def annotation_schema(annotation: Any) -> dict[str, Any]:
    """JSON schema for a Python type annotation; ``{}`` (anything) when it cannot tell."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    if annotation in _SIMPLE:
        return {"type": _SIMPLE[annotation]}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation in (list, tuple, set) or origin in (list, tuple, set, frozenset):
        schema: dict[str, Any] = {"type": "array"}
        if args and args[0] is not Ellipsis:
            item = annotation_schema(args[0])
            if item:
                schema["items"] = item
        return schema
    if annotation is dict or origin is dict:
        values = annotation_schema(args[1]) if len(args) == 2 else {}
        return {"type": "object", "additionalProperties": values} if values else {"type": "object"}
    if typing.is_typeddict(annotation):
        hints = typing.get_type_hints(annotation)
        schema = {"type": "object", "properties": {k: annotation_schema(v) for k, v in hints.items()}, "additionalProperties": False}
        required = [k for k in hints if k in annotation.__required_keys__]
        return {**schema, "required": required} if required else schema
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin is typing.Union or origin is types.UnionType:
        options = [annotation_schema(a) for a in args]
        if not all(options):
            return {}
        if all(set(o) == {"type"} and isinstance(o["type"], str) for o in options):
            return {"type": [o["type"] for o in options]}
        return {"anyOf": options}
    return {}


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {argument: description})."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    description: list[str] = []
    arguments: dict[str, str] = {}
    section = "description"
    current: str | None = None
    for line in lines:
        if _ARGS_HEADER.match(line):
            section, current = "args", None
            continue
        if _SECTION_HEADER.match(line) and section != "description":
            section, current = "other", None
            continue
        if section == "description":
            if _SECTION_HEADER.match(line):
                section = "other"
                continue
            description.append(line)
        elif section == "args":
            match = _ARG_LINE.match(line)
            indent = len(line) - len(line.lstrip())
            if match and (current is None or indent <= 4):
                current = match.group(1).lstrip("*")
                arguments[current] = match.group(3).strip()
            elif current and line.strip():
                arguments[current] = f"{arguments[current]} {line.strip()}".strip()
    text = "\n".join(description).strip()
    return text, arguments


def derive_tool(name: str, function: Any) -> ToolSchema:
    """The schema of one method, from its signature and docstring."""
    signature = inspect.signature(function)
    try:
        hints = typing.get_type_hints(function)
    except Exception:
        hints = {}
    description, documented = parse_docstring(function.__doc__)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for index, (pname, param) in enumerate(signature.parameters.items()):
        if index == 0 and pname in ("self", "cls"):
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        schema = annotation_schema(hints.get(pname, param.annotation))
        if documented.get(pname):
            schema = {**schema, "description": documented[pname]}
        properties[pname] = schema
        if param.default is inspect.Parameter.empty:
            required.append(pname)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    # Strict clients (OpenAI's strict mode) need a closed object; a method taking **kwargs is open.
    if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        parameters["additionalProperties"] = False
    return ToolSchema(name=name, description=description or name.replace("_", " "), parameters=parameters)


def result_schema(function: Any) -> dict[str, Any] | None:
    """The schema of a method's results when its return annotation says they are objects, else None.

    Only objects qualify: MCP's ``structuredContent`` is an object, and a tool that returns a string or
    a list declares no ``outputSchema`` (its text content carries the result).
    """
    try:
        returns = typing.get_type_hints(function).get("return", inspect.Parameter.empty)
    except Exception:  # noqa: BLE001 - an annotation environment code cannot resolve says nothing
        return None
    schema = annotation_schema(returns)
    return schema if schema.get("type") == "object" else None


def derive_tools(cls: type) -> list[ToolSchema]:
    """Schemas for every public method of ``cls``, in definition order."""
    return [derive_tool(name, fn) for name, fn in public_methods(cls).items()]


def signature_problems(cls: type, tools: list[ToolSchema]) -> list[str]:
    """Ways the listed tools do not fit the class: missing methods, or arguments that disagree."""
    methods = public_methods(cls)
    problems: list[str] = []
    for tool in tools:
        if tool.name.startswith("_"):
            problems.append(f"tool {tool.name!r} is private; tools must be public methods")
            continue
        function = methods.get(tool.name)
        if function is None:
            problems.append(f"tool {tool.name!r} is listed but {cls.__name__} has no such public method")
            continue
        params = list(inspect.signature(function).parameters.values())[1:]
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in params)
        names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        listed = set((tool.parameters.get("properties") or {}).keys())
        for extra in sorted(listed - names):
            if not accepts_any:
                problems.append(f"tool {tool.name!r}: schema has argument {extra!r} that the method does not take")
        for param in params:
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if param.default is inspect.Parameter.empty and param.name not in listed:
                problems.append(f"tool {tool.name!r}: method requires {param.name!r}, which the schema lacks")
    return problems
