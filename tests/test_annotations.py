"""Tool annotations: derived from the methods' code, overridden by env.json, served in tools/list, gated."""

import ast

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from envscaler import EnvRuntime, default_catalog, load_bundle
from envscaler import annotations
from envscaler.annotations import read_ahead, state_function_annotations
from envscaler.loader import compile_ahead
from envscaler.models import EnvSpec
from tests.support.bundles import counter_bundle, counter_scenario, counter_spec, write_bundle
from tests.support.cli import envscaler
from tests.support.server import serve

ALIASES_CODE = '''
import copy

def _find(records, key):
    return records.get(key)

class Shop:
    def __init__(self, init_config: dict):
        self.orders = {}
        self.log = []

    def _order(self, order_id):
        return self.orders.get(order_id)

    def _mark(self, order, status):
        order["status"] = status

    def view(self, order_id: str) -> dict:
        order = self._order(order_id)
        copy_of = copy.deepcopy(order)
        copy_of["seen"] = True
        listing = sorted([o for o in self.orders.values() if o["status"] == "open"], key=lambda o: o["id"])
        listing.sort(key=lambda o: o["id"])
        listing.append({"id": "extra"})
        return {"order": copy_of, "open": listing}

    def cancel(self, order_id: str) -> dict:
        order = _find(self.orders, order_id)
        self._mark(order, "cancelled")
        return {"success": True}

    def close_all(self) -> dict:
        for order in [o for o in self.orders.values() if o["status"] == "open"]:
            order["status"] = "closed"
        return {"success": True}

    def place(self, total: float) -> dict:
        order_id = f"O{len(self.orders) + 1}"
        self.orders[order_id] = {"id": order_id, "status": "open", "total": total}
        return {"success": True, "data": order_id}

    def put(self, order_id: str, total: float) -> dict:
        self.orders[order_id] = {"id": order_id, "status": "open", "total": total}
        return {"success": True}

    def forget(self, order_id: str) -> dict:
        self.orders.pop(order_id, None)
        return {"success": True}

    def note(self, text: str) -> dict:
        self.log.append(text)
        return {"success": True}

    def tally(self, order_id: str) -> dict:
        orders, count = self.orders, 0
        orders[order_id]["tally"] = count
        return {"success": True}
'''


def hints(runtime):
    return {name: (a.readOnlyHint, a.destructiveHint, a.idempotentHint) for name, a in runtime.annotations.items()}


def test_hints_follow_writes_through_aliases_helpers_and_loops():
    runtime = EnvRuntime(EnvSpec(env_id="shop", env_class_name="Shop", env_class_code=ALIASES_CODE))
    assert hints(runtime) == {
        "view": (True, False, True),  # writes only to copies and to new lists of state objects
        "cancel": (False, True, True),  # through a module helper's result and a private method
        "close_all": (False, True, True),  # through a loop over a filtered list
        "place": (False, False, False),  # a new record under a made-up key: additive, once per call
        "put": (False, False, True),  # a record under the caller's key: additive, the same each time
        "forget": (False, True, False),
        "note": (False, False, False),
        "tally": (False, True, True),  # through a name bound pair by pair (``a, b = x, y``)
    }
    assert runtime.annotations["close_all"].title == "Close all"
    assert runtime.annotations["view"].openWorldHint is False


DECORATED_CODE = '''
import functools

def logged(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.calls += 1
        return method(self, *args, **kwargs)
    return wrapper

class Decorated:
    def __init__(self, init_config: dict):
        self.items, self.calls = {}, 0

    @logged
    def read(self, key: str) -> dict:
        return {"data": self.items.get(key)}

    @staticmethod
    def echo(text: str) -> dict:
        return {"data": text}

    @functools.wraps(len)
    def count(self) -> dict:
        return {"data": len(self.items)}

    def drop(self, key: str) -> dict:
        note = """a string whose lines
start anywhere"""
        self.items.pop(key, None)
        return {"data": note}
'''


def test_hints_read_each_method_as_written_under_its_decorators():
    runtime = EnvRuntime(EnvSpec(env_id="decorated", env_class_name="Decorated", env_class_code=DECORATED_CODE))
    assert hints(runtime) == {
        "read": (True, False, True),  # the method the decorator wraps, not the wrapper's own counting
        "echo": (True, False, True),
        "count": (True, False, True),  # wraps a builtin: read as itself
        "drop": (False, True, False),  # a multi-line string out of the method's indentation still parses
    }


