"""The strict-mode form of a tool's argument schema, and what a ``null`` in it means.

OpenAI's strict function calling (and clients that follow it: the Agents SDK, pydantic-ai's OpenAI
models) accepts a schema only when every object lists all its properties in ``required`` and closes
itself with ``additionalProperties: false``; an optional parameter is written as one that may be
``null``. Tools are published in that form (:func:`strict_schema`), while arguments are still checked
against the tool's own schema: a ``null`` for an optional parameter whose own type does not take
``null`` means "not given" and is left out before the method runs (:func:`omit_nulls`), so the method
gets its default, not None.

The published form keeps only the keywords strict mode supports (:data:`STRICT_KEYWORDS`); what it
drops (``minLength``, ``default``, ``allOf``, ...) is still enforced by the server's validator.
"""

from __future__ import annotations

from typing import Any

from envscaler.schema import resolve_ref, validate

STRICT_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf", "$ref", "$defs",
    "definitions", "description", "title", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minItems", "maxItems",
})
"""The keywords OpenAI's strict mode documents as supported; the published form keeps only these."""

_NULL = {"type": "null"}


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` as strict mode takes it: every property required, the optional ones nullable."""
    return _strict(schema)


def _strict(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = {key: value for key, value in schema.items() if key in STRICT_KEYWORDS}
    if "oneOf" in schema and "anyOf" not in schema:
        out["anyOf"] = schema["oneOf"]  # strict mode has no oneOf; the server still refuses a value matching two
    if "anyOf" in out:
        out["anyOf"] = [_strict(option) for option in out["anyOf"]]
    if "items" in out:
        out["items"] = _strict(out["items"])
    for key in ("$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(sub) for name, sub in out[key].items()}
    properties = out.get("properties")
    if isinstance(properties, dict):
        required = set(schema.get("required") or ())
        out["properties"] = {name: _strict(sub) if name in required else _nullable(_strict(sub)) for name, sub in properties.items()}
        out["required"] = list(properties)
        # A listed object is closed for strict clients; one that admits more (a schema or true) stays as it is.
        if "additionalProperties" not in schema:
            out["additionalProperties"] = False
        elif isinstance(out["additionalProperties"], dict):
            out["additionalProperties"] = _strict(out["additionalProperties"])
    return out


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` widened to take ``null`` too, in a form strict mode accepts."""
    kind = schema.get("type")
    if kind in ("object", "array"):
        return _either_null(schema)  # a union of types is for scalars; a nullable object or array is an anyOf
    if isinstance(kind, str):
        schema = {**schema, "type": [kind, "null"] if kind != "null" else kind}
    elif isinstance(kind, list):
        schema = {**schema, "type": kind if "null" in kind else [*kind, "null"]}
    elif "anyOf" in schema:
        options = schema["anyOf"]
        return schema if _NULL in options else {**schema, "anyOf": [*options, _NULL]}
    elif "$ref" in schema or "const" in schema:
        return _either_null(schema)
    if "enum" in schema and None not in schema["enum"]:
        schema = {**schema, "enum": [*schema["enum"], None]}
    return schema


def _either_null(schema: dict[str, Any]) -> dict[str, Any]:
    annotations = {key: schema[key] for key in ("description", "title") if key in schema}
    plain = {key: value for key, value in schema.items() if key not in annotations}
    return {"anyOf": [plain, _NULL], **annotations}


def omit_nulls(arguments: dict[str, Any], schema: dict[str, Any], root: dict[str, Any] | None = None) -> dict[str, Any]:
    """``arguments`` without the nulls that mean "not given": for optional properties that do not take null.

    Nested objects (a TypedDict's optional fields) are treated the same way. ``arguments`` itself is
    never changed: a copy comes back when something is left out.
    """
    root = schema if root is None else root
    if "$ref" in schema:
        try:
            schema = resolve_ref(root, schema["$ref"])
        except KeyError:
            return arguments
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return arguments
    required = schema.get("required") or ()
    kept: dict[str, Any] = {}
    changed = False
    for key, value in arguments.items():
        sub = properties.get(key)
        if isinstance(sub, dict):
            if value is None and key not in required and validate(None, sub, root=root):
                changed = True
                continue
            new = _omit_nested(value, sub, root)
            changed = changed or new is not value
            value = new
        kept[key] = value
    return kept if changed else arguments


def _omit_nested(value: Any, schema: dict[str, Any], root: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        return omit_nulls(value, schema, root)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        items = [_omit_nested(item, schema["items"], root) for item in value]
        return items if any(new is not old for new, old in zip(items, value)) else value
    return value
