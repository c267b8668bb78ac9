"""Small environments written for the tests, adversarial ones included, and a way to write them out."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

COUNTER_CODE = '''
import time
from typing import Dict, List, TypedDict


class Item(TypedDict):
    name: str
    count: int


class Counter:
    def __init__(self, init_config: dict):
        self.items: Dict[str, Item] = {}
        self.log: List[str] = []

    def get_item(self, item_id: str) -> dict:
        """Read one item.

        Args:
            item_id (str): Id of the item.
        """
        if item_id not in self.items:
            return {"success": False, "error": f"no item {item_id}"}
        return {"success": True, "data": self.items[item_id]}

    def add(self, item_id: str, amount: int = 1) -> dict:
        """Add to an item's count.

        Args:
            item_id (str): Id of the item.
            amount (int): How much to add.
        """
        if item_id not in self.items:
            return {"success": False, "error": f"no item {item_id}"}
        self.items[item_id]["count"] += amount
        self.log.append(f"add {item_id} {amount}")
        return {"success": True, "data": self.items[item_id]}

    def rename(self, item_id: str, name: str) -> dict:
        """Rename an item.

        Args:
            item_id (str): Id of the item.
            name (str): The new name.
        """
        if item_id not in self.items:
            return {"success": False, "error": f"no item {item_id}"}
        self.items[item_id]["name"] = name
        return {"success": True, "data": self.items[item_id]}

    def half_then_fail(self, item_id: str) -> dict:
        """Change the state, then raise (an environment bug).

        Args:
            item_id (str): Id of the item.
        """
        self.items[item_id]["count"] = -1
        raise RuntimeError("environment bug after a change")

    def divide(self, a: float, b: float) -> dict:
        """Divide two numbers (raises on zero: an environment bug).

        Args:
            a (float): Dividend.
            b (float): Divisor.
        """
        return {"success": True, "data": a / b}

    def spin(self) -> dict:
        """Loop forever."""
        while True:
            pass

    def stubborn_spin(self) -> dict:
        """Loop forever, swallowing the first exception that tries to stop it."""
        try:
            while True:
                pass
        except:  # noqa: E722
            pass
        while True:
            pass

    def nap(self, seconds: float = 1000.0) -> dict:
        """Sleep (forever, by default).

        Args:
            seconds (float): How long.
        """
        time.sleep(seconds)
        return {"success": True}

    def slow_add(self, item_id: str, amount: int = 1, seconds: float = 0.1) -> dict:
        """Add to an item's count, then take a while to answer.

        Args:
            item_id (str): Id of the item.
            amount (int): How much to add.
            seconds (float): How long to take.
        """
        self.items[item_id]["count"] += amount
        self.log.append(f"add {item_id} {amount}")
        time.sleep(seconds)
        return {"success": True, "data": self.items[item_id]}

    def endless(self) -> dict:
        """Loop forever, swallowing every exception that tries to stop it."""
        while True:
            try:
                spins = 0
                while True:
                    spins += 1
            except:  # noqa: E722
                pass

    def tag_set(self, tag: str) -> dict:
        """Store a value JSON cannot hold (a set) in the state.

        Args:
            tag (str): A tag.
        """
        self.tags = {tag, "fixed"}
        return {"success": True, "data": sorted(self.tags)}

    def _secret(self) -> dict:
        return {"success": True, "data": "hidden"}
'''

CHECK_A_IS_3 = {"check_item": "a counts 3", "check_func": "def check_func(final_state):\n    return final_state['items']['a']['count'] == 3"}
CHECK_NAME_KEPT = {
    "check_item": "a keeps its name",
    "check_func": "def check_func(final_state):\n    return final_state['items']['a']['name'] == initial_state['items']['a']['name']",
}
CHECK_ONE_ITEM = {"check_item": "still one item", "check_func": "def check_func(final_state):\n    return len(final_state['items']) == 1"}


def counter_spec(**overrides: Any) -> dict[str, Any]:
    spec = {
        "env_id": "counter",
        "env_class_name": "Counter",
        "env_class_code": COUNTER_CODE,
        "environment_summary": "Counts things.",
        "environment_introduction": "A counter of named items.",
    }
    spec.update(overrides)
    return spec


def counter_scenario(**overrides: Any) -> dict[str, Any]:
    scenario = {
        "task_id": "counter_001",
        "env_id": "counter",
        "env_class_name": "Counter",
        "init_config": {"items": {"a": {"name": "A", "count": 0}}},
        "task": "Add 3 to item a.",
        "checklist_with_func": [CHECK_A_IS_3, CHECK_NAME_KEPT, CHECK_ONE_ITEM],
        "reference_solution": [
            {"name": "get_item", "arguments": {"item_id": "a"}},
            {"name": "add", "arguments": {"item_id": "a", "amount": 2}},
            {"name": "add", "arguments": {"item_id": "a"}},
        ],
    }
    scenario.update(copy.deepcopy(overrides))
    return scenario


def second_scenario() -> dict[str, Any]:
    return counter_scenario(
        task_id="counter_002",
        init_config={"items": {"a": {"name": "A", "count": 1}, "b": {"name": "B", "count": 7}}},
        task="Rename b to Bee and add 2 to a.",
        checklist_with_func=[
            {"check_item": "b renamed", "check_func": "def check_func(final_state):\n    return final_state['items']['b']['name'] == 'Bee'"},
            CHECK_A_IS_3,
            {"check_item": "b count kept", "check_func": "def check_func(final_state):\n    return final_state['items']['b']['count'] == 7"},
        ],
        reference_solution=[
            {"name": "get_item", "arguments": {"item_id": "b"}},
            {"name": "rename", "arguments": {"item_id": "b", "name": "Bee"}},
            {"name": "add", "arguments": {"item_id": "a", "amount": 2}},
        ],
    )


def write_bundle(root: Path, spec: dict[str, Any], scenarios: list[dict[str, Any]]) -> Path:
    """Write a bundle folder as raw JSON (so tests can also write broken ones)."""
    directory = root / spec.get("env_id", "broken")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "env.json").write_text(json.dumps(spec, indent=2))
    (directory / "scenarios.jsonl").write_text("".join(json.dumps(s) + "\n" for s in scenarios))
    return directory


def counter_bundle(root: Path) -> Path:
    """The counter environment with two good scenarios."""
    return write_bundle(root, counter_spec(), [counter_scenario(), second_scenario()])


TAGGER_CODE = '''
import time


class Tagger:
    def __init__(self, init_config: dict):
        self.tags = []

    def keep(self, tags: list, seconds: float = 0.0) -> dict:
        """Keep a list of tags as the state, marking it seen (in the argument itself).

        Args:
            tags (list): The tags.
            seconds (float): How long to take.
        """
        tags.append("seen")
        self.tags = tags
        time.sleep(seconds)
        return {"success": True, "data": len(self.tags)}

    def more(self, tag: str) -> dict:
        """Add a tag to the list kept.

        Args:
            tag (str): The tag.
        """
        self.tags.append(tag)
        return {"success": True, "data": len(self.tags)}
'''

CHECK_TAGS = {"check_item": "tags a, seen, b", "check_func": "def check_func(final_state):\n    return final_state['tags'] == ['a', 'seen', 'b']"}


def tagger_bundle(root: Path) -> Path:
    """An environment whose tools keep and change a list argument: arguments must reach it as copies."""
    spec = {"env_id": "tagger", "env_class_name": "Tagger", "env_class_code": TAGGER_CODE, "environment_introduction": "Tags."}
    scenario = {"task_id": "tagger_001", "env_id": "tagger", "init_config": {}, "task": "Tag a, then b.",
                "checklist_with_func": [CHECK_TAGS],
                "reference_solution": [{"name": "keep", "arguments": {"tags": ["a"]}}, {"name": "more", "arguments": {"tag": "b"}}]}
    return write_bundle(root, spec, [scenario])
