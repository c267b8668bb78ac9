"""Environments of several classes (EnvSpec.classes): one state per part, each part's own loader, tools of all parts."""

import json

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from envscaler import EnvRuntime
from envscaler.models import EnvSpec
from tests.support.bundles import SHELF_CODE, shelf_scenario, shelf_spec, write_bundle
from tests.support.cli import envscaler
from tests.support.server import serve


def test_each_part_loads_its_own_config_and_the_state_is_keyed_by_part():
    runtime = EnvRuntime(EnvSpec.model_validate(shelf_spec()))
    episode = runtime.new_episode(shelf_scenario()["init_config"], scenario_key="shelf_001")
    assert episode.state() == {"Shelf": {"items": ["Emma"]}, "Tally": {"items": 5}}
    assert [t.name for t in runtime.tool_list()] == ["add_book", "list_books", "bump"]
    assert runtime.tools["add_book"].parameters["properties"]["title"] == {"type": "string", "description": "The book's title."}
    assert runtime.annotations["list_books"].readOnlyHint is True and runtime.annotations["bump"].readOnlyHint is False

    outcome = episode.call("bump", {"by": 2})
    assert outcome.result == 7 and [(c.path, c.before, c.after) for c in outcome.diff] == [(["Tally", "items"], 5, 7)]
    refused = episode.call("bump", {"by": -1})
    assert refused.error_kind == "agent" and "by must not be negative" in refused.error
    missing = runtime.new_episode({})
    assert missing.state() == {"Shelf": {"items": ["Dune"]}, "Tally": {"items": 0}}


def test_a_part_s_loader_gets_its_loader_arguments():
    parts = shelf_spec()["classes"]
    parts[0]["loader_arguments"] = {"long_context": True}
    runtime = EnvRuntime(EnvSpec.model_validate(shelf_spec(classes=parts)))
    assert runtime.new_episode({"Shelf": {"books": ["Emma"]}}).state()["Shelf"] == {"items": ["Emma", "Index of every book"]}


def test_a_tool_in_two_parts_is_refused_naming_both_classes(tmp_path):
    code = SHELF_CODE + "\n\nclass Ledger:\n    def bump(self) -> int:\n        return 1\n"
    parts = [*shelf_spec()["classes"], {"name": "Ledger", "class_name": "Ledger"}]
    directory = write_bundle(tmp_path, shelf_spec(env_class_code=code, classes=parts), [shelf_scenario()])
    result = envscaler("catalog", "check", str(directory.parent), "--jobs", "1")
    assert result.returncode == 1
    assert "tool 'bump' is a method of both Tally (part 'Tally') and Ledger (part 'Ledger')" in result.stdout + result.stderr


def test_an_init_config_key_that_names_no_part_fails_to_instantiate(tmp_path):
    scenario = {**shelf_scenario(), "init_config": {"Shelf": {}, "Shelves": {}}}
    directory = write_bundle(tmp_path, shelf_spec(), [scenario])
    result = envscaler("catalog", "check", str(directory.parent), "--jobs", "1")
    assert result.returncode == 1
    assert "init_config names 'Shelves', which are not parts of this environment" in result.stdout + result.stderr


def test_catalog_check_passes_the_two_class_bundle(tmp_path):
    directory = write_bundle(tmp_path, shelf_spec(), [shelf_scenario()])
    result = envscaler("catalog", "check", str(directory.parent), "--jobs", "1")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.anyio
async def test_two_classes_served_over_mcp_score_one(tmp_path):
    with serve(write_bundle(tmp_path, shelf_spec(), [shelf_scenario()])) as server:
        with server.client() as control:
            episode = control.post("/episodes", json={"scenario_id": "shelf_001"}).json()
            path = f"/episodes/{episode['episode_id']}"
            assert control.post(f"{path}/validate").json()["score"] == 0.0
            async with httpx2.AsyncClient(timeout=30) as http, \
                    Client(streamable_http_client(episode["mcp_url"], http_client=http)) as client:
                tools = {t.name: t for t in (await client.list_tools()).tools}
                shelved = await client.call_tool("add_book", {"title": "Ulysses"})
                refused = await client.call_tool("bump", {"by": -3})
                bumped = await client.call_tool("bump", {"by": 2})
            state = control.get(f"{path}/state").json()["state"]
            score = control.post(f"{path}/validate").json()
    assert set(tools) == {"add_book", "list_books", "bump"}
    assert tools["list_books"].annotations.read_only_hint is True
    assert json.loads(shelved.content[0].text) == {"count": 2}
    assert refused.is_error and "by must not be negative, got -3" in refused.content[0].text
    assert not bumped.is_error and bumped.content[0].text == "7"
    assert state == {"Shelf": {"items": ["Emma", "Ulysses"]}, "Tally": {"items": 7}}
    assert score["score"] == 1.0
