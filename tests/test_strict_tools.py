"""Tools as strict-mode clients take them, structured results, and trace context, over real MCP.

``strict_problems`` checks a schema against OpenAI's documented rules for ``strict: true`` function
calling (Structured Outputs, "Supported schemas"), independently of ``envscaler.strict``:

- the root is an object (not an ``anyOf``);
- every object has ``additionalProperties: false`` and lists every property in ``required``;
- every schema says what it takes (``type``, ``enum``, ``const``, ``anyOf`` or ``$ref``): no free-form values;
- only the supported keywords appear (:data:`OPENAI_STRICT_KEYWORDS`);
- at most 10 levels of nesting, 5000 properties and 1000 enum values in all.

An optional parameter must take ``null`` in the published schema, and a ``null`` must reach the
method as "not given" (its default), unless the parameter's own type takes None.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from envscaler import EnvRuntime, default_catalog, load_bundle, load_bundles
from envscaler.schema import validate
from tests.support.bundles import counter_bundle
from tests.support.cli import envscaler
from tests.support.server import serve

pytestmark = pytest.mark.anyio

OPENAI_STRICT_KEYWORDS = {
    "type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf", "$ref", "$defs",
    "definitions", "description", "title", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minItems", "maxItems",
}

IMPORTED_CODE = '''
from typing import Optional

class Notes:
    def __init__(self, init_config: dict):
        self.notes = {}

    def add_note(self, note_id: str, text: str, meta: dict = None, pinned: bool = False, tags: list = None) -> dict:
        self.notes[note_id] = {"text": text, "pinned": pinned, "tags": tags or [], "meta": meta or {}}
        return {"success": True, "data": self.notes[note_id]}

    def find(self, query: str = "", limit: int = 10, owner: Optional[str] = None) -> dict:
        hits = [k for k, v in self.notes.items() if query in v["text"]][:limit]
        return {"success": True, "data": hits, "owner": owner}
'''

# As EnvScaler's released metadata lists tools: optional properties left out of "required", objects left open.
IMPORTED_TOOLS = [
    {"type": "function", "function": {"name": "add_note", "description": "Add a note.", "parameters": {
        "type": "object",
        "properties": {
            "note_id": {"type": "string"}, "text": {"type": "string", "minLength": 1},
            "meta": {"type": "object", "properties": {"source": {"type": "string"}, "priority": {"type": "integer", "enum": [1, 2, 3]}},
                     "required": ["source"]},
            "pinned": {"type": "boolean", "default": False},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["note_id", "text"]}}},
    {"type": "function", "function": {"name": "find", "description": "Find notes.", "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1},
                       "owner": {"type": ["string", "null"]}}}}},
]


def strict_problems(schema: Any, where: str = "parameters", depth: int = 0, root: bool = True) -> list[str]:
    """Every way ``schema`` breaks OpenAI's strict-mode rules (see the module's docstring)."""
    if not isinstance(schema, dict):
        return [f"{where}: a schema must be an object, not {schema!r}"]
    problems = [f"{where}: unsupported keyword {key!r}" for key in schema if key not in OPENAI_STRICT_KEYWORDS]
    if depth > 10:
        problems.append(f"{where}: nested deeper than 10 levels")
    if root and (schema.get("type") != "object" or "anyOf" in schema):
        problems.append(f"{where}: the root must be an object")
    if not any(key in schema for key in ("type", "enum", "const", "anyOf", "$ref")):
        problems.append(f"{where}: says nothing of what it takes (free-form values are not allowed)")
    if len(schema.get("enum") or []) > 1000:
        problems.append(f"{where}: more than 1000 enum values")
    kinds = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    properties = schema.get("properties")
    if "object" in kinds or properties is not None:
        if schema.get("additionalProperties") is not False:
            problems.append(f"{where}: an object must have additionalProperties: false")
        if set(schema.get("required") or []) != set(properties or {}):
            problems.append(f"{where}: required must list every property")
    for name, sub in (properties or {}).items():
        problems += strict_problems(sub, f"{where}.{name}", depth + 1, root=False)
    if "items" in schema:
        problems += strict_problems(schema["items"], f"{where}[]", depth + 1, root=False)
    for index, option in enumerate(schema.get("anyOf") or []):
        problems += strict_problems(option, f"{where}|{index}", depth + 1, root=False)
    for name, sub in (schema.get("$defs") or {}).items():
        problems += strict_problems(sub, f"{where}.$defs.{name}", depth + 1, root=False)
    return problems


def _count_properties(schema: Any) -> int:
    if not isinstance(schema, dict):
        return 0
    subs = [*(schema.get("properties") or {}).values(), *(schema.get("anyOf") or []), schema.get("items")]
    return len(schema.get("properties") or {}) + sum(_count_properties(sub) for sub in subs)


def _optional_take_null(original: dict[str, Any], published: dict[str, Any], where: str) -> list[str]:
    required = set(original.get("required") or [])
    problems = []
    for name, sub in (original.get("properties") or {}).items():
        strict_sub = published["properties"][name]
        if name not in required and validate(None, strict_sub):
            problems.append(f"{where}.{name}: optional, but null is refused")
        if isinstance(sub, dict) and "properties" in sub:
            nested = next(o for o in strict_sub.get("anyOf", [strict_sub]) if "properties" in o)
            problems += _optional_take_null(sub, nested, f"{where}.{name}")
    return problems


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """EnvScaler's released format, imported with the command a user types."""
    root = tmp_path_factory.mktemp("imported")
    envs = {"notes": {"env_id": "notes", "env_class_name": "Notes", "env_class_code": IMPORTED_CODE, "tools": IMPORTED_TOOLS,
                      "environment_summary": "Notes.", "environment_introduction": "A notebook."}}
    scenario = {"task_id": "notes_001", "env_id": "notes", "env_class_name": "Notes", "init_config": {}, "task": "Add a note.",
                "checklist_with_func": [{"check_item": "one note", "check_func": "def check_func(final_state):\n    return len(final_state['notes']) == 1"}],
                "reference_solution": [{"name": "add_note", "arguments": {"note_id": "n1", "text": "hi"}}]}
    (root / "envs.json").write_text(json.dumps(envs))
    (root / "tasks.json").write_text(json.dumps([scenario]))
    done = envscaler("import", "envscaler", "--envs", str(root / "envs.json"), "--scenarios", str(root / "tasks.json"), "--out", str(root / "out"))
    assert done.returncode == 0, done.stderr
    return root / "out"


