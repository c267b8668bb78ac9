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


FOLDERS_CODE = '''
class Folder:
    def __init__(self, name, parent=None):
        self.name = name
        self.parent = parent
        self.children = []


class Folders:
    def __init__(self, init_config: dict):
        self.root = Folder("/")
        for name in init_config.get("names", []):
            self.root.children.append(Folder(name, self.root))

    def mkdir(self, name: str) -> dict:
        """Make a folder under the root, linked back to it.

        Args:
            name (str): The folder's name.
        """
        self.root.children.append(Folder(name, self.root))
        return {"success": True, "data": [child.name for child in self.root.children]}

    def root_folder(self):
        """The root folder itself (a tree whose nodes link to their parents)."""
        return self.root
'''

LINKS_CODE = '''
class Links:
    def __init__(self, init_config: dict):
        self.root = {"name": "/", "children": []}

    def mkdir(self, name: str) -> dict:
        """Make a folder under the root, linked back to it.

        Args:
            name (str): The folder's name.
        """
        self.root["children"].append({"name": name, "parent": self.root})
        return {"success": True, "data": [child["name"] for child in self.root["children"]]}
'''

CHECK_TMP_UNDER_ROOT = {
    "check_item": "tmp is made under the root, and links back to it",
    "check_func": ("def check_func(final_state):\n"
                   "    names = [c['name'] for c in final_state['root']['children']]\n"
                   "    return names[-1] == 'tmp' and final_state['root']['children'][-1]['parent'] == {'$ref': '#/root'}"),
}


def folders_bundle(root: Path) -> Path:
    """An environment whose state is not a tree: every folder links back to its parent."""
    spec = {"env_id": "folders", "env_class_name": "Folders", "env_class_code": FOLDERS_CODE, "environment_introduction": "Folders."}
    scenario = {"task_id": "folders_001", "env_id": "folders", "init_config": {"names": ["home"]}, "task": "Make tmp.",
                "checklist_with_func": [CHECK_TMP_UNDER_ROOT], "reference_solution": [{"name": "mkdir", "arguments": {"name": "tmp"}}]}
    return write_bundle(root, spec, [scenario])


USERS_CODE = '''
class NotFound(LookupError):
    """No such record: the caller asked for an id that is not there."""


class Users:
    def __init__(self, init_config: dict):
        self.users = {}

    def find_user(self, user_id: str) -> dict:
        """Look a user up (raises NotFound for an unknown id, as benchmark tools do).

        Args:
            user_id (str): The user's id.
        """
        if user_id not in self.users:
            raise NotFound(f"no user {user_id}")
        return self.users[user_id]

    def rename_user(self, user_id: str, name: str) -> dict:
        """Rename a user (raises ValueError for an unknown id).

        Args:
            user_id (str): The user's id.
            name (str): The new name.
        """
        if user_id not in self.users:
            raise ValueError(f"no user {user_id}")
        self.users[user_id]["name"] = name
        return self.users[user_id]

    def tag_user(self, user_id: str, tag: str) -> dict:
        """Tag a user, checking the tag only after storing it (a bug).

        Args:
            user_id (str): The user's id.
            tag (str): The tag.
        """
        self.users[user_id]["tag"] = tag
        if tag == "bad":
            raise ValueError("a bad tag")
        return self.users[user_id]

    def broken(self) -> dict:
        """Fail with an exception the environment does not declare (an environment bug)."""
        return {}["missing"]
'''

CHECK_U1_RENAMED = {"check_item": "u1 is Ann", "check_func": "def check_func(final_state):\n    return final_state['users']['u1']['name'] == 'Ann'"}


def users_spec(**overrides: Any) -> dict[str, Any]:
    """An environment whose tools raise on bad input, declared the agent's fault."""
    spec = {"env_id": "users", "env_class_name": "Users", "env_class_code": USERS_CODE, "environment_introduction": "Users.",
            "tool_errors": {"agent_errors": ["NotFound", "ValueError"]}}
    spec.update(overrides)
    return spec


def users_scenario(reference: list[dict[str, Any]]) -> dict[str, Any]:
    return {"task_id": "users_001", "env_id": "users", "init_config": {"users": {"u1": {"name": "Al"}}}, "task": "Rename u1 to Ann.",
            "checklist_with_func": [CHECK_U1_RENAMED], "reference_solution": reference}


# Two classes side by side (EnvSpec.classes): both keep a public ``items`` and a module-level default of the other's
# name, each loads its part of the scenario with its own loader, and the counter raises on bad input.
SHELF_CODE = '''
DEFAULTS = {"books": ["Dune"], "start": 0}


class Shelf:
    def __init__(self):
        self.items = []
        self._label = "shelf"

    def _load_scenario(self, config, long_context=False):
        self.items = list(config.get("books", DEFAULTS["books"]))
        if long_context:
            self.items += ["Index of every book"]

    def add_book(self, title: str) -> dict:
        """Put a book on the shelf.

        Args:
            title (str): The book's title.
        """
        self.items.append(title)
        return {"count": len(self.items)}

    def list_books(self) -> list:
        """The books on the shelf."""
        return list(self.items)


class Tally:
    def __init__(self):
        self.items = DEFAULTS["start"]

    def _load_scenario(self, config):
        self.items = config.get("start", DEFAULTS["start"])

    def bump(self, by: int = 1) -> int:
        """Raise the tally.

        Args:
            by (int): How much to add; not negative.
        """
        if by < 0:
            raise ValueError(f"by must not be negative, got {by}")
        self.items += by
        return self.items
'''

