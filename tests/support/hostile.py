"""Hostile environment tools, and the attacks a test runs with them against a farm."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests.support.bundles import COUNTER_CODE, counter_scenario, counter_spec, write_bundle

HOSTILE_TOOLS = '''
    def read(self, path: str) -> dict:
        """Read a file.

        Args:
            path (str): Where.
        """
        with open(path) as file:
            return {"success": True, "data": file.read()[:100]}

    def connect(self, port: int) -> dict:
        """Connect to a local port.

        Args:
            port (int): Which.
        """
        import socket
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return {"success": True}

    def write(self, path: str) -> dict:
        """Write a file.

        Args:
            path (str): Where.
        """
        with open(path, "w") as file:
            file.write("pwned")
        return {"success": True}

    def scratch(self) -> dict:
        """Write and read back a file in the private /tmp."""
        with open("/tmp/scratch", "w") as file:
            file.write("mine")
        with open("/tmp/scratch") as file:
            return {"success": True, "data": file.read()}

    def fork_bomb(self) -> dict:
        """Fork forever."""
        import os
        while True:
            os.fork()

    def ignore_alarm(self) -> dict:
        """Ignore the time limit's signal, then loop."""
        import signal
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True:
            pass

    def linger(self) -> dict:
        """Start a thread that runs on after the call."""
        import threading
        threading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()
        return {"success": True}

    def tamper(self) -> dict:
        """Change what every episode of this environment shares."""
        type(self).tampered = True
        return {"success": True}

    def get_item('''

# Attacks that get past the in-process guard (with the originals it keeps of what it refuses) or
# that no guard in the process can stop: the worker process and the check worker are the wall.
WALL_TOOLS = '''
    def bypass_alarm(self) -> dict:
        """Ignore the time limit's signal (with the original that the guard's refusal holds), then loop."""
        import _signal
        original = [c.cell_contents for c in _signal.signal.__closure__ if callable(c.cell_contents)][0]
        original(_signal.SIGALRM, _signal.SIG_IGN)
        while True:
            pass

    def stop_timer(self) -> dict:
        """Stop the time limit's timer (with the original the guard's refusal holds), then loop."""
        import _signal
        original = [c.cell_contents for c in _signal.setitimer.__closure__ if callable(c.cell_contents)][0]
        original(_signal.ITIMER_REAL, 0)
        while True:
            pass

    def slow_switch(self) -> dict:
        """Make the interpreter switch threads once in 1,000 s (past the guard), then loop."""
        import sys
        original = [c.cell_contents for c in sys.setswitchinterval.__closure__ if callable(c.cell_contents)][0]
        original(1000)
        while True:
            pass

    def c_loop(self) -> dict:
        """Hold the GIL in one C call far longer than any limit."""
        import itertools
        return {"success": True, "data": sum(itertools.repeat(1, 10**12))}

    def backtrack(self, text: str) -> dict:
        """Match the agent's text with a catastrophic regular expression (C code, the GIL held).

        Args:
            text (str): The text.
        """
        import re
        return {"success": True, "data": bool(re.match(r"(a+)+$", text))}

    def slow_result(self) -> dict:
        """Return an object whose text takes forever (the result's JSON runs its __repr__)."""
        class Slow:
            __slots__ = ()

            def __repr__(self):
                while True:
                    pass
        return {"success": True, "data": Slow()}

    def slow_state(self) -> dict:
        """Keep an object whose text takes forever in the state (the state's JSON, after the call, runs it)."""
        class Slow:
            __slots__ = ()

            def __repr__(self):
                while True:
                    pass
        self.slow = Slow()
        return {"success": True}

    def exit_now(self) -> dict:
        """Raise SystemExit."""
        raise SystemExit(0)

    def interrupt(self) -> dict:
        """Raise KeyboardInterrupt."""
        raise KeyboardInterrupt

    def exit_in_state(self) -> dict:
        """Keep an object in the state whose text raises SystemExit (outside the call's own try)."""
        class Exiting:
            __slots__ = ()

            def __repr__(self):
                raise SystemExit(3)
        self.exiting = Exiting()
        return {"success": True}

    def deep(self) -> dict:
        """Raise the recursion limit past the guard, then return a result nested a million deep."""
        import sys
        original = [c.cell_contents for c in sys.setrecursionlimit.__closure__ if callable(c.cell_contents)][0]
        original(10**7)
        value = []
        for _ in range(10**6):
            value = [value]
        return {"success": True, "data": value}

    def linger_past(self) -> dict:
        """Start a busy thread past the guard that runs on after the call."""
        import _thread
        original = [c.cell_contents for c in _thread.start_new_thread.__closure__ if callable(c.cell_contents)][0]
        original(lambda: [None for _ in iter(int, 1)], ())
        return {"success": True}

    def double(self) -> dict:
        """Change a module global, then run past the inline budget (the call is preempted and run again)."""
        import time
        SHARED.append(1)
        time.sleep(0.1)
        return {"success": True, "data": len(SHARED)}

    def shared(self) -> dict:
        """Read the module global every episode shares."""
        return {"success": True, "data": len(SHARED)}

    def echo(self, text: str) -> dict:
        """Answer the agent's text.

        Args:
            text (str): The text.
        """
        return {"success": True, "data": text}

    def huge(self) -> str:
        """Return 100 MB of text."""
        return "x" * 100_000_000

    def harvest(self) -> dict:
        """What environment code finds in its process: every id-like token (20 or more URL-safe characters)
        of every string the garbage collector reaches, directly or in the containers it reaches, and the
        names of the episodes held here."""
        import gc
        import re
        strings, seen = set(), set()
        gc.unfreeze()  # what the spawner froze before it forked this worker (its imports) is walked too
        found = gc.get_objects()
        for holder in found:
            for value in gc.get_referents(holder):
                if isinstance(value, str):
                    strings.add(value)
                elif isinstance(value, (bytes, bytearray)):
                    strings.add(bytes(value).decode("latin-1"))
                elif isinstance(value, (dict, list, tuple, set, frozenset)) and id(value) not in seen:
                    seen.add(id(value))
                    items = (*value, *value.values()) if isinstance(value, dict) else value
                    strings.update(item for item in items if isinstance(item, str))
        tokens = {token for text in strings for token in re.findall(r"[A-Za-z0-9_.-]{20,}", text)}
        names = {o.episode_id for o in found if type(o).__name__ == "LiveEpisode"}
        return {"success": True, "data": {"tokens": sorted(tokens), "names": sorted(names)}}

    def get_item('''

HOSTILE_CODE = COUNTER_CODE.replace("\n    def get_item(", HOSTILE_TOOLS, 1)
WALL_CODE = "SHARED = []\n" + COUNTER_CODE.replace("\n    def get_item(", WALL_TOOLS, 1)


def wall_bundle(root: Path, env_id: str = "wall", scenarios: list[dict] | None = None) -> Path:
    """The counter environment with the tools that only the worker process stops, as env ``env_id``."""
    spec = counter_spec(env_id=env_id, env_class_code=WALL_CODE)
    return write_bundle(root, spec, scenarios or [counter_scenario(env_id=env_id, task_id=f"{env_id}_001")])


def hostile_bundle(root: Path) -> Path:
    """The counter environment with the hostile tools, as env ``hostile``."""
    spec = counter_spec(env_id="hostile", env_class_code=HOSTILE_CODE)
    return write_bundle(root, spec, [counter_scenario(env_id="hostile", task_id="hostile_001")])


def call(http: httpx.Client, mcp_url: str, name: str, arguments: dict) -> dict:
    """One tools/call on an episode's MCP URL: its result."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
    reply = http.post(mcp_url, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["result"]




def attack(catalog: Path, hostile: str, victim: str, expected: dict[tuple[str, str], str]) -> None:
    """Call each hostile tool (name, JSON arguments) on a fresh episode of env ``hostile`` of the farm
    whose catalog is ``catalog``: each must fail at once with its expected text, counted as an
    environment error, while an episode of env ``victim`` keeps answering."""
    farm = json.loads(catalog.read_text())

    def episode(http: httpx.Client, env_id: str) -> tuple[str, str]:
        endpoint = farm["envs"][env_id]
        headers = {"Authorization": f"Bearer {endpoint['token']}"}
        scenario_id = http.get(f"{endpoint['url']}/scenarios", headers=headers).json()["scenarios"][0]["task_id"]
        created = http.post(f"{endpoint['url']}/episodes", json={"scenario_id": scenario_id}, headers=headers).json()
        return created["mcp_url"], f"{endpoint['url']}/episodes/{created['episode_id']}"

    with httpx.Client(timeout=60) as http:
        victim_mcp, _ = episode(http, victim)
        for (tool, arguments), text in expected.items():
            hostile_mcp, hostile_control = episode(http, hostile)
            started = time.monotonic()
            result = call(http, hostile_mcp, tool, json.loads(arguments))
            assert result["isError"] and text in result["content"][0]["text"], (tool, result)
            assert time.monotonic() - started < 5, tool
            trajectory = http.get(f"{hostile_control}/trajectory",
                                  headers={"Authorization": f"Bearer {farm['envs'][hostile]['token']}"}).json()
            assert trajectory["env_errors"] == 1, (tool, trajectory)
            listed = http.post(victim_mcp, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
            assert listed.status_code == 200 and listed.json()["result"]["tools"], listed.text


def common_attacks(catalog: Path, victim_bundle: Path) -> dict[tuple[str, str], str]:
    """The attacks every backend refuses the same way: the catalog file and another bundle are not
    there, the gateway's port is not reachable, no process, signal handler or lingering thread, and
    no change to what every episode shares."""
    gateway_port = int(json.loads(catalog.read_text())["gateway"].rsplit(":", 1)[1])
    return {
        ("read", json.dumps({"path": str(catalog)})): "No such file",
        ("read", json.dumps({"path": str(victim_bundle / "env.json")})): "No such file",
        ("connect", json.dumps({"port": gateway_port})): "Connection refused",
        ("fork_bomb", "{}"): "may not start processes",
        ("ignore_alarm", "{}"): "may not change signal handling",
        ("linger", "{}"): "may not start threads",
        ("tamper", "{}"): "which every episode shares",
    }
