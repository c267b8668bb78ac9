"""Hostile environment code: contained by the process backend's sandbox and under ``catalog check``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from envscaler.sandbox import sandbox_problem, sandboxed
from tests.support.bundles import COUNTER_CODE, counter_bundle, counter_scenario, counter_spec, write_bundle
from tests.support.cli import envscaler
from tests.support.server import serve

needs_sandbox = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")

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

    def get_item('''

HOSTILE_CODE = COUNTER_CODE.replace("\n    def get_item(", HOSTILE_TOOLS, 1)


def hostile_bundle(root: Path) -> Path:
    spec = counter_spec(env_id="hostile", env_class_code=HOSTILE_CODE)
    return write_bundle(root, spec, [counter_scenario(env_id="hostile", task_id="hostile_001")])


def call(http: httpx.Client, mcp_url: str, name: str, arguments: dict) -> dict:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
    reply = http.post(mcp_url, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["result"]


@needs_sandbox
def test_the_sandbox_refuses_new_processes_the_network_and_the_host_files(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    probe = (
        "import os, socket\n"
        "def attempt(f):\n"
        "    try:\n"
        "        f()\n"
        "        return 'allowed'\n"
        "    except OSError as e:\n"
        "        return type(e).__name__\n"
        f"print(attempt(os.fork), attempt(lambda: open({str(secret)!r}).read()),"
        " attempt(lambda: socket.create_connection(('127.0.0.1', 22), 1)), attempt(lambda: open('/usr/x', 'w')),"
        " attempt(lambda: open('/tmp/x', 'w').write('x')))\n"
    )
    with sandboxed([sys.executable, "-c", probe], readable=[]) as (argv, fds):
        done = subprocess.run(argv, pass_fds=fds, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["PermissionError", "FileNotFoundError", "ConnectionRefusedError", "OSError", "allowed"], done.stderr


@needs_sandbox
def test_hostile_tools_fail_and_are_reported_while_other_environments_keep_answering(tmp_path):
    victim = counter_bundle(tmp_path / "victim")
    hostile = hostile_bundle(tmp_path / "hostile")
    catalog = tmp_path / "farm" / "farm.json"
    catalog.parent.mkdir()
    up = envscaler("farm", "up", str(victim), str(hostile), "--backend", "process", "--catalog", str(catalog))
    assert up.returncode == 0, up.stderr
    assert "without a sandbox" not in up.stderr
    try:
        farm = json.loads(catalog.read_text())
        gateway_port = int(farm["gateway"].rsplit(":", 1)[1])
        outside = tmp_path / "outside.txt"
        with httpx.Client(timeout=60) as http:
            def episode(env_id: str, scenario_id: str) -> tuple[str, str]:
                endpoint = farm["envs"][env_id]
                created = http.post(f"{endpoint['url']}/episodes", json={"scenario_id": scenario_id},
                                    headers={"Authorization": f"Bearer {endpoint['token']}"}).json()
                return created["mcp_url"], f"{endpoint['url']}/episodes/{created['episode_id']}"

            victim_mcp, _ = episode("counter", "counter_001")
            attacks = {
                ("read", json.dumps({"path": str(catalog)})): "No such file",
                ("read", json.dumps({"path": str(victim / "env.json")})): "No such file",
                ("connect", json.dumps({"port": gateway_port})): "Connection refused",
                ("write", json.dumps({"path": str(hostile / "env.json")})): "Read-only file system",
                ("fork_bomb", "{}"): "may not start processes",
                ("ignore_alarm", "{}"): "may not change signal handling",
                ("linger", "{}"): "may not start threads",
            }
            for (tool, arguments), expected in attacks.items():
                hostile_mcp, hostile_control = episode("hostile", "hostile_001")
                started = time.monotonic()
                result = call(http, hostile_mcp, tool, json.loads(arguments))
                assert result["isError"] and expected in result["content"][0]["text"], (tool, result)
                assert time.monotonic() - started < 5, tool
                trajectory = http.get(f"{hostile_control}/trajectory",
                                      headers={"Authorization": f"Bearer {farm['envs']['hostile']['token']}"}).json()
                assert trajectory["env_errors"] == 1, (tool, trajectory)
                answer = call(http, victim_mcp, "get_item", {"item_id": "a"})
                assert not answer["isError"] and '"count"' in answer["content"][0]["text"]
            hostile_mcp, _ = episode("hostile", "hostile_001")
            assert "mine" in call(http, hostile_mcp, "scratch", {})["content"][0]["text"]
            # A host path under /tmp lands in the sandbox's private /tmp, never on the host.
            call(http, hostile_mcp, "write", {"path": str(outside)})
            assert not outside.exists()
        status = envscaler("farm", "status", "--catalog", str(catalog))
        assert "2/2 healthy, 0 restart(s)" in status.stdout, status.stdout
        log = (catalog.parent / "farm.json.farm" / "logs" / "hostile.log").read_text()
        assert "may not start processes" in log and '"tool": "fork_bomb"' in log
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))


@needs_sandbox
def test_catalog_check_runs_checks_and_reference_calls_in_the_sandbox(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    marker = tmp_path / "bundles" / "hostile" / "marker.txt"  # in the bundle: visible, read-only
    writes = {"check_item": "writes", "check_func": f"def check_func(final_state):\n    open({str(marker)!r}, 'w').write('x')\n    return True"}
    reads = counter_scenario(env_id="hostile", task_id="hostile_001",
                             reference_solution=[{"name": "read", "arguments": {"path": str(secret)}}, *counter_scenario()["reference_solution"]])
    checks = counter_scenario(env_id="hostile", task_id="hostile_002", checklist_with_func=[*counter_scenario()["checklist_with_func"], writes])
    bundle = write_bundle(tmp_path / "bundles", counter_spec(env_id="hostile", env_class_code=HOSTILE_CODE), [reads, checks])
    done = envscaler("catalog", "check", str(bundle))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "hostile_001: reference_runs: call 1 (read)" in done.stdout and "No such file" in done.stdout, done.stdout
    assert "hostile_002: checks_pass_on_reference" in done.stdout and "Read-only file system" in done.stdout, done.stdout
    assert not marker.exists()


def test_serve_without_the_sandbox_says_what_is_unprotected(tmp_path):
    log = tmp_path / "serve.log"
    with log.open("w") as errors, serve(counter_bundle(tmp_path), "--no-sandbox", log=errors) as server:
        assert httpx.get(server.url + "/healthz").status_code == 200
    warning = log.read_text()
    assert "without a sandbox" in warning and "catalog" in warning and "--no-sandbox" in warning
