"""Argument validation: every keyword the validator enforces, and the gate for the ones it does not."""

from __future__ import annotations

import pytest

from envscaler import EnvRuntime, EnvSpec
from envscaler.errors import BundleError, SchemaError
from envscaler.gates import check_bundle
from envscaler.models import Bundle
from envscaler.schema import schema_problems, validate
from tests.support.bundles import counter_spec

DEFS = {"$defs": {"date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                  "seat": {"type": "object", "properties": {"row": {"type": "integer", "minimum": 1}}, "required": ["row"]}}}


def one(value, schema, root=None):
    """The only problem ``value`` has with ``schema`` (the test fails on none or several)."""
    problems = validate(value, schema, "argument 'x'", root)
    assert len(problems) == 1, problems
    return problems[0]


@pytest.mark.parametrize(("schema", "good", "bad", "message"), [
    ({"type": "string", "minLength": 2}, "ab", "a", "shorter than 2 characters"),
    ({"type": "string", "maxLength": 2}, "ab", "abc", "longer than 2 characters"),
    ({"type": "string", "pattern": "^A[0-9]+$"}, "A12", "B12", "does not match the pattern '^A[0-9]+$'"),
    ({"type": "string", "pattern": "[0-9]"}, "x9y", "xy", "does not match"),  # searched, not anchored
    ({"type": "array", "minItems": 1}, [1], [], "has 0 items, fewer than the minimum 1"),
    ({"type": "array", "maxItems": 1}, [1], [1, 2], "has 2 items, more than the maximum 1"),
    ({"type": "array", "uniqueItems": True}, [1, True, {"a": 1}], [{"a": 1}, {"a": 1}], "items must be unique"),
    ({"type": "number", "exclusiveMinimum": 0}, 0.5, 0, "0 must be above 0"),
    ({"type": "number", "exclusiveMaximum": 10}, 9.9, 10, "10 must be below 10"),
    ({"type": "number", "minimum": 0, "exclusiveMinimum": True}, 1, 0, "0 must be above 0"),  # draft 4
    ({"type": "number", "multipleOf": 0.1}, 0.3, 0.35, "0.35 is not a multiple of 0.1"),
    ({"type": "object", "minProperties": 1}, {"a": 1}, {}, "has 0 fields, fewer than the minimum 1"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, 3, 2, "2 is below the minimum 3"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1.5, 2, "matches 2 of the allowed forms (integer, number)"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "a", None, "matches none of the allowed forms (integer, string)"),
    ({"not": {"type": "null"}}, 0, None, "None is a form that is not allowed here"),
    ({"$ref": "#/$defs/date", **DEFS}, "2025-01-31", "31/01/2025", "does not match the pattern"),
    ({"$ref": "#/definitions/n", "definitions": {"n": {"type": "integer"}}}, 1, "1", "expected integer, got string '1'"),
    ({"type": "string", "format": "date"}, "anything", 5, "expected string"),  # format is an annotation
])
def test_each_keyword_accepts_the_good_value_and_names_the_bad_one(schema, good, bad, message):
    assert schema_problems(schema) == []
    assert validate(good, schema) == []
    assert message in one(bad, schema)


def test_references_resolve_against_the_whole_schema_wherever_they_are():
    schema = {"type": "object", "properties": {"seats": {"type": "array", "items": {"$ref": "#/$defs/seat"}}}, **DEFS}
    assert schema_problems(schema) == []
    assert validate({"seats": [{"row": 2}]}, schema) == []
    assert validate({"seats": [{"row": 0}, {}]}, schema) == [
        "argument 'seats'[0].row: 0 is below the minimum 1",
        "argument 'seats'[1]: missing required field 'row'",
    ]


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "object", "properties": {"when": {"type": "string", "if": {"minLength": 3}}}},
     "argument 'when': keyword 'if' is not supported by the argument validator"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "arguments: keyword 'patternProperties' is not supported"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "propertyNames": {}}}}},
     "argument 'tags'[]: keyword 'propertyNames'"),
    ({"type": "object", "properties": {"d": {"$ref": "#/$defs/missing"}}}, "argument 'd': keyword '$ref' cannot be resolved"),
    ({"type": "object", "properties": {"d": {"$ref": "https://example.com/date.json"}}}, "only local references"),
    ({"$ref": "#", "type": "object"}, "refers to itself"),
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "(unclosed"}}},
     "argument 'code': keyword 'pattern' is not a valid regular expression"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": "5"}}}, "argument 'n': keyword 'minimum' must be a number"),
    ({"type": "array", "items": [{"type": "string"}]}, "keyword 'items' as a list (tuple form) is not supported"),
    ({"type": "object", "properties": {"n": {"oneOf": []}}}, "argument 'n': keyword 'oneOf' must be a non-empty list"),
])
def test_the_gate_names_the_argument_and_the_keyword_it_cannot_enforce(schema, message):
    problems = schema_problems(schema)
    assert len(problems) == 1 and message in problems[0], problems


def test_an_environment_whose_schema_cannot_be_enforced_does_not_load():
    spec = counter_spec()
    spec["tools"] = [tool.openai() for tool in EnvRuntime(EnvSpec.model_validate(spec)).tool_list()]
    add = next(t for t in spec["tools"] if t["function"]["name"] == "add")
    add["function"]["parameters"]["properties"]["item_id"]["dependentRequired"] = {"item_id": ["amount"]}
    with pytest.raises(SchemaError) as caught:
        EnvRuntime(EnvSpec.model_validate(spec))
    assert isinstance(caught.value, BundleError) and caught.value.exit_code == 2
    assert str(caught.value).startswith("counter: tool 'add', argument 'item_id': keyword 'dependentRequired'")
    report = check_bundle(Bundle(spec=EnvSpec.model_validate(spec)))
    [gate] = report.env_gates
    assert gate.gate == "class_loads" and not gate.passed and "dependentRequired" in gate.detail