def test_every_bundled_and_imported_tool_is_strict_valid(imported):
    runtimes = [EnvRuntime(bundle.spec) for bundle in [*load_bundles(default_catalog()), *load_bundles(imported)]]
    tools = [(runtime, tool) for runtime in runtimes for tool in runtime.tool_list()]
    assert len(tools) >= 158
    problems: list[str] = []
    for runtime, tool in tools:
        published = tool.mcp()["inputSchema"]
        where = f"{runtime.env_id}.{tool.name}"
        problems += strict_problems(published, where)
        problems += _optional_take_null(tool.parameters, published, where)
    assert not problems, "\n".join(problems)
    assert sum(_count_properties(tool.mcp()["inputSchema"]) for _, tool in tools) <= 5000


def test_a_null_for_an_optional_parameter_is_its_default(imported):
    runtime = EnvRuntime(load_bundle(imported / "notes").spec)
    episode = runtime.new_episode({})
    added = episode.call("add_note", {"note_id": "n1", "text": "hello", "meta": {"source": "mail", "priority": None},
                                      "pinned": None, "tags": None})
    assert added.error is None, added.error
    assert added.result["data"] == {"text": "hello", "pinned": False, "tags": [], "meta": {"source": "mail"}}
    # A parameter whose own type takes None gets None; a required one still refuses null.
    found = episode.call("find", {"query": None, "limit": None, "owner": None})
    assert found.error is None and found.result == {"success": True, "data": ["n1"], "owner": None}
    refused = episode.call("add_note", {"note_id": "n2", "text": None, "meta": None, "pinned": None, "tags": None})
    assert refused.error_kind == "agent" and "'text'" in refused.error


@pytest.fixture(scope="module")
def counter_server(tmp_path_factory):
    with serve(counter_bundle(tmp_path_factory.mktemp("counter"))) as server:
        yield server


def _episode(server) -> dict[str, Any]:
    with server.client() as http:
        response = http.post("/episodes", json={"scenario_id": "counter_001"})
    assert response.status_code == 201, response.text
    return response.json()


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_structured_results_match_their_output_schema(counter_server, mode):
    episode = _episode(counter_server)
    async with httpx2.AsyncClient(timeout=30) as http, Client(streamable_http_client(episode["mcp_url"], http_client=http), mode=mode) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert listed["add"].output_schema == {"type": "object"}
        assert listed["add"].input_schema["required"] == ["item_id", "amount"]
        # The SDK checks structuredContent against outputSchema itself; a null amount is "not given" (1).
        added = await client.call_tool("add", {"item_id": "a", "amount": None})
        assert not added.is_error, added.content
        assert added.structured_content == json.loads(added.content[0].text)
        assert added.structured_content["data"]["count"] == 1
        failed = await client.call_tool("get_item", {"item_id": "nope"})
        assert failed.is_error and failed.structured_content == json.loads(failed.content[0].text)
        refused = await client.call_tool("add", {"item_id": 3})
        assert refused.is_error and refused.structured_content is None


def test_trace_context_reaches_the_trajectory(counter_server):
    episode = _episode(counter_server)
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    calls = [({"traceparent": parent, "tracestate": "vendor=1"}, (parent, "vendor=1")),
             ({"traceparent": "not-a-trace", "tracestate": "vendor=1"}, (None, None)),
             ({}, (None, None))]
    with httpx2.Client(timeout=30) as http:
        for number, (meta, _) in enumerate(calls):
            body = {"jsonrpc": "2.0", "id": number, "method": "tools/call",
                    "params": {"name": "get_item", "arguments": {"item_id": "a"}, "_meta": meta}}
            answer = http.post(episode["mcp_url"], json=body, headers={"Accept": "application/json, text/event-stream"})
            assert answer.status_code == 200 and not answer.json()["result"]["isError"], answer.text
    with counter_server.client() as control:
        recorded = control.get(f"/episodes/{episode['episode_id']}/trajectory").json()["calls"]
    assert [(call["traceparent"], call["tracestate"]) for call in recorded] == [expected for _, expected in calls]

