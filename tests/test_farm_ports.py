"""The farm daemon holds its servers' listening sockets: a port taken after planning, or while a server
restarts, never fails the farm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.bundles import counter_bundle
from tests.support.farm import farm_with_its_port_taken, read_state
from tests.support.waiting import wait_until


def test_a_port_taken_between_planning_and_binding_is_replaced_and_restarts_keep_the_held_one(tmp_path: Path):
    with farm_with_its_port_taken(tmp_path, counter_bundle(tmp_path / "bundles"), "process") as (catalog, planned, thief):
        endpoint = json.loads(catalog.read_text())["envs"]["counter"]
        port = httpx.URL(endpoint["url"]).port
        assert port != planned
        assert read_state(catalog)["envs"]["counter"]["url"] == endpoint["url"]
        info = httpx.get(endpoint["url"] + "/info", headers={"Authorization": f"Bearer {endpoint['token']}"})
        assert info.status_code == 200

        # A restart serves the socket the daemon holds: same port, though the thief would like it.
        first = read_state(catalog)["envs"]["counter"]["pid"]
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: read_state(catalog)["envs"]["counter"]["restarts"] == 1
                   and read_state(catalog)["envs"]["counter"]["status"] == "healthy")
        assert httpx.get(endpoint["url"] + "/healthz").status_code == 200
        assert json.loads(catalog.read_text())["envs"]["counter"]["url"] == endpoint["url"]
        assert thief.getsockname()[1] == planned


def test_serve_refuses_a_descriptor_that_is_not_a_listening_socket(tmp_path: Path):
    read_end, write_end = os.pipe()
    try:
        served = subprocess.run([sys.executable, "-m", "servers.cli", str(counter_bundle(tmp_path / "bundles")), "--no-sandbox",
                                 "--listen-fd", str(read_end)], capture_output=True, text=True, pass_fds=(read_end,), timeout=60)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert served.returncode == 2
    assert served.stderr.strip().splitlines() == [f"error: serve: --listen-fd {read_end}: not a listening TCP socket "
                                                  "(pass one this process inherits, or use --port)"]
