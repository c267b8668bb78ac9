"""Benchmark-sized state: episodes share their scenario's state, calls and checks see only what they touch."""

import tracemalloc

import pytest

from envscaler import EnvRuntime, EnvSpec
from envscaler.guard import Preempted
from envscaler.models import CheckItem
from tests.support.large_state import CHECK_CITY, CHECK_ORDERS_KEPT, CHECK_OTHERS_KEPT, shop_scenario, shop_spec, state_size, users_for

LARGE = users_for(1_300_000)


@pytest.fixture(scope="module")
def runtime():
    return EnvRuntime(EnvSpec.model_validate(shop_spec()), call_timeout_s=5.0)


def new_episode(runtime, key="move_1"):
    return runtime.new_episode(shop_scenario(LARGE)["init_config"], scenario_key=key)


def test_the_state_is_benchmark_sized_and_shared(runtime):
    first = new_episode(runtime)
    assert first.shares_state
    assert state_size(first.state()) > 1_000_000
    second = new_episode(runtime)
    assert second.call("set_city", {"user_id": "user_1", "city": "Oslo"}).error is None
    assert first.state()["users"]["user_1"]["address"]["city"] == "Springfield"
    assert new_episode(runtime).state()["users"]["user_1"]["address"]["city"] == "Springfield"


def test_an_episode_costs_memory_in_proportion_to_what_it_changed(runtime):
    checks = [CheckItem.model_validate(c) for c in (CHECK_CITY, CHECK_OTHERS_KEPT)]
    # Built once per scenario, before measuring: the shared state and its digests (state hashes).
    new_episode(runtime).validate(checks)
    size = state_size(new_episode(runtime).state())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        episodes = []
        for _ in range(20):
            episode = new_episode(runtime)
            episode.call("get_order", {"user_id": "user_5", "order_id": "#5-1"})
            episode.call("set_city", {"user_id": "user_1", "city": "Oslo"})
            episode.validate(checks)
            episodes.append(episode)
        per_episode = (tracemalloc.get_traced_memory()[0] - before) / len(episodes)
    finally:
        tracemalloc.stop()
    assert per_episode < 0.10 * size, f"{per_episode:.0f} bytes per episode for a {size}-byte state"


def test_changes_are_listed_exactly(runtime):
    episode = new_episode(runtime)
    assert episode.call("ping").diff == []
    assert episode.call("get_order", {"user_id": "user_3", "order_id": "#3-0"}).diff == []
    moved = episode.call("set_city", {"user_id": "user_1", "city": "Oslo"})
    assert [(c.path, c.before, c.after) for c in moved.diff] == [
        (["log", 0], None, "moved user_1"),
        (["users", "user_1", "address", "city"], "Springfield", "Oslo"),
    ]


def test_a_preempted_call_on_the_large_state_is_undone_exactly(runtime):
    episode = new_episode(runtime)
    episode.call("set_city", {"user_id": "user_2", "city": "Oslo"})
    before, digest = episode.state(), episode.state_hash()
    with pytest.raises(Preempted):
        episode.call("cancel_order", {"user_id": "user_2", "order_id": "#2-1", "seconds": 2}, inline_budget_s=0.05)
    assert episode.state_hash() == digest and episode.state() == before
    # Run again (as the server does, off the event loop's budget), it changes what it should.
    again = episode.call("cancel_order", {"user_id": "user_2", "order_id": "#2-1"})
    assert again.result == "Cancelled #2-1" and again.agent_text == "Cancelled #2-1"
    orders = episode.state()["users"]["user_2"]["orders"]
    assert [o["status"] for o in orders].count("cancelled") == 1
    assert new_episode(runtime).state()["users"]["user_2"]["orders"] == before["users"]["user_2"]["orders"]


def test_results_reach_the_agent_as_the_tool_returned_them(runtime):
    episode = new_episode(runtime)
    found = episode.call("find_user", {"email": "user1@example.com"})
    assert found.result == "user_1" and found.agent_text == "user_1" and found.error is None
    missing = episode.call("find_user", {"email": "nobody@example.com"})
    assert missing.error_kind == "tool" and missing.agent_text == "Error: user not found"
    order = episode.call("get_order", {"user_id": "user_1", "order_id": "#1-0"})
    assert order.result["data"]["order_id"] == "#1-0" and order.agent_text.startswith('{"success":true,')
    refused = episode.call("get_order", {"user_id": "nobody", "order_id": "#1-0"})
    assert refused.error_kind == "tool" and refused.result == {"success": False, "error": "no such user"}


def test_checks_see_the_states_and_cannot_change_them(runtime):
    episode = new_episode(runtime)
    episode.call("set_city", {"user_id": "user_1", "city": "Oslo"})
    vandal = {"check_item": "vandal", "check_func": "def check_func(final_state):\n    final_state['users'].clear()\n    initial_state['users'].clear()\n    return True"}
    checks = [CheckItem.model_validate(c) for c in (vandal, CHECK_CITY, CHECK_OTHERS_KEPT, CHECK_ORDERS_KEPT)]
    result = episode.validate(checks)
    assert [c.passed for c in result.checks] == [True, True, True, True]
    assert result.score == 1.0
    assert episode.state()["users"]["user_1"]["address"]["city"] == "Oslo"
    assert len(new_episode(runtime).state()["users"]) == LARGE
