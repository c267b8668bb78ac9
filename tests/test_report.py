"""Seeing a run: the HTML report in a real Chromium, Inspect logs read back by inspect_ai, and reverify.

One process farm of two bundled environments (five scenarios each) serves every test; the replay and
random agents each run every scenario twice through ``envscaler run``, as a user would.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent_client.export import read_records
from tests.support.cli import envscaler
from tests.support.commands import checkout_commands_env
from tests.support.extras import require

CHROMIUM = shutil.which("chromium")
# What works on a closed network (/work/.library/env/machines/python.md): no background traffic, no sandbox as root.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ENVS = ["it_helpdesk", "library_circulation"]


def _bundles(root: Path) -> Path:
    """The first five scenarios of each of ENVS, written as bundles under ``root``."""
    from envscaler import default_catalog, load_bundle, save_bundle

    for env_id in ENVS:
        bundle = load_bundle(default_catalog() / env_id)
        bundle.scenarios = bundle.scenarios[:5]
        save_bundle(bundle, root)
    return root


@contextmanager
def _farm(bundles: Path, catalog: Path) -> Iterator[Path]:
    up = envscaler("farm", "up", *(str(bundles / e) for e in ENVS), "--backend", "process", "--catalog", str(catalog))
    assert up.returncode == 0, up.stderr
    try:
        yield catalog
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Run files of the replay and random agents (2 repeats), the bundles they ran on, and the command environment."""
    root = tmp_path_factory.mktemp("report")
    bundles = _bundles(root / "bundles")
    with _farm(bundles, root / "farm.json") as catalog:
        for agent in ("replay", "random"):
            done = envscaler("run", "--farm", str(catalog), "--agent", agent, "--repeats", "2", "--quiet",
                             "--out", str(root / f"{agent}.jsonl"))
            assert done.returncode == 0, done.stderr
            assert "over 2 repeats: pass^1" in done.stdout
    return {"root": root, "bundles": bundles, "replay": root / "replay.jsonl", "random": root / "random.jsonl"}


@pytest.fixture(scope="module")
def commands_env(runs) -> dict[str, str]:
    """An environment whose ``envscaler`` has this checkout's commands (report, reverify) without a reinstall."""
    return checkout_commands_env(runs["root"] / "commands")


def _chromium(tmp_path: Path, url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM, "Debian's chromium is not installed: run .ci/run (it installs it)"
    return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}", "--enable-logging=stderr",
                           "--v=0", *flags, url], capture_output=True, text=True, timeout=120)


def test_the_report_of_two_agents_renders_in_chromium_and_opens_an_episode(runs, commands_env, tmp_path):
    page = tmp_path / "report.html"
    made = envscaler("report", str(runs["replay"]), str(runs["random"]), "--out", str(page), env=commands_env)
    assert made.returncode == 0, made.stderr
    assert "2 run(s), 40 episode(s)" in made.stdout
    html = page.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "the page must load nothing from the network"

    # A failed random episode, opened by its address as a link in the episode list opens it.
    random = sorted(read_records(runs["random"]), key=lambda r: (r.reward or 0.0, r.env_id, r.task_id))[0]
    target = f"ep-1-{random.env_id}-{random.task_id}-{random.repeat}"
    shown = _chromium(tmp_path, f"{page.as_uri()}#{target}", "--virtual-time-budget=5000", "--dump-dom")
    assert shown.returncode == 0, shown.stderr[-2000:]
    console = [line for line in shown.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    dom = shown.stdout
    opened = re.search(rf'<details class="episode" id="{target}" open="">(.*?)</details>', dom, re.S)
    assert opened, "the drill-down of the episode in the address did not open"
    drill = opened.group(1)
    assert "Checks (" in drill and "Tool calls (" in drill and "State change (" in drill
    assert all(call.name in drill for call in random.trajectory)
    assert "FAIL" in drill  # a random episode that failed shows its failed check
    # Every plot is there, drawn: bars, the histogram and the pass^k curves.
    charts = re.findall(r'<svg class="chart".*?</svg>', dom, re.S)
    assert len(charts) == 7
    assert all("<rect" in chart for chart in charts)
    assert "<polyline" in charts[1]
    # Side by side: replay (1.0 everywhere) against random, with a significance measure over scenarios.
    assert "replay (A) against random (B): <span class=\"ok\">significant at the 5% level</span>" in dom
    assert "10 scenario(s) differ" in dom

    shot = tmp_path / "report.png"
    taken = _chromium(tmp_path, page.as_uri(), "--window-size=1280,1500", f"--screenshot={shot}")
    assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]
    print(f"report screenshot: {shot}")


