"""What a new user hits first, through the real command line: one line, the right exit code, no traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_client.models import Record
from agent_client.summary import render, summarize
from envscaler import default_catalog
from tests.support.bundles import COUNTER_CODE, counter_bundle, counter_scenario, counter_spec, write_bundle
from tests.support.cli import envscaler
from tests.support.farm import catalog_copies, two_counters_up
from tests.support.server import serve


def assert_usage_error(done: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit 2 with one line on stderr that says what is wrong."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in last, last


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--concurrency", "0"], ["--concurrency", "at least 1"]),
        (["--concurrency", "-1"], ["--concurrency", "at least 1"]),
        (["--repeats", "0"], ["--repeats", "at least 1"]),
        (["--time-limit", "0"], ["--time-limit", "more than 0"]),
        (["--max-steps", "many"], ["--max-steps", "whole number"]),
    ],
)
def test_bad_run_numbers_are_refused_at_parse_time(tmp_path, flags, words):
    assert_usage_error(envscaler("run", "--out", str(tmp_path / "out.jsonl"), *flags), *words)


def test_bad_numbers_of_other_commands_are_refused(tmp_path):
    assert_usage_error(envscaler("catalog", "check", "--jobs", "0"), "--jobs")
    assert_usage_error(envscaler("catalog", "check", "--timeout", "-5"), "--timeout")
    assert_usage_error(envscaler("demo", "--concurrency", "0"), "--concurrency")
    assert_usage_error(envscaler("synth", "all", "--out", str(tmp_path), "--concurrency", "0"), "--concurrency")
    assert_usage_error(envscaler("serve", "counter", "--check-idle", "-1"), "--check-idle", "at least 0")
    assert_usage_error(envscaler("farm", "up", "--backend", "process", "--catalog", str(tmp_path / "f.json"), "--check-idle", "-1"),
                       "--check-idle", "at least 0")
    # Resource limits below what a worker needs: named at parse time, not as a validation error deep in the farm.
    for flags, words in ((["--pids", "2"], ["--pids", "at least 16"]), (["--memory-mb", "10"], ["--memory-mb", "at least 64"]),
                         (["--cpus", "0"], ["--cpus", "more than 0"]), (["--probe-period", "0"], ["--probe-period", "more than 0"]),
                         (["--probe-timeout", "-1"], ["--probe-timeout", "more than 0"])):
        assert_usage_error(envscaler("farm", "up", "--backend", "process", "--catalog", str(tmp_path / "f.json"), *flags), *words)
    for flags, words in ((["--worker-tasks", "2"], ["--worker-tasks", "at least 16"]),
                         (["--worker-memory-mb", "10"], ["--worker-memory-mb", "at least 64"]), (["--worker-cpus", "-1"], ["--worker-cpus"])):
        assert_usage_error(envscaler("serve", "counter", *flags), *words)
    assert not (tmp_path / "f.json").exists()


def test_run_out_that_is_a_folder(tmp_path):
    catalog = tmp_path / "farm.json"
    catalog.write_text(json.dumps({"envs": {}}))
    assert_usage_error(envscaler("run", "--farm", str(catalog), "--out", str(tmp_path)), "is a folder", "run.jsonl")


def test_run_and_episode_default_to_the_farms_catalog_and_say_how_to_make_one(tmp_path):
    done = subprocess.run([sys.executable, "-m", "envscaler.cli", "run", "--out", "x.jsonl"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert_usage_error(done, ".envscaler/farm.json", "farm up")
    new = subprocess.run([sys.executable, "-m", "envscaler.cli", "episode", "new", "--scenario", "a/b"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=60)
    assert_usage_error(new, ".envscaler/farm.json")


def test_synth_without_an_endpoint_names_the_missing_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "OPENAI_BASE_URL")}
    done = subprocess.run([sys.executable, "-m", "envscaler.cli", "synth", "all", "--out", str(tmp_path / "out"), "--limit", "1"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert_usage_error(done, "OPENAI_API_KEY", "--base-url")
    run = subprocess.run([sys.executable, "-m", "envscaler.cli", "run", "--agent", "openai", "--model", "m", "--out",
                          str(tmp_path / "o.jsonl")], capture_output=True, text=True, env=env, timeout=60)
    assert_usage_error(run, "OPENAI_API_KEY")


def test_catalog_list_of_an_empty_folder_and_a_bundle_without_scenarios(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_usage_error(envscaler("catalog", "list", str(tmp_path / "empty")), "no bundles")
    bundle = write_bundle(tmp_path / "half", counter_spec(), [])
    (bundle / "scenarios.jsonl").unlink()
    assert_usage_error(envscaler("catalog", "list", str(bundle)), "no scenarios.jsonl")


def test_catalog_scenarios_lists_task_ids_by_env_id_or_folder(tmp_path):
    by_name = envscaler("catalog", "scenarios", "online_retail")
    assert by_name.returncode == 0 and by_name.stdout.startswith("online_retail/online_retail_001")
    by_folder = envscaler("catalog", "scenarios", str(counter_bundle(tmp_path)))
    assert [line.split()[0] for line in by_folder.stdout.splitlines()] == ["counter/counter_001", "counter/counter_002"]
    assert_usage_error(envscaler("catalog", "scenarios", "no_such_env"), "no_such_env")


@pytest.mark.parametrize(
    "command",
    [[], ["run"], ["export"], ["demo"], ["episode"], ["episode", "new"], ["episode", "validate"], ["catalog", "list"],
     ["catalog", "scenarios"], ["catalog", "check"], ["import", "envscaler"], ["serve"], ["build"], ["farm"], ["farm", "up"],
     ["farm", "status"], ["farm", "down"], ["synth"], ["synth", "skeleton"], ["synth", "scenarios"], ["synth", "all"],
     ["episode", "end"]],
)
def test_every_help_has_an_example(command):
    done = envscaler(*command, "--help")
    assert done.returncode == 0 and "examples:\n  envscaler " in done.stdout


def test_version_and_a_broken_pipe():
    version = envscaler("--version")
    assert version.returncode == 0 and version.stdout.startswith("envscaler ")
    piped = subprocess.run(f"{sys.executable} -m envscaler.cli catalog scenarios | head -1", shell=True, capture_output=True,
                           text=True, timeout=60)
    assert piped.stdout.count("\n") == 1 and "Traceback" not in piped.stderr


def test_an_environment_with_only_infra_errors_shows_no_score():
    records = [Record(env_id="down", task_id="t", repeat=0, agent="replay", termination="infra_error", started_at=0, duration_s=0,
                      error="connection refused"),
               Record(env_id="up", task_id="t", repeat=0, agent="replay", termination="finished", started_at=0, duration_s=0,
                      reward=1.0)]
    table = render(summarize(records, 1)).splitlines()
    down = next(line for line in table if line.startswith("down"))
    assert "0.000" not in down and down.split()[2] == "-"


def _default_sigint() -> None:
    """In the child: Ctrl-C as a terminal gives it. A test runner started in the background by a
    non-interactive shell ignores SIGINT, and an ignored signal stays ignored across exec."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_run_ends_the_live_episodes(tmp_path):
    with serve(counter_bundle(tmp_path)) as server:
        catalog = tmp_path / "farm.json"
        catalog.write_text(json.dumps({"envs": {"counter": {"url": server.url, "token": server.token}}}))
        command = [sys.executable, "-m", "envscaler.cli", "run", "--farm", str(catalog), "--out", str(tmp_path / "out.jsonl"),
                   "--agent", "command", "--command", f"{sys.executable} -c 'import time; time.sleep(60)'", "--quiet"]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                   preexec_fn=_default_sigint)
        with server.client() as http:
            deadline = time.monotonic() + 60
            while len(http.get("/episodes").json()["episodes"]) < 2:
                assert time.monotonic() < deadline and process.poll() is None, "the run never started its episodes"
                time.sleep(0.2)
            os.killpg(process.pid, signal.SIGINT)
            _, stderr = process.communicate(timeout=60)
            assert process.returncode == 130 and "Traceback" not in stderr
            assert http.get("/episodes").json()["episodes"] == []


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(cmdline)
    return found


