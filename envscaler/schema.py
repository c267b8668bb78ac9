"""Argument validation against a tool's JSON schema, and the load-time gate that keeps it honest.

Tool schemas are OpenAI function parameters: small objects of typed properties. :func:`validate`
enforces the JSON Schema assertions they use and writes messages a model can act on, in a few
microseconds per call (a general JSON Schema library costs far more on every tool call):

- any value: ``type``, ``enum``, ``const``, ``$ref`` (local: ``#/$defs/...``, ``#/definitions/...``),
  ``allOf``, ``anyOf``, ``oneOf`` (exactly one), ``not``;
- numbers: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum`` (also draft 4's
  booleans), ``multipleOf``;
- strings: ``minLength``, ``maxLength`` (in code points), ``pattern`` (searched, as JSON Schema says);
- arrays: ``items``, ``minItems``, ``maxItems``, ``uniqueItems``;
- objects: ``properties``, ``required``, ``additionalProperties``, ``minProperties``, ``maxProperties``.

``format`` is an annotation, as JSON Schema 2020-12 makes it by default: ``"format": "date"`` is
not checked, because an environment that takes ``"2024-1-5"`` must not lose the call to a stricter
reading than its own. Other annotations (``description``, ``title``, ``default``, ``examples``, ...)
and keywords JSON Schema does not define (``x-...``) are ignored.

:func:`schema_problems` is the gate: a schema that uses an assertion keyword this validator does not
enforce (``if``/``then``/``else``, ``patternProperties``, ``prefixItems``, ...), a ``$ref`` it cannot
resolve, or a keyword value of the wrong kind, makes the environment fail to load (``EnvRuntime``),
so that nothing the schema promises is silently left unchecked.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

_TYPE_NAMES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}

Checker = Callable[[Any, dict[str, Any], str, dict[str, Any], list[str]], None]


def json_type(value: Any) -> str:
    """The JSON type name of a Python value ("integer", "object", ...)."""
    return _TYPE_NAMES.get(type(value), type(value).__name__)


_JSON_TYPES = frozenset(_TYPE_NAMES.values())


def _matches_type(value: Any, expected: str) -> bool:
    # Values come from JSON: their Python types are exactly the ones in _TYPE_NAMES.
    actual = _TYPE_NAMES.get(type(value))
    return actual == expected or (expected == "number" and actual == "integer") or expected not in _JSON_TYPES


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


@functools.lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def validate(value: Any, schema: dict[str, Any] | bool, where: str = "arguments", root: dict[str, Any] | None = None) -> list[str]:
    """Every way ``value`` breaks ``schema``, as messages naming the argument. Empty when valid.

    ``root`` is the schema that ``$ref`` pointers resolve against (``schema`` itself by default).
    """
    errors: list[str] = []
    _check(value, schema, where, root if root is not None else schema, errors)  # type: ignore[arg-type]
    return errors


def _check(value: Any, schema: dict[str, Any] | bool, where: str, root: dict[str, Any], errors: list[str]) -> None:
    if schema is True:
        return
    if schema is False:
        errors.append(f"{where}: no value is allowed here")
        return
    expected = schema.get("type")  # type: ignore[union-attr]
    if expected is not None:
        if expected.__class__ is str:
            matches = _matches_type(value, expected)
        else:
            matches = any(_matches_type(value, kind) for kind in expected)
        if not matches:
            wanted = expected if expected.__class__ is str else " or ".join(expected)
            errors.append(f"{where}: expected {wanted}, got {json_type(value)} {_short(value)}")
            return
    # One lookup per keyword the schema has (most have two or three), not one per keyword known.
    for key in schema:  # type: ignore[union-attr]
        checker = _KEYWORDS.get(key)
        if checker is not None:
            checker(value, schema, where, root, errors)  # type: ignore[arg-type]
    if isinstance(value, dict):
        _check_object(value, schema, where, root, errors)  # type: ignore[arg-type]
    elif isinstance(value, list):
        _check_array(value, schema, where, root, errors)  # type: ignore[arg-type]


# -- any value ------------------------------------------------------------------------------------


def _enum(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    if value not in schema["enum"]:
        errors.append(f"{where}: {_short(value)} is not one of {schema['enum']}")


def _const(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    if value != schema["const"]:
        errors.append(f"{where}: must be {schema['const']!r}")


def _ref(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    _check(value, resolve_ref(root, schema["$ref"]), where, root, errors)


def _all_of(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    for option in schema["allOf"]:
        _check(value, option, where, root, errors)


def _forms(options: list[Any]) -> str:
    return ", ".join(str(option.get("type", "schema")) if isinstance(option, dict) else str(option).lower() for option in options)


def _matching(value: Any, options: list[Any], where: str, root: dict[str, Any]) -> int:
    matched = 0
    for option in options:
        problems: list[str] = []
        _check(value, option, where, root, problems)
        matched += not problems
    return matched


def _any_of(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    options = schema["anyOf"]
    for option in options:
        problems: list[str] = []
        _check(value, option, where, root, problems)
        if not problems:
            return
    errors.append(f"{where}: matches none of the allowed forms ({_forms(options)})")


def _one_of(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    options = schema["oneOf"]
    matched = _matching(value, options, where, root)
    if matched == 0:
        errors.append(f"{where}: matches none of the allowed forms ({_forms(options)})")
    elif matched > 1:
        errors.append(f"{where}: matches {matched} of the allowed forms ({_forms(options)}); it must match exactly one")


def _not(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    if _matching(value, [schema["not"]], where, root):
        errors.append(f"{where}: {_short(value)} is a form that is not allowed here")


# -- numbers --------------------------------------------------------------------------------------


def _minimum(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    if _is_number(value):
        bound = schema["minimum"]
        if schema.get("exclusiveMinimum") is True:  # draft 4: a flag on minimum
            if value <= bound:
                errors.append(f"{where}: {value} must be above {bound}")
        elif value < bound:
            errors.append(f"{where}: {value} is below the minimum {bound}")


def _maximum(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    if _is_number(value):
        bound = schema["maximum"]
        if schema.get("exclusiveMaximum") is True:
            if value >= bound:
                errors.append(f"{where}: {value} must be below {bound}")
        elif value > bound:
            errors.append(f"{where}: {value} is above the maximum {bound}")


def _exclusive_minimum(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    bound = schema["exclusiveMinimum"]
    if _is_number(value) and not isinstance(bound, bool) and value <= bound:
        errors.append(f"{where}: {value} must be above {bound}")


def _exclusive_maximum(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    bound = schema["exclusiveMaximum"]
    if _is_number(value) and not isinstance(bound, bool) and value >= bound:
        errors.append(f"{where}: {value} must be below {bound}")


def _multiple_of(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    if not _is_number(value):
        return
    step = schema["multipleOf"]
    if isinstance(value, int) and isinstance(step, int):
        ok = value % step == 0
    else:
        quotient = value / step
        ok = abs(quotient - round(quotient)) <= 1e-9 * max(1.0, abs(quotient))  # 0.3 / 0.1 is 2.9999999999999996
    if not ok:
        errors.append(f"{where}: {value} is not a multiple of {step}")


# -- strings --------------------------------------------------------------------------------------


def _min_length(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    if isinstance(value, str) and len(value) < schema["minLength"]:
        errors.append(f"{where}: {_short(value)} is shorter than {_plural(schema['minLength'], 'character')}")


def _max_length(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    if isinstance(value, str) and len(value) > schema["maxLength"]:
        errors.append(f"{where}: {_short(value)} is longer than {_plural(schema['maxLength'], 'character')}")


def _pattern(value: Any, schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    if isinstance(value, str) and not _regex(schema["pattern"]).search(value):
        errors.append(f"{where}: {_short(value)} does not match the pattern {schema['pattern']!r}")


# -- arrays and objects ---------------------------------------------------------------------------


def _check_array(value: list[Any], schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    if "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(f"{where}: has {_plural(len(value), 'item')}, fewer than the minimum {schema['minItems']}")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{where}: has {_plural(len(value), 'item')}, more than the maximum {schema['maxItems']}")
    if schema.get("uniqueItems") is True:
        seen = {json.dumps(item, sort_keys=True) for item in value}
        if len(seen) < len(value):
            errors.append(f"{where}: items must be unique")
    items = schema.get("items")
    if items is not None and items is not True:
        for index, item in enumerate(value):
            _check(item, items, f"{where}[{index}]", root, errors)


def _check_object(value: dict[str, Any], schema: dict[str, Any], where: str, root: dict[str, Any], errors: list[str]) -> None:
    properties: dict[str, Any] = schema.get("properties") or {}
    top = where == "arguments"
    for name in schema.get("required") or ():
        if name not in value:
            errors.append(f"missing required argument {name!r}" if top else f"{where}: missing required field {name!r}")
    if "minProperties" in schema and len(value) < schema["minProperties"]:
        errors.append(f"{where}: has {_plural(len(value), 'field')}, fewer than the minimum {schema['minProperties']}")
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        errors.append(f"{where}: has {_plural(len(value), 'field')}, more than the maximum {schema['maxProperties']}")
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        label = f"argument {name!r}" if top else f"{where}.{name}"
        if name in properties:
            _check(item, properties[name], label, root, errors)
        elif extra is False:
            allowed = ", ".join(properties) or "none"
            errors.append(f"unexpected {'argument' if top else 'field'} {name!r} (allowed: {allowed})")
        elif isinstance(extra, dict):
            _check(item, extra, label, root, errors)


_KEYWORDS: dict[str, Checker] = {
    "enum": _enum,
    "const": _const,
    "$ref": _ref,
    "allOf": _all_of,
    "anyOf": _any_of,
    "oneOf": _one_of,
    "not": _not,
    "minimum": _minimum,
    "maximum": _maximum,
    "exclusiveMinimum": _exclusive_minimum,
    "exclusiveMaximum": _exclusive_maximum,
    "multipleOf": _multiple_of,
    "minLength": _min_length,
    "maxLength": _max_length,
    "pattern": _pattern,
}
"""Keyword -> its check; ``type`` comes first, and arrays' and objects' keywords are checked together."""


# -- references -----------------------------------------------------------------------------------


def resolve_ref(root: dict[str, Any], ref: str) -> Any:
    """The schema a local ``$ref`` (``#``, ``#/$defs/Name``, any JSON pointer into ``root``) points at.

    KeyError when it points nowhere; the load-time gate makes sure none does by the time a call runs.
    """
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        raise KeyError(f"$ref {ref!r} is not local to the schema (it must start with '#/')")
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(f"$ref {ref!r} points at nothing in the schema")
    return node


# -- the load-time gate ---------------------------------------------------------------------------

UNSUPPORTED = frozenset({
    "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "prefixItems", "contains",
    "minContains", "maxContains", "patternProperties", "propertyNames", "unevaluatedItems", "unevaluatedProperties",
    "additionalItems", "$dynamicRef", "$recursiveRef",
})
"""JSON Schema assertions and applicators that :func:`validate` does not enforce."""

_NUMBER_KEYWORDS = ("minimum", "maximum", "multipleOf")
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_SCHEMA_LIST_KEYWORDS = ("allOf", "anyOf", "oneOf")


def schema_problems(schema: Any) -> list[str]:
    """Why ``schema`` cannot be enforced as written, one message per problem; empty when it can.

    Each message names the argument (``argument 'x'``, ``argument 'x[]'`` for its items, ...) and
    the keyword.
    """
    problems: list[str] = []
    if not isinstance(schema, dict):
        return [f"arguments: the schema must be an object, not {json_type(schema)}"]
    _gate(schema, "arguments", schema, problems)
    for group in ("$defs", "definitions"):
        for name, sub in (schema.get(group) or {}).items():
            _gate(sub, f"{group}/{name}", schema, problems)
    return problems


def _gate(schema: Any, where: str, root: dict[str, Any], problems: list[str]) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        problems.append(f"{where}: a schema must be an object or a boolean, not {json_type(schema)}")
        return

    def bad(keyword: str, why: str) -> None:
        problems.append(f"{where}: keyword {keyword!r} {why}")

    for keyword in sorted(UNSUPPORTED & schema.keys()):
        bad(keyword, "is not supported by the argument validator; remove it, and check the value in the method instead")
    if "$ref" in schema:
        _gate_ref(schema["$ref"], root, bad)
    for keyword in _NUMBER_KEYWORDS:
        if keyword in schema and not _is_number(schema[keyword]):
            bad(keyword, f"must be a number, not {_short(schema[keyword])}")
    if "multipleOf" in schema and _is_number(schema["multipleOf"]) and schema["multipleOf"] <= 0:
        bad("multipleOf", "must be above 0")
    for keyword in ("exclusiveMinimum", "exclusiveMaximum"):
        if keyword in schema and not (_is_number(schema[keyword]) or isinstance(schema[keyword], bool)):
            bad(keyword, f"must be a number, not {_short(schema[keyword])}")
    for keyword in _COUNT_KEYWORDS:
        if keyword in schema and not (isinstance(schema[keyword], int) and not isinstance(schema[keyword], bool) and schema[keyword] >= 0):
            bad(keyword, f"must be a whole number of 0 or more, not {_short(schema[keyword])}")
    if "pattern" in schema:
        if not isinstance(schema["pattern"], str):
            bad("pattern", "must be a string")
        else:
            try:
                _regex(schema["pattern"])
            except re.error as e:
                bad("pattern", f"is not a valid regular expression ({e})")
    if "enum" in schema and not isinstance(schema["enum"], list):
        bad("enum", "must be a list of values")
    if "required" in schema and not (isinstance(schema["required"], list) and all(isinstance(n, str) for n in schema["required"])):
        bad("required", "must be a list of argument names")
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not all(isinstance(kind, str) for kind in kinds):
            bad("type", "must be a type name or a list of them")
    for keyword in _SCHEMA_LIST_KEYWORDS:
        if keyword in schema:
            if not isinstance(schema[keyword], list) or not schema[keyword]:
                bad(keyword, "must be a non-empty list of schemas")
                continue
            for index, option in enumerate(schema[keyword]):
                _gate(option, f"{where} ({keyword} {index})", root, problems)
    if "not" in schema:
        _gate(schema["not"], f"{where} (not)", root, problems)
    if "items" in schema:
        if isinstance(schema["items"], list):
            bad("items", "as a list (tuple form) is not supported by the argument validator; give one schema for every item")
        else:
            _gate(schema["items"], f"{where}[]", root, problems)
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            bad("properties", "must be an object of argument schemas")
        else:
            for name, sub in properties.items():
                _gate(sub, f"argument {name!r}" if where == "arguments" else f"{where}.{name}", root, problems)
    extra = schema.get("additionalProperties")
    if extra is not None and not isinstance(extra, bool):
        _gate(extra, f"{where} (additionalProperties)", root, problems)


def _gate_ref(ref: Any, root: dict[str, Any], bad: Callable[[str, str], None]) -> None:
    """A $ref must resolve inside the schema, and a chain of them must end somewhere."""
    seen: set[str] = set()
    while True:
        if not isinstance(ref, str):
            bad("$ref", "must be a string")
            return
        if ref in seen:
            bad("$ref", f"{ref!r} refers to itself")
            return
        seen.add(ref)
        try:
            target = resolve_ref(root, ref)
        except KeyError as e:
            bad("$ref", f"cannot be resolved: {e.args[0]}; only local references ('#/$defs/Name') are supported")
            return
        if not isinstance(target, dict) or "$ref" not in target:
            return
        ref = target["$ref"]
