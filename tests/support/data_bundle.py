"""A bundle whose scenarios name a data file (``envscaler.data_files``): users kept in ``data/users.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.bundles import write_bundle

DIRECTORY_CODE = '''
class Directory:
    def __init__(self, init_config: dict):
        self.users = {}
        # Reads the data through its view: what a constructor touches is copied, never the shared file.
        self.user_count = len(init_config.get("users", {}))
        self.notes = []

    def get_user(self, user_id: str) -> dict:
        """Read one user.

        Args:
            user_id (str): The user's id.
        """
        if user_id not in self.users:
            return {"success": False, "error": f"no user {user_id}"}
        return {"success": True, "data": self.users[user_id]}

    def set_email(self, user_id: str, email: str) -> dict:
        """Change a user's email.

        Args:
            user_id (str): The user's id.
            email (str): The new email.
        """
        if user_id not in self.users:
            return {"success": False, "error": f"no user {user_id}"}
        self.users[user_id]["email"] = email
        return {"success": True, "data": self.users[user_id]}
'''

CHECK_EMAIL_CHANGED = {
    "check_item": "user_1's email is new, and it was the one in the data file at the start",
    "check_func": "def check_func(final_state):\n"
                  "    return (initial_state['users']['user_1']['email'] == 'user1@example.com'\n"
                  "            and final_state['users']['user_1']['email'] == 'new@example.com')",
}


def users(count: int, padding: int = 0) -> dict[str, Any]:
    """``count`` users, each with ``padding`` characters of notes (to make a file of a given size)."""
    return {f"user_{n}": {"name": f"User {n}", "email": f"user{n}@example.com", "notes": "x" * padding} for n in range(count)}


def directory_bundle(root: Path, count: int = 5, padding: int = 0, env_id: str = "directory") -> Path:
    """The directory environment with two scenarios that name the same data file, and its file."""
    spec = {"env_id": env_id, "env_class_name": "Directory", "env_class_code": DIRECTORY_CODE,
            "environment_introduction": "A directory of users."}
    scenarios = [
        {"task_id": f"{env_id}_email", "env_id": env_id, "task": "Change user_1's email to new@example.com.",
         "init_config": {"users": {"$file": "data/users.json"}, "notes": ["email task"]},
         "checklist_with_func": [CHECK_EMAIL_CHANGED],
         "reference_solution": [{"name": "set_email", "arguments": {"user_id": "user_1", "email": "new@example.com"}}]},
        {"task_id": f"{env_id}_other", "env_id": env_id, "task": "Change user_1's email to new@example.com, too.",
         "init_config": {"users": {"$file": "data/users.json"}, "notes": ["other task"]},
         "checklist_with_func": [CHECK_EMAIL_CHANGED],
         "reference_solution": [{"name": "set_email", "arguments": {"user_id": "user_1", "email": "new@example.com"}}]},
    ]
    directory = write_bundle(root, spec, scenarios)
    (directory / "data").mkdir(exist_ok=True)
    (directory / "data" / "users.json").write_text(json.dumps(users(count, padding)))
    return directory