# The demo's command runner, with Ctrl-C landing inside Popen once the child exists (the real Popen and
# a real SIGINT; the child is a sleeper in place of an envscaler command). It prints the child's pid.
_CTRL_C_IN_POPEN = """
import os, signal, subprocess, sys
from agent_client import cli
real = subprocess.Popen
def popen(command, **kwargs):
    process = real([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)
    print(process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    return process
subprocess.Popen = popen
try:
    cli._envscaler("farm", "status")
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_while_the_demo_starts_a_command_leaves_no_orphan():
    done = subprocess.run([sys.executable, "-c", _CTRL_C_IN_POPEN], capture_output=True, text=True, timeout=60,
                          preexec_fn=_default_sigint)
    pid, said = done.stdout.split()
    assert said == "interrupted" and done.returncode == 0, done.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)  # killed and reaped by the demo, not left running on its own


def test_ctrl_c_during_demo_leaves_nothing_behind_and_says_one_line(tmp_path):
    moment = "demo: starting a process farm"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "envscaler.cli", "demo", "--out", str(tmp_path / "out")], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=_default_sigint)
    lines = []
    for line in process.stderr:  # type: ignore[union-attr]
        lines.append(line)
        if moment in line:
            break
    # At once: the bundled catalog's farm is up in about 2 s, and the demo's runs take about 1 s each.
    os.killpg(process.pid, signal.SIGINT)
    rest = process.stderr.read()  # type: ignore[union-attr]
    process.wait(120)
    assert process.returncode == 130, "".join(lines) + rest
    assert "Traceback" not in rest and rest.count("interrupted") == 1, rest
    assert list(scratch.iterdir()) == []
    assert _processes_mentioning(str(scratch)) == []


def test_ctrl_c_during_farm_up_stops_what_it_started(tmp_path):
    catalog = tmp_path / "farm" / "farm.json"
    # A server that takes a minute to load its class: farm up is still waiting when Ctrl-C comes.
    slow = write_bundle(tmp_path, counter_spec(env_class_code="import time\ntime.sleep(60)\n" + COUNTER_CODE), [counter_scenario()])
    process = subprocess.Popen([sys.executable, "-m", "envscaler.cli", "farm", "up", str(default_catalog() / "online_retail"), str(slow),
                                "--backend", "process", "--catalog", str(catalog)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=_default_sigint)
    for line in process.stderr:  # type: ignore[union-attr]
        if "farm: starting" in line:
            break
    time.sleep(1.5)
    os.killpg(process.pid, signal.SIGINT)
    rest = process.stderr.read()  # type: ignore[union-attr]
    process.wait(120)
    assert process.returncode == 130 and "Traceback" not in rest and "stopped everything it had started" in rest, rest
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(catalog)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(catalog)) == []


def test_resume_reruns_infra_errors_and_refuses_another_agents_file(tmp_path):
    bundle = counter_bundle(tmp_path)
    catalog, out = tmp_path / "farm.json", tmp_path / "out.jsonl"
    with serve(bundle) as server:
        catalog.write_text(json.dumps({"envs": {"counter": {"url": server.url, "token": server.token}}}))
        first = envscaler("run", "--farm", str(catalog), "--out", str(out), "--quiet")
        assert first.returncode == 0, first.stderr
        records = [json.loads(line) for line in out.read_text().splitlines()]
        # As if the first episode's server had died mid-run.
        records[0]["termination"], records[0]["reward"], records[0]["error"] = "infra_error", None, "server gone"
        out.write_text("".join(json.dumps(r) + "\n" for r in records))
        kept = envscaler("run", "--farm", str(catalog), "--out", str(out), "--keep-infra-errors", "--quiet")
        assert "0 to run" in kept.stderr and kept.returncode == 1  # the infra error is still in the file
        again = envscaler("run", "--farm", str(catalog), "--out", str(out), "--quiet")
        assert again.returncode == 0 and "1 to run" in again.stderr, again.stderr
        assert [json.loads(line)["termination"] for line in out.read_text().splitlines()].count("infra_error") == 0
        other = envscaler("run", "--farm", str(catalog), "--out", str(out), "--agent", "random", "--quiet")
        assert_usage_error(other, "agent 'replay', not 'random'", "another --out")


def test_a_class_that_cannot_load_fails_build_and_farm_up_at_once(tmp_path):
    broken = write_bundle(tmp_path, counter_spec(env_class_code="class Counter(:\n    pass\n"), [])
    for command in (["build", str(broken)], ["farm", "up", str(broken), "--backend", "process", "--catalog", str(tmp_path / "f.json")]):
        done = envscaler(*command, timeout=60)
        assert_usage_error(done, "counter: syntax error in class code, line 1")
    renamed = write_bundle(tmp_path / "other", counter_spec(env_class_code="class Other:\n    pass\n"), [])
    assert_usage_error(envscaler("build", str(renamed)), "no class 'Counter'", "Other")


def test_status_of_a_farm_whose_daemon_died_reports_nothing_healthy(tmp_path):
    catalog = tmp_path / "farm.json"
    up = envscaler("farm", "up", str(counter_bundle(tmp_path)), "--backend", "process", "--catalog", str(catalog), timeout=180)
    assert up.returncode == 0, up.stderr
    try:
        daemon = json.loads(envscaler("farm", "status", "--catalog", str(catalog), "--json").stdout)["daemon_pid"]
        os.kill(daemon, signal.SIGKILL)
        time.sleep(0.5)
        status = envscaler("farm", "status", "--catalog", str(catalog))
        assert status.returncode == 1 and "NOT RUNNING" in status.stdout
        assert "healthy" not in status.stdout.split("\n", 1)[1] and "farm down" in status.stderr
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))
    assert _processes_mentioning(str(catalog)) == []


def test_a_torn_run_file_is_named_with_the_position(tmp_path):
    torn = tmp_path / "run.jsonl"
    torn.write_text('{"env_id": "x", ')
    assert_usage_error(envscaler("export", "--in", str(torn)), "run.jsonl:1", "line 1 column 16")


def test_a_busy_port_is_one_line_for_serve_and_farm_up(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        served = envscaler("serve", str(counter_bundle(tmp_path)), "--port", port)
        assert_usage_error(served, f"cannot listen on 127.0.0.1:{port}", "Address already in use")
        farm = envscaler("farm", "up", str(tmp_path / "counter"), "--backend", "process", "--gateway-port", port,
                         "--catalog", str(tmp_path / "farm.json"))
        assert_usage_error(farm, f"cannot listen on 127.0.0.1:{port}")
        assert len(farm.stderr.strip().splitlines()) <= 2 and not (tmp_path / "farm.json").exists()


def test_openenv_without_its_extra_is_one_line(tmp_path):
    # A package of that name that cannot be imported stands for the missing [openenv] extra.
    hidden = tmp_path / "hide"
    (hidden / "openenv").mkdir(parents=True)
    (hidden / "openenv" / "__init__.py").write_text("raise ImportError('No module named openenv (hidden by the test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", "")])}
    bundle = str(counter_bundle(tmp_path))
    farm = envscaler("farm", "up", bundle, "--backend", "process", "--openenv", "--catalog", str(tmp_path / "f.json"), env=env)
    assert_usage_error(farm, "openenv", "pip install")
    assert len(farm.stderr.strip().splitlines()) == 1
    served = envscaler("serve", bundle, "--port", "0", "--openenv-port", "0", env=env)
    assert_usage_error(served, "openenv", "pip install")


def test_a_command_loads_only_its_own_package_and_a_misspelt_one_lists_them_all():
    # What loading every command would import besides: the farm's backends, httpx, the synthesis pipeline.
    probe = ("import sys; from envscaler.cli import build_parser; build_parser(['run', '--out', 'x.jsonl']); "
             "print(sorted({'servers.farm.cli', 'httpx', 'synth.cli', 'servers.cli'} & set(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr
    misspelt = envscaler("rnu")
    assert_usage_error(misspelt, "invalid choice: 'rnu'", "'run'", "'farm'", "'serve'", "'synth'", "'connect'")


def test_usage_errors_are_one_line_not_the_whole_usage():
    done = envscaler("run", "--out", "x.jsonl", "--concurrency", "0")
    assert_usage_error(done, "--concurrency", "at least 1", "envscaler run --help")
    assert len(done.stderr.strip().splitlines()) == 1


def test_serve_names_a_broken_class_once_and_takes_an_env_id(tmp_path):
    broken = write_bundle(tmp_path, counter_spec(env_class_code="class Counter(:\n    pass\n"), [])
    for flags in ([], ["--in-process"]):
        done = envscaler("serve", str(broken), "--port", "0", *flags)
        assert_usage_error(done, "counter: syntax error in class code, line 1")
        assert done.stderr.count("counter:") == 1 and len(done.stderr.strip().splitlines()) == 1
    unknown = envscaler("catalog", "scenarios", "nope")
    assert_usage_error(unknown, "nope: no such folder, and no environment of that name in the bundled catalog")
    assert_usage_error(envscaler("serve", "nope", "--port", "0"), "no environment of that name in the bundled catalog")
    process = subprocess.Popen([sys.executable, "-m", "envscaler.cli", "serve", "library_circulation", "--port", "0", "--token", "t"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert json.loads(process.stdout.readline())["env_id"] == "library_circulation"
    finally:
        process.terminate()
        process.wait(30)


def test_demo_of_a_folder_that_is_not_there_is_refused_before_any_farm(tmp_path):
    done = envscaler("demo", str(tmp_path / "nope"), "--out", str(tmp_path / "runs"))
    assert_usage_error(done, "nope: no such folder")
    assert "starting a process farm" not in done.stderr


def test_farm_status_of_a_malformed_catalog_and_down_counts_what_ran(tmp_path):
    malformed = tmp_path / "bad.json"
    malformed.write_text("{not json")
    assert_usage_error(envscaler("farm", "status", "--catalog", str(malformed)), "bad.json", "unreadable")
    catalog = two_counters_up(tmp_path)
    down = envscaler("farm", "down", "--catalog", str(catalog))
    assert down.returncode == 0 and "farm: down (2 servers stopped)" in down.stderr, down.stderr
    again = envscaler("farm", "down", "--catalog", str(catalog))
    assert again.returncode == 0 and "nothing to do" in again.stderr


@pytest.mark.parametrize("after_s", [0.6, 1.2, 2.0])
def test_ctrl_c_while_a_command_starts_is_one_line(after_s, tmp_path):
    # catalog check of four copies of the catalog runs for a while (an idle machine checks one in about 2 s, so
    # that none finishes before the signal, as catalog list could); what it printed of its progress stays, and
    # Ctrl-C adds one line.
    copies = catalog_copies(tmp_path, 4 * len(list(default_catalog().iterdir())))
    process = subprocess.Popen([sys.executable, "-m", "envscaler.cli", "catalog", "check", str(copies[0].parent)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    time.sleep(after_s)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert "Traceback" not in stderr, stderr
    # 130, or ended by the signal itself, which a shell reports as 130 too (128 + SIGINT): seen once on a loaded
    # machine, where the interpreter let the signal end it after the command had said "interrupted".
    assert process.returncode in (130, -signal.SIGINT) and stderr.strip().splitlines()[-1] == "interrupted", (process.returncode, stderr)


def test_demo_says_when_environment_code_runs_unsandboxed(tmp_path):
    # As on a machine without bubblewrap: the demo's farm says so before any environment code runs.
    env = {**os.environ, "ENVSCALER_SANDBOX": "off"}
    done = envscaler("demo", "library_circulation", "--out", str(tmp_path / "runs"), env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == "demo: starting a process farm of library_circulation"
    assert "environment code runs without a sandbox" in lines[1] and "ENVSCALER_SANDBOX=off" in lines[1]
