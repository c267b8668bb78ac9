"""Hostile environment code: contained by the process backend's sandbox and under ``catalog check``."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from envscaler.sandbox import sandbox_problem, sandboxed
from tests.support.bundles import counter_bundle, counter_scenario, counter_spec, write_bundle
from tests.support.cli import envscaler
from tests.support.hostile import HOSTILE_CODE, attack, call, common_attacks, hostile_bundle
from tests.support.server import serve

needs_sandbox = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")


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
    with sandboxed([sys.executable, "-c", probe], readable=[]) as launch:
        done = subprocess.run(launch.argv, pass_fds=launch.fds, preexec_fn=launch.enter, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["PermissionError", "FileNotFoundError", "ConnectionRefusedError", "OSError", "allowed"], done.stderr


# Each attempt prints the errno name it met, or "allowed".
ATTEMPTS = """
import ctypes, errno, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
def attempt(f):
    try:
        f()
        return "allowed"
    except OSError as e:
        return errno.errorcode[e.errno]
def c_call(name, *args):
    if getattr(libc, name)(*args) == -1:
        raise OSError(ctypes.get_errno(), name)
def fork_and_reap():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
def thread():
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
results = {
    "fork": attempt(fork_and_reap),
    "subprocess": attempt(lambda: subprocess.run(["true"])),
    "thread": attempt(thread),
    "unshare": attempt(lambda: c_call("unshare", 0x10000000)),  # CLONE_NEWUSER
    "setns": attempt(lambda: c_call("setns", os.open("/proc/self/ns/uts", os.O_RDONLY), 0)),
    "memfd": attempt(lambda: os.close(os.memfd_create("x"))),
}
"""


def probe(before: str = "", *, new_processes: bool = False, memfd: bool = True) -> dict[str, str]:
    """What the attempts meet in a sandboxed process that first runs ``before``."""
    code = f"{before}\n{ATTEMPTS}\nimport json\nprint(json.dumps(results))"
    with sandboxed([sys.executable, "-c", code], readable=[], new_processes=new_processes, memfd=memfd) as launch:
        done = subprocess.run(launch.argv, pass_fds=launch.fds, preexec_fn=launch.enter, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@needs_sandbox
def test_the_sandbox_refuses_processes_and_namespaces_and_keeps_threads():
    assert probe() == {"fork": "EPERM", "subprocess": "EPERM", "thread": "allowed", "unshare": "EPERM", "setns": "EPERM",
                       "memfd": "allowed"}


@needs_sandbox
def test_a_process_that_may_fork_takes_it_away_from_a_child_with_the_same_policy():
    # A zygote's sandbox lets it fork, never make namespaces; what it loads into a child refuses what the sandbox does.
    assert probe(new_processes=True) == {"fork": "allowed", "subprocess": "allowed", "thread": "allowed", "unshare": "EPERM",
                                         "setns": "EPERM", "memfd": "allowed"}
    load = ("import ctypes\nfrom envscaler.seccomp import LoadableProgram, seccomp_bpf\n"
            "LoadableProgram(seccomp_bpf({}), ctypes.CDLL(None, use_errno=True).prctl).load()")
    assert probe(load.format(""), new_processes=True) == probe()
    assert probe(load.format("memfd=False"), new_processes=True)["memfd"] == "EPERM"
    # A zygote whose own sandbox refuses memfds (no memory cgroup counts them: a Ray node's servers) builds the program all the same.
    assert probe(load.format("memfd=False"), new_processes=True, memfd=False) == {**probe(), "memfd": "EPERM"}


def test_without_libseccomp_the_sandbox_says_what_to_install():
    code = "import sys\nsys.modules['pyseccomp'] = None\nfrom envscaler.sandbox import sandbox_problem\nprint(sandbox_problem())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "libseccomp" in done.stdout and "pip install pyseccomp" in done.stdout, done.stdout + done.stderr


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
        attacks = common_attacks(catalog, victim)
        # Its own bundle is not even visible to the environment worker: it came over the worker's socket.
        attacks["write", json.dumps({"path": str(hostile / "env.json")})] = "No such file"
        attack(catalog, "hostile", "counter", attacks)
        with httpx.Client(timeout=60) as http:
            endpoint = json.loads(catalog.read_text())["envs"]["hostile"]
            created = http.post(f"{endpoint['url']}/episodes", json={"scenario_id": "hostile_001"},
                                headers={"Authorization": f"Bearer {endpoint['token']}"}).json()
            assert "mine" in call(http, created["mcp_url"], "scratch", {})["content"][0]["text"]
            # A host path under /tmp lands in the sandbox's private /tmp, never on the host.
            outside = tmp_path / "outside.txt"
            call(http, created["mcp_url"], "write", {"path": str(outside)})
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
