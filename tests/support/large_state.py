"""A retail-like environment whose state size is a parameter: benchmark-sized state, made locally.

Real benchmark environments hold about 1.3 MB of state per scenario (users, orders, products);
the catalog's hold about 10 KB. The constructor builds the state from a seed and a user count, so
the bundle stays small on disk while each episode's state is as large as asked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.bundles import write_bundle

SHOP_CODE = '''
import random


class Shop:
    def __init__(self, init_config: dict):
        rng = random.Random(init_config.get("seed", 0))
        count = init_config.get("user_count", 10)
        self.products = {
            f"p{n}": {"name": f"product {n}", "price": round(rng.uniform(1, 500), 2), "stock": rng.randint(0, 50),
                      "options": {"color": rng.choice(["red", "blue", "green"]), "size": rng.choice(["S", "M", "L"])}}
            for n in range(max(count // 4, 1))
        }
        self.users = {}
        for n in range(count):
            user_id = f"user_{n}"
            orders = []
            for k in range(3):
                items = [{"product_id": f"p{rng.randrange(len(self.products))}", "quantity": rng.randint(1, 3),
                          "note": "x" * rng.randint(10, 60)} for _ in range(3)]
                orders.append({"order_id": f"#{n}-{k}", "status": "pending", "items": items,
                               "total": round(rng.uniform(5, 900), 2)})
            self.users[user_id] = {
                "name": f"User {n}",
                "email": f"user{n}@example.com",
                "address": {"street": f"{rng.randint(1, 999)} Main St", "city": "Springfield", "zip": f"{rng.randint(10000, 99999)}"},
                "orders": orders,
            }
        self.log = []

    def find_user(self, email: str) -> str:
        """Find a user's id by email.

        Args:
            email (str): The user's email address.
        """
        for user_id, user in self.users.items():
            if user["email"] == email:
                return user_id
        return "Error: user not found"

    def get_order(self, user_id: str, order_id: str) -> dict:
        """Read one order of a user.

        Args:
            user_id (str): The user's id.
            order_id (str): The order's id, such as "#3-1".
        """
        user = self.users.get(user_id)
        if user is None:
            return {"success": False, "error": "no such user"}
        for order in user["orders"]:
            if order["order_id"] == order_id:
                return {"success": True, "data": order}
        return {"success": False, "error": "no such order"}

    def ping(self) -> str:
        """Answer pong; changes nothing."""
        return "pong"

    def set_city(self, user_id: str, city: str) -> dict:
        """Move a user to another city.

        Args:
            user_id (str): The user's id.
            city (str): The new city.
        """
        user = self.users.get(user_id)
        if user is None:
            return {"success": False, "error": "no such user"}
        user["address"]["city"] = city
        self.log.append(f"moved {user_id}")
        return {"success": True}

    def cancel_order(self, user_id: str, order_id: str, seconds: float = 0.0) -> str:
        """Cancel a pending order; optionally work slowly first.

        Args:
            user_id (str): The user's id.
            order_id (str): The order to cancel.
            seconds (float): How long to work before finishing.
        """
        import time
        for order in self.users[user_id]["orders"]:
            if order["order_id"] == order_id:
                order["status"] = "cancelled"
                order["items"].append({"product_id": "refund", "quantity": 1, "note": ""})
                self.users[user_id]["orders"].sort(key=lambda o: o["status"])
                time.sleep(seconds)
                self.log.append(f"cancelled {order_id}")
                return "Cancelled " + order_id
        return "Error: no such order"
'''

CHECK_CITY = {
    "check_item": "user_1 lives in Oslo",
    "check_func": "def check_func(final_state):\n    return final_state['users']['user_1']['address']['city'] == 'Oslo'",
}
CHECK_OTHERS_KEPT = {
    "check_item": "no other user moved",
    "check_func": (
        "def check_func(final_state):\n"
        "    moved = [u for u, d in final_state['users'].items() if d['address'] != initial_state['users'][u]['address']]\n"
        "    return moved == ['user_1']"
    ),
}
CHECK_ORDERS_KEPT = {
    "check_item": "orders untouched",
    "check_func": (
        "def check_func(final_state):\n"
        "    return all(o['status'] == 'pending' for u in final_state['users'].values() for o in u['orders'])"
    ),
}


def shop_spec(env_id: str = "shop") -> dict[str, Any]:
    return {
        "env_id": env_id,
        "env_class_name": "Shop",
        "env_class_code": SHOP_CODE,
        "environment_summary": "A shop with users, orders and products.",
        "environment_introduction": "You help the customers of a shop.",
        "tool_errors": {"success_false": True, "text_prefixes": ["Error:"]},
    }


def shop_scenario(users: int, task_id: str = "move_1") -> dict[str, Any]:
    return {
        "task_id": task_id,
        "env_id": "shop",
        "env_class_name": "Shop",
        "init_config": {"seed": 7, "user_count": users},
        "task": "Move the user with email user1@example.com to Oslo.",
        "checklist_with_func": [CHECK_CITY, CHECK_OTHERS_KEPT, CHECK_ORDERS_KEPT],
        "reference_solution": [
            {"name": "find_user", "arguments": {"email": "user1@example.com"}},
            {"name": "set_city", "arguments": {"user_id": "user_1", "city": "Oslo"}},
        ],
    }


def users_for(state_bytes: int) -> int:
    """About how many users make a state of ``state_bytes`` bytes of JSON (~1 KB per user)."""
    return max(state_bytes // 1060, 2)


def shop_bundle(root: Path, state_bytes: int, env_id: str = "shop") -> Path:
    """A shop bundle whose one scenario holds about ``state_bytes`` of state."""
    spec = shop_spec(env_id)
    scenario = {**shop_scenario(users_for(state_bytes)), "env_id": env_id}
    return write_bundle(root, spec, [scenario])


def state_size(state: dict[str, Any]) -> int:
    """Bytes of the state as compact JSON."""
    return len(json.dumps(state, separators=(",", ":")))
