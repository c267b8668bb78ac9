"""The farm's health probes count a server's own time (``servers.farm.health``): a server that a busy
machine keeps waiting for a CPU is slow, not hung, and is not restarted; a stopped one is, in the same
farm, under the same probes.

The busy machine is real: the server is moved to a control group with the least CPU weight and pinned
to one CPU with seven looping processes, so that it gets a few milliseconds every few seconds.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from envscaler.own_time import process_reading, waited_since
from tests.support.crowding import starvation_problem, starved
from tests.support.farm import counter_farm, read_state
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(starvation_problem() is not None, reason=str(starvation_problem()))]

PROBE_PERIOD_S = 0.5
PROBE_TIMEOUT_S = 0.5
STARVED_S = 6.0


def test_a_server_kept_waiting_for_a_cpu_is_not_restarted_and_a_stopped_one_is(tmp_path):
    flags = ["--probe-period", str(PROBE_PERIOD_S), "--probe-timeout", str(PROBE_TIMEOUT_S)]
    with counter_farm(tmp_path, *flags) as catalog_json:
        catalog = tmp_path / "farm.json"
        env_id = next(iter(catalog_json["envs"]))
        server = read_state(catalog)["envs"][env_id]["pid"]
        before = process_reading(server)
        with starved(server):
            time.sleep(STARVED_S)
        # Its last wait is counted once it runs again.
        wait_until(lambda: waited_since(before, process_reading(server)) > STARVED_S / 2, 10, "the starved server's waits counted")
        # About 12 probes came while it waited for a CPU most of the time: counting the clock, 3 missed in a row restart it.
        time.sleep(2 * PROBE_PERIOD_S + PROBE_TIMEOUT_S)
        record = read_state(catalog)["envs"][env_id]
        assert (record["status"], record["restarts"], record["pid"]) == ("healthy", 0, server), record

        os.kill(server, signal.SIGSTOP)  # alive, but answers nothing
        wait_until(lambda: read_state(catalog)["envs"][env_id]["restarts"] == 1, 10 * (PROBE_PERIOD_S + PROBE_TIMEOUT_S) + 10,
                   "the restart of the stopped server")
        assert read_state(catalog)["envs"][env_id]["last_exit"] == "hung: no answer to 3 health probes in a row"
