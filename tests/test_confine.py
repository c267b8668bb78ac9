"""A forked child that confines itself (``envscaler.confine``) holds what bubblewrap's sandbox holds.

Each test forks this process, confines the child with the plan and seccomp program the workers get,
and has the confined child report what it sees, as JSON through a pipe.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from envscaler.confine import MONITOR_NAME, confine, confine_problem, run_confined
from envscaler.sandbox import CONFINED_UID_BASE, sandbox_plan
from envscaler.seccomp import seccomp_bpf

needs_confinement = pytest.mark.skipif(confine_problem() is not None, reason=f"no confinement here: {confine_problem()}")


def confined(probe: Callable[[], dict[str, Any]], readable: tuple[Path, ...] = ()) -> tuple[dict[str, Any], int]:
    """What ``probe`` returns in a child confined with ``readable`` shown, and the monitor's exit status."""
    status, said = run_confined(sandbox_plan(readable=readable), seccomp_bpf(), lambda: json.dumps(probe()))
    return (json.loads(said) if status == 0 else {"error": said}), status


def attempt(action: Callable[[], object]) -> str:
    try:
        action()
    except OSError as e:
        return e.strerror or type(e).__name__
    return "allowed"


@needs_confinement
def test_a_confined_child_sees_only_python_its_paths_and_a_private_tmp(tmp_path):
    shown = tmp_path / "bundle"
    shown.mkdir()
    (shown / "data.json").write_text("{}")
    (tmp_path / "secret.txt").write_text("token")

    def probe() -> dict[str, Any]:
        Path("/tmp/mine").write_text("x")
        return {
            "pid": os.getpid(), "uid": os.getuid(), "processes": sorted(p for p in os.listdir("/proc") if p.isdigit()),
            "shown": sorted(os.listdir(shown)), "secret": attempt(lambda: (tmp_path / "secret.txt").read_text()),
            "write shown": attempt(lambda: (shown / "x").write_text("x")), "write usr": attempt(lambda: open("/usr/x", "w")),
            "etc": sorted(os.listdir("/etc")), "tmp": sorted(os.listdir("/tmp")),
        }

    seen, status = confined(probe, readable=(shown,))
    assert status == 0, seen
    # The first process of its own PID namespace, alone there; never root.
    assert seen["pid"] == 1 and seen["processes"] == ["1"], seen
    assert seen["uid"] != 0 and (os.geteuid() != 0 or seen["uid"] >= CONFINED_UID_BASE), seen
    assert seen["shown"] == ["data.json"] and seen["write shown"] == "Read-only file system", seen
    assert seen["secret"] == "No such file or directory" and seen["write usr"] == "Read-only file system", seen
    assert seen["etc"] == [name for name in ("ld.so.cache", "localtime") if Path("/etc", name).exists()], seen
    # Its /tmp is its own: what it wrote there is not on the host.
    assert "mine" in seen["tmp"] and not Path("/tmp/mine").exists()


@needs_confinement
def test_a_confined_child_has_no_capability_no_process_and_only_its_own_loopback():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def probe() -> dict[str, Any]:
        lines = Path("/proc/self/status").read_text().splitlines()
        status = {line.split(":")[0]: line.split(":")[1].strip() for line in lines if line.startswith(("Cap", "NoNewPrivs", "Seccomp"))}
        inside = socket.create_server(("127.0.0.1", 0))
        return {
            "status": status, "fork": attempt(os.fork),
            "host port": attempt(lambda: socket.create_connection(("127.0.0.1", port), timeout=2)),
            "own loopback": attempt(lambda: socket.create_connection(inside.getsockname(), timeout=2)),
            "thread": attempt(lambda: threading.Thread(target=lambda: None).start()),
        }

    with listener:
        seen, status = confined(probe)
    assert status == 0, seen
    assert all(seen["status"][name] == "0000000000000000" for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")), seen
    assert seen["status"]["NoNewPrivs"] == "1" and seen["status"]["Seccomp"] == "2", seen
    assert seen["fork"] == "Operation not permitted" and seen["thread"] == "allowed", seen
    # The host's loopback is another network's: nothing listens there; its own answers.
    assert seen["host port"] == "Connection refused" and seen["own loopback"] == "allowed", seen


@needs_confinement
def test_the_monitor_is_named_and_exits_as_the_confined_child_did():
    plan, program = sandbox_plan(readable=()), seccomp_bpf()
    hold, release = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(release)
            confine(plan, program)
            os.read(hold, 1)  # until the test has seen the monitor
        finally:
            os._exit(7)
    os.close(hold)
    try:
        # It names itself once it has forked the confined child.
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}/comm").read_text().strip() != MONITOR_NAME:
            assert time.monotonic() < deadline, Path(f"/proc/{pid}/comm").read_text()
            time.sleep(0.01)
    finally:
        os.close(release)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7


def test_the_switch_turns_confinement_off(monkeypatch):
    monkeypatch.setenv("ENVSCALER_SANDBOX", "off")
    confine_problem.cache_clear()
    try:
        assert confine_problem() == "ENVSCALER_SANDBOX=off turned it off"
    finally:
        monkeypatch.undo()
        confine_problem.cache_clear()
