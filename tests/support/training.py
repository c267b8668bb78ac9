"""What the trainer adapters' tests share: a lamp environment on a real farm (through its gateway), a
simulated user that answers from a script, and a tiny Qwen-shaped tokenizer."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.bundles import write_bundle
from tests.support.farm import read_state
from tests.support.cli import envscaler

LAMP_CODE = '''
class Lamp:
    def __init__(self, init_config: dict):
        self.on = init_config.get("on", False)
        self.brightness = 0

    def switch(self, on: bool) -> dict:
        """Turn the lamp on or off.

        Args:
            on (bool): True to turn it on.
        """
        self.on = on
        return {"success": True, "data": {"on": self.on}}

    def dim(self, level: int) -> dict:
        """Set the brightness.

        Args:
            level (int): From 0 to 10.
        """
        self.brightness = level
        return {"success": True, "data": {"brightness": level}}
'''

LAMP_SPEC = {"env_id": "lamp", "env_class_name": "Lamp", "env_class_code": LAMP_CODE, "environment_introduction": "A desk lamp."}
LAMP_IS_ON = {"check_item": "the lamp is on", "check_func": "def check_func(final_state):\n    return final_state['on'] is True"}
LAMP_IS_DIM = {"check_item": "the lamp is at 3", "check_func": "def check_func(final_state):\n    return final_state['brightness'] == 3"}
# Calls that solve lamp_dark (the reference solution), in Hermes/Qwen form.
SOLUTION = '<tool_call>{"name": "switch", "arguments": {"on": true}}</tool_call>\n<tool_call>{"name": "dim", "arguments": {"level": 3}}</tool_call>'
PERSONA = "Ada, who never says her surname"


def lamp_scenario(task_id: str, on: bool, user_profile: str | None = None) -> dict:
    """A lamp scenario: turn it on and dim it to 3 (two checks); already on when ``on``."""
    return {
        "task_id": task_id, "env_id": "lamp", "init_config": {"on": on},
        "task": "You are Ada. Ask for the lamp on at brightness 3." if user_profile else "Turn the lamp on and set it to 3.",
        "checklist_with_func": [LAMP_IS_ON, LAMP_IS_DIM], "user_profile": user_profile,
        "reference_solution": [{"name": "switch", "arguments": {"on": True}}, {"name": "dim", "arguments": {"level": 3}}],
    }


LAMP_AT_3_SAID = {"check_item": "the user was told it is at 3",
                  "check_func": "def check_func(final_state):\n    return any('at 3' in reply for reply in agent_replies)"}


def lamp_turns_scenario() -> dict:
    """lamp_turns: two scripted user turns. The first asks for the lamp on at 3 (SOLUTION); the second asks how it
    is and changes nothing: it is checked on the agent's answer alone."""
    return {
        "task_id": "lamp_turns", "env_id": "lamp", "init_config": {"on": False},
        "turns": [
            {"message": "Turn the lamp on and set it to 3.", "checklist_with_func": [LAMP_IS_ON, LAMP_IS_DIM],
             "reference_solution": [{"name": "switch", "arguments": {"on": True}}, {"name": "dim", "arguments": {"level": 3}}],
             "reference_reply": "Done."},
            {"message": "How is the lamp now?", "checklist_with_func": [LAMP_AT_3_SAID], "reference_solution": [],
             "reference_reply": "It is on, at 3."},
        ],
    }


@contextmanager
def lamp_farm(root: Path, *more: dict) -> Iterator[Path]:
    """``farm up`` (process backend, gateway) of the lamp: lamp_dark (a do-nothing policy scores 0), lamp_lit
    (it scores 0.5: the lamp is on already) and lamp_chat (conversational), then the scenarios ``more``;
    yields the catalog; ``farm down`` after."""
    scenarios = [lamp_scenario("lamp_dark", False), lamp_scenario("lamp_lit", True), lamp_scenario("lamp_chat", False, PERSONA), *more]
    bundle = write_bundle(root / "bundles", LAMP_SPEC, scenarios)
    catalog = root / "farm.json"
    up = envscaler("farm", "up", str(bundle), "--backend", "process", "--catalog", str(catalog))
    assert up.returncode == 0, up.stderr
    try:
        yield catalog
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))


def kill_server(catalog: Path) -> None:
    """SIGKILL the lamp's server: its episodes are lost (the daemon starts a fresh server without them)."""
    os.kill(read_state(catalog)["envs"]["lamp"]["pid"], signal.SIGKILL)
