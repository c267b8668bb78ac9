"""A forked child that confines itself (``envscaler.confine``) holds what bubblewrap's sandbox holds.

Each test forks this process, confines the child with the plan and seccomp program the workers get,
and has the confined child report what it sees, as JSON through a pipe.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from envscaler.confine import HANDED_OVER_NAME, HAND_OVER_TIMEOUT_S, become_subreaper, confine, confine_problem, run_confined, taken_over
from envscaler.sandbox import CONFINED_UID_BASE, sandbox_plan
from envscaler.seccomp import seccomp_bpf
from servers.farm.backends.ray_node import node_confine_problem

needs_confinement = pytest.mark.skipif(confine_problem() is not None, reason=f"no confinement here: {confine_problem()}")


def confined(probe: Callable[[], dict[str, Any]], readable: tuple[Path, ...] = ()) -> tuple[dict[str, Any], int]:
    """What ``probe`` returns in a child confined with ``readable`` shown, and the sandbox's exit status."""
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
def test_the_sandbox_is_handed_over_to_the_parent_and_the_pid_of_its_user_stays_taken():
    # The parent (a subreaper, here a child of the test's) adopts the sandbox; the child that forked it is
    # a zombie until the parent has reaped the sandbox, so that its pid (the sandbox's uid) stays taken.
    plan, program = sandbox_plan(readable=()), seccomp_bpf()
    told, tell = os.pipe()
    parent = os.fork()
    if parent == 0:
        os.close(told)
        seen = {}
        try:
            become_subreaper()
            handed, hand_over = os.pipe()
            release, hold = os.pipe()
            child = os.fork()
            if child == 0:
                try:
                    for fd in (handed, hold, tell):
                        os.close(fd)
                    confine(plan, program, hand_over)
                    os.read(release, 1)  # until the parent has looked
                finally:
                    os._exit(7)
            os.close(hand_over)
            os.close(release)
            sandbox = taken_over(child, handed, HAND_OVER_TIMEOUT_S)
            assert sandbox is not None
            seen = {"sandbox is another process": sandbox != child, "sandbox's parent": int(stat_of(sandbox)[1]),
                    "child": [Path(f"/proc/{child}/comm").read_text().strip(), stat_of(child)[0]], "me": os.getpid()}
            os.close(hold)
            seen["sandbox's exit"] = os.waitstatus_to_exitcode(os.waitpid(sandbox, 0)[1])
            seen["child's exit"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        finally:
            os.write(tell, json.dumps(seen).encode())
            os._exit(0)
    os.close(tell)
    with os.fdopen(told, "rb") as said:
        seen = json.loads(said.read() or b"{}")
    os.waitpid(parent, 0)
    assert seen == {"sandbox is another process": True, "sandbox's parent": seen.get("me"), "child": [HANDED_OVER_NAME, "Z"],
                    "me": seen.get("me"), "sandbox's exit": 7, "child's exit": 0}, seen


def stat_of(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the name: the state, the parent's pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def test_the_switch_turns_confinement_off(monkeypatch):
    monkeypatch.setenv("ENVSCALER_SANDBOX", "off")
    confine_problem.cache_clear()
    try:
        assert confine_problem() == "ENVSCALER_SANDBOX=off turned it off"
    finally:
        monkeypatch.undo()
        confine_problem.cache_clear()


def test_a_child_that_ends_or_stalls_without_handing_over_a_sandbox_is_the_process_to_wait_for():
    # It failed before it forked one (its exit status says how), or it never got that far: no pid, no hang.
    for body, timeout_s in ((lambda: os._exit(3), 30.0), (lambda: time.sleep(30), 0.5)):
        handed, hand_over = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(handed)
            body()
            os._exit(0)
        os.close(hand_over)
        started = time.monotonic()
        try:
            assert taken_over(child, handed, timeout_s) is None
            assert time.monotonic() - started < 25
        finally:
            os.close(handed)
            os.kill(child, 9)
            os.waitpid(child, 0)


@needs_confinement
def test_a_ray_node_asks_a_fresh_interpreter_whether_its_servers_can_confine_their_workers(monkeypatch, tmp_path):
    # No bubblewrap on the PATH: the servers' workers confine themselves, and need none.
    monkeypatch.setenv("PATH", str(tmp_path))
    assert node_confine_problem() is None
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no interpreter here' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    assert node_confine_problem() == "its sandbox probe failed: no interpreter here"