SHELF_PARTS = [{"name": "Shelf", "class_name": "Shelf", "loader": "_load_scenario"},
               {"name": "Tally", "class_name": "Tally", "loader": "_load_scenario"}]


def shelf_spec(**overrides: Any) -> dict[str, Any]:
    """A two-class environment: a shelf of books and a tally, whose attributes share names."""
    spec = {"env_id": "shelf_tally", "env_class_name": "ShelfTally", "env_class_code": SHELF_CODE,
            "environment_introduction": "A shelf and a tally.", "classes": copy.deepcopy(SHELF_PARTS),
            "tool_errors": {"agent_errors": ["ValueError"]}}
    spec.update(overrides)
    return spec


def shelf_scenario() -> dict[str, Any]:
    """Shelve one book and raise the tally by two, from a shelf of one book and a tally at 5."""
    return {
        "task_id": "shelf_001",
        "env_id": "shelf_tally",
        "init_config": {"Shelf": {"books": ["Emma"]}, "Tally": {"start": 5}},
        "task": "Shelve 'Ulysses' and raise the tally by 2.",
        "checklist_with_func": [
            {"check_item": "Ulysses shelved", "check_func": "def check_func(final_state):\n"
             "    return final_state['Shelf']['items'] == initial_state['Shelf']['items'] + ['Ulysses']"},
            {"check_item": "tally at 7", "check_func": "def check_func(final_state):\n    return final_state['Tally']['items'] == 7"},
        ],
        "reference_solution": [{"name": "add_book", "arguments": {"title": "Ulysses"}},
                               {"name": "bump", "arguments": {"by": 2}}],
    }

STOCK_CODE = '''
class Stock:
    def __init__(self, init_config: dict):
        self.items = {}

    def count(self, item_id: str) -> dict:
        """How many of an item there are.

        Args:
            item_id (str): Id of the item.
        """
        if item_id not in self.items:
            return {"success": False, "error": f"no item {item_id}"}
        return {"success": True, "data": self.items[item_id]}

    def add(self, item_id: str, amount: int) -> dict:
        """Add to an item's count.

        Args:
            item_id (str): Id of the item.
            amount (int): How much to add.
        """
        if item_id not in self.items:
            return {"success": False, "error": f"no item {item_id}"}
        self.items[item_id] += amount
        return {"success": True, "data": self.items[item_id]}
'''

# Turn 2 changes nothing: only the tool output it read (and what the agent said) can show it was done.
CHECK_READ_B = {
    "check_item": "b was looked up, and it counts 7",
    "check_func": ("def check_func(final_state):\n"
                   "    return any(c['name'] == 'count' and c['arguments'].get('item_id') == 'b' and c['error'] is None\n"
                   "               and c['result']['data'] == 7 for c in turn_results)"),
}
CHECK_TOLD_7 = {"check_item": "the user was told 7",
                "check_func": "def check_func(final_state):\n    return any('7' in reply for reply in agent_replies)"}


def stock_turns_scenario(**overrides: Any) -> dict[str, Any]:
    """Three scripted user turns; the second changes no state and is checked on its tool output and reply."""
    scenario = {
        "task_id": "stock_turns_001",
        "env_id": "stock",
        "init_config": {"items": {"a": 0, "b": 7}},
        "turns": [
            {"message": "Add 2 to item a.",
             "checklist_with_func": [{"check_item": "a counts 2", "check_func": "def check_func(final_state):\n    return final_state['items']['a'] == 2"}],
             "reference_solution": [{"name": "add", "arguments": {"item_id": "a", "amount": 2}}],
             "reference_reply": "Item a now counts 2."},
            {"message": "How many of item b are there?",
             "checklist_with_func": [CHECK_READ_B, CHECK_TOLD_7],
             "reference_solution": [{"name": "count", "arguments": {"item_id": "b"}}],
             "reference_reply": "There are 7 of item b."},
            {"message": "Add 1 to item b.",
             "checklist_with_func": [{"check_item": "b counts 8", "check_func": "def check_func(final_state):\n    return final_state['items']['b'] == 8"}],
             "reference_solution": [{"name": "add", "arguments": {"item_id": "b", "amount": 1}}],
             "reference_reply": "Item b now counts 8."},
        ],
        "checklist_with_func": [{"check_item": "three calls in all",
                                 "check_func": "def check_func(final_state):\n    return len(turn_results) == 3"}],
    }
    scenario.update(copy.deepcopy(overrides))
    return scenario


def stock_bundle(root: Path, *scenarios: dict[str, Any]) -> Path:
    """The stock environment with the given scenarios (by default, the scripted three-turn one)."""
    spec = {"env_id": "stock", "env_class_name": "Stock", "env_class_code": STOCK_CODE, "environment_introduction": "A stock of items."}
    return write_bundle(root, spec, list(scenarios) or [stock_turns_scenario()])