def test_report_refuses_what_is_not_a_run_file(runs, commands_env, tmp_path):
    missing = envscaler("report", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "r.html"), env=commands_env)
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0, missing.stderr
    assert "no such run file" in missing.stderr
    other = tmp_path / "other.jsonl"
    other.write_text('{"hello": 1}\n')
    wrong = envscaler("report", str(other), "--out", str(tmp_path / "r.html"), env=commands_env)
    assert wrong.returncode == 2 and "not a run record" in wrong.stderr and wrong.stderr.strip().count("\n") == 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert envscaler("report", str(empty), env=commands_env).returncode == 2


def test_inspect_logs_read_back_with_inspect_ai(runs, tmp_path):
    require("inspect_ai", extra="inspect")
    from inspect_ai.log import read_eval_log

    records = read_records(runs["random"])
    for suffix in (".eval", ".json"):
        target = tmp_path / f"random{suffix}"
        done = envscaler("export", "--in", str(runs["random"]), "--format", "inspect", "--out", str(target))
        assert done.returncode == 0, done.stderr
        log = read_eval_log(str(target))
        assert log.status == "success" and log.eval.config.epochs == 2
        assert len(log.samples) == len(records) == 20
        by_key = {(s.id, s.epoch): s for s in log.samples}
        for record in records:
            sample = by_key[(f"{record.env_id}/{record.task_id}", record.repeat + 1)]
            score = sample.scores["checks"]
            assert score.value == pytest.approx(record.reward)
            assert score.metadata["checks"] == [c.model_dump() for c in record.checks]
            assert sample.target == [c.check_item for c in record.checks]
            assert sample.metadata["termination"] == record.termination
            calls = [c for m in sample.messages if m.role == "assistant" for c in m.tool_calls or []]
            assert [c.function for c in calls] == [c.name for c in record.trajectory]
            assert [c.arguments for c in calls] == [c.arguments for c in record.trajectory]
            failed = [m for m in sample.messages if m.role == "tool" and m.error is not None]
            assert len(failed) == sum(c.error is not None for c in record.trajectory)
        mean = sum(r.reward for r in records) / len(records)
        assert log.results.scores[0].metrics["mean"].value == pytest.approx(mean)


def test_reverify_after_a_check_change_flips_exactly_the_episodes_it_should(runs, commands_env, tmp_path):
    from envscaler import load_bundle, save_bundle

    bundles = tmp_path / "bundles"
    shutil.copytree(runs["bundles"], bundles)
    bundle = load_bundle(bundles / "it_helpdesk")
    broken, lenient = bundle.scenarios[0], bundle.scenarios[1]
    # A check that now fails whatever the state (replay's two episodes of this scenario lose full
    # success), and a scenario whose checks now pass whatever the state (random's two gain it).
    broken.checklist_with_func[0].check_func = "def check_func(final_state):\n    return False\n"
    for item in lenient.checklist_with_func:
        item.check_func = "def check_func(final_state):\n    return True\n"
    save_bundle(bundle, bundles)
    with _farm(bundles, tmp_path / "farm.json") as catalog:
        outcomes = {}
        for agent in ("replay", "random"):
            out = tmp_path / f"{agent}.rescored.jsonl"
            done = envscaler("reverify", str(runs[agent]), "--farm", str(catalog), "--out", str(out), "--quiet",
                             env=commands_env)
            assert done.returncode == 0, done.stderr
            assert "answered differently" not in done.stderr
            outcomes[agent] = (done.stdout, read_records(out))

    stdout, rescored = outcomes["replay"]
    flips = {(r.task_id, r.repeat) for r in rescored if r.reward != 1.0}
    assert flips == {(broken.task_id, 0), (broken.task_id, 1)}
    assert stdout.count("FLIP ") == 2 and "2 flipped success" in stdout
    assert f"{broken.checklist_with_func[0].check_item}: pass -> FAIL" in stdout

    stdout, rescored = outcomes["random"]
    before = {(r.env_id, r.task_id, r.repeat): r for r in read_records(runs["random"])}
    gained = {(r.task_id, r.repeat) for r in rescored if r.reward == 1.0}
    assert gained == {(lenient.task_id, 0), (lenient.task_id, 1)}
    assert stdout.count("FLIP ") == 2
    # Everything else scores as it did, and the records keep what the agent did.
    for record in rescored:
        old = before[(record.env_id, record.task_id, record.repeat)]
        assert record.messages == old.messages and record.trajectory == old.trajectory
        if record.task_id not in (broken.task_id, lenient.task_id):
            assert record.reward == old.reward and record.checks == old.checks