STATE_FUNCTIONS = '''
def lookup(data, key):
    return data["records"].get(key)

def store(data, key, value):
    records, stamp = data["records"], 1
    records[key] = {"value": value, "stamp": stamp}
'''


def test_a_function_handed_the_state_as_its_first_parameter_writes_through_it():
    # tau-bench's tools: ``invoke(data, ...)``, the data their first parameter.
    functions = {node.name: node for node in ast.parse(STATE_FUNCTIONS).body}
    assert state_function_annotations(functions["lookup"], "lookup").readOnlyHint is True
    stored = state_function_annotations(functions["store"], "store")
    assert (stored.readOnlyHint, stored.title) == (False, "Store")


def test_explicit_annotations_in_env_json_win_field_by_field(tmp_path):
    spec = counter_spec(tool_annotations={"get_item": {"title": "Look up an item", "idempotentHint": False},
                                          "add": {"destructiveHint": True}})
    runtime = EnvRuntime(load_bundle(write_bundle(tmp_path, spec, [counter_scenario()])).spec)
    get_item, add = runtime.annotations["get_item"], runtime.annotations["add"]
    assert (get_item.title, get_item.readOnlyHint, get_item.idempotentHint) == ("Look up an item", True, False)
    assert (add.readOnlyHint, add.destructiveHint, add.idempotentHint) == (False, True, False)


def test_bundled_read_tools_are_read_only_and_write_tools_are_not():
    runtime = EnvRuntime(load_bundle(default_catalog() / "online_retail").spec)
    read_only = {name for name, a in runtime.annotations.items() if a.readOnlyHint}
    assert {"get_order", "list_orders", "search_products", "get_customer"} <= read_only
    assert not {"cancel_order", "create_order", "issue_refund", "pay_order"} & read_only
    assert all(a.title and a.destructiveHint is not None for a in runtime.annotations.values())


@pytest.mark.parametrize("env_id", ["library_circulation", "personal_banking"])
def test_annotations_read_ahead_are_those_read_where_they_are_needed(monkeypatch, env_id):
    spec = load_bundle(default_catalog() / env_id).spec
    read_here = EnvRuntime(spec).annotations
    read_ahead(compile_ahead(spec.env_class_code), spec.env_class_code)

    def parsed_again(*args):
        raise AssertionError("a method read ahead was parsed again")

    monkeypatch.setattr(annotations, "_parse_function", parsed_again)
    assert EnvRuntime(spec).annotations == read_here


def test_catalog_check_fails_a_read_only_tool_whose_reference_call_changed_the_state(tmp_path):
    spec = counter_spec(tool_annotations={"add": {"readOnlyHint": True}})
    directory = write_bundle(tmp_path, spec, [counter_scenario()])
    result = envscaler("catalog", "check", str(directory.parent), "--jobs", "1")
    assert result.returncode == 1, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert "read_only_tools" in output and "call 2 (add)" in output and "call 3 (add)" in output
    assert "call 1 (get_item)" not in output


def test_catalog_check_names_an_annotation_for_a_tool_that_does_not_exist(tmp_path):
    directory = write_bundle(tmp_path, counter_spec(tool_annotations={"fly": {"readOnlyHint": True}}), [counter_scenario()])
    result = envscaler("catalog", "check", str(directory.parent), "--jobs", "1")
    assert result.returncode == 1
    assert "tool_annotations names 'fly', which is not a tool" in result.stdout + result.stderr


@pytest.mark.anyio
async def test_tools_list_carries_the_annotations_to_the_official_client(tmp_path):
    with serve(counter_bundle(tmp_path)) as server:
        with server.client() as http:
            url = http.post("/episodes", json={"scenario_id": "counter_001"}).json()["mcp_url"]
        async with httpx2.AsyncClient(timeout=30) as http, Client(streamable_http_client(url, http_client=http)) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
    assert tools["get_item"].annotations.read_only_hint is True
    assert tools["get_item"].annotations.title == "Get item"
    assert tools["add"].annotations.read_only_hint is False
    assert tools["add"].annotations.idempotent_hint is False
    assert tools["rename"].annotations.idempotent_hint is True
