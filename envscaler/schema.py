"""Argument validation against a tool's JSON schema.

Tool schemas are OpenAI function parameters: small objects of typed properties. This validator
covers what they use (type, enum, const, properties, required, additionalProperties, items, anyOf,
oneOf, minimum, maximum) and writes messages a model can act on. It is a few microseconds per call,
where a general JSON Schema library costs far more on every tool call.
"""

from __future__ import annotations

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


def json_type(value: Any) -> str:
    """The JSON type name of a Python value ("integer", "object", ...)."""
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _matches_type(value: Any, expected: str) -> bool:
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected == "string":
        return isinstance(value, str)
    if expected == "boolean":
        return isinstance(value, bool)
    if expected == "array":
        return isinstance(value, list)
    if expected == "object":
        return isinstance(value, dict)
    if expected == "null":
        return value is None
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate(value: Any, schema: dict[str, Any], where: str = "arguments") -> list[str]:
    """Every way ``value`` breaks ``schema``, as messages naming the argument. Empty when valid."""
    errors: list[str] = []
    expected = schema.get("type")
    if expected is not None:
        options = expected if isinstance(expected, list) else [expected]
        if not any(_matches_type(value, t) for t in options):
            wanted = " or ".join(options)
            errors.append(f"{where}: expected {wanted}, got {json_type(value)} {_short(value)}")
            return errors
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {_short(value)} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: must be {schema['const']!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where}: {value} is below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where}: {value} is above the maximum {schema['maximum']}")
    for key in ("anyOf", "oneOf"):
        if key in schema and not any(not validate(value, option, where) for option in schema[key]):
            kinds = ", ".join(str(option.get("type", "schema")) for option in schema[key])
            errors.append(f"{where}: matches none of the allowed forms ({kinds})")
    if isinstance(value, dict):
        errors.extend(_validate_object(value, schema, where))
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            errors.extend(validate(item, schema["items"], f"{where}[{index}]"))
    return errors


def _validate_object(value: dict[str, Any], schema: dict[str, Any], where: str) -> list[str]:
    errors: list[str] = []
    properties: dict[str, Any] = schema.get("properties") or {}
    top = where == "arguments"
    for name in schema.get("required") or ():
        if name not in value:
            label = f"missing required argument {name!r}" if top else f"{where}: missing required field {name!r}"
            errors.append(label)
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        label = f"argument {name!r}" if top else f"{where}.{name}"
        if name in properties:
            errors.extend(validate(item, properties[name], label))
        elif extra is False:
            allowed = ", ".join(properties) or "none"
            errors.append(f"unexpected {'argument' if top else 'field'} {name!r} (allowed: {allowed})")
        elif isinstance(extra, dict):
            errors.extend(validate(item, extra, label))
    return errors
