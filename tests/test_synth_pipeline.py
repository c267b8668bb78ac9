"""The synthesis pipeline end to end, against a real OpenAI-compatible replay server.

The full run goes through the real command line, then ``catalog check``, ``serve`` and the official
MCP client; the repair, policy and gate tests drive the pipeline in-process to look at its report.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mcp import Client

from envscaler import load_bundle
from synth.models import SeedTask, SynthConfig
from synth.pipeline import synthesis
from tests.support.cli import envscaler
from tests.support.server import serve
from tests.support.synth_script import (
    ALL_PASS,
    CLASS_NAME,
    CRASHING_CANCEL,
    ENV_ID,
    METHODS,
    SEED,
    SKELETON,
    MatchingReplayServer,
    answer,
    env_script,
    full_script,
    stage_models,
)

pytestmark = pytest.mark.anyio
ENV_REQUESTS = 11
SCENARIO_REQUESTS = 5


def write_inputs(tmp_path: Path, **settings) -> tuple[Path, Path]:
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text(json.dumps(SEED) + "\n")
    config = tmp_path / "synth.json"
    config.write_text(json.dumps({"stages": stage_models(), "backoff_s": 0.01, "retries": 1, **settings}))
    return seeds, config


def synth_command(server, seeds: Path, config: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "envscaler.cli", "synth", "all", "--tasks", str(seeds), "--out", str(out),
            "--n", "3", "--base-url", server.base_url, "--config", str(config), *extra]


async def replay_to_one(bundle_dir: Path) -> list[float]:
    """Serve the bundle and replay every reference solution through the official MCP client."""
    bundle = load_bundle(bundle_dir)
    scores = []
    with serve(bundle_dir) as server, server.client() as control:
        for scenario in bundle.scenarios:
            episode = control.post("/episodes", json={"scenario_id": scenario.task_id}).json()
            async with Client(episode["mcp_url"]) as client:
                listed = {t.name for t in (await client.list_tools()).tools}
                assert listed == {"search_rooms", "get_booking", "book_room", "cancel_booking"}
                for call in scenario.reference_solution:
                    result = await client.call_tool(call.name, call.arguments)
                    assert not result.is_error, result.content
            scores.append(control.post(f"/episodes/{episode['episode_id']}/validate").json()["score"])
    return scores


async def test_full_pipeline_one_seed_to_a_served_environment(tmp_path):
    seeds, config = write_inputs(tmp_path)
    out = tmp_path / "out"
    with MatchingReplayServer(full_script()) as server:
        done = subprocess.run(synth_command(server, seeds, config, out), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(server.requests) == ENV_REQUESTS + 3 * SCENARIO_REQUESTS
    assert all(not steps for steps in server.scripts.values()), "every scripted answer was used"

    report = json.loads((out / "synth_report.json").read_text())
    assert report["accepted_envs"] == [ENV_ID]
    assert sorted(report["accepted_scenarios"]) == [f"{ENV_ID}_synth_00{i}" for i in (1, 2, 3)]
    assert report["requests_per_env"] == ENV_REQUESTS and report["requests_per_scenario"] == SCENARIO_REQUESTS
    assert report["stages"]["judge"]["accepted"] == 1 and report["stages"]["gates"]["accepted"] == 3
    assert report["stages"]["method"]["prompt_tokens"] == 4 * 10
    assert "requests per accepted environment: 11.0; per accepted scenario: 5.0" in done.stdout

    bundle = load_bundle(out / ENV_ID)
    assert bundle.spec.env_class_name == CLASS_NAME
    assert [t["function"]["name"] for t in bundle.spec.tools] == list(METHODS)
    assert bundle.spec.tools[2]["function"]["parameters"]["required"] == ["room_id", "organizer", "start", "end", "attendees"]
    assert all(s.reference_solution and s.checklist_with_func for s in bundle.scenarios)

    check = envscaler("catalog", "check", str(out), timeout=240)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "all gates pass" in check.stdout

    assert await replay_to_one(out / ENV_ID) == [1.0, 1.0, 1.0]


def test_killed_run_resumes_without_repeating_finished_requests(tmp_path):
    seeds, config = write_inputs(tmp_path, concurrency=1)
    out = tmp_path / "out"
    first_script = full_script()
    # The tester's answer is held back, so the kill lands while that request is in flight.
    first_script["tester"][0] = {**first_script["tester"][0], "delay_s": 2}
    with MatchingReplayServer(first_script) as first:
        process = subprocess.Popen(synth_command(first, seeds, config, out), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not first.requests_for("tester"):
            assert time.monotonic() < deadline and process.poll() is None, "the run never reached the tester"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        seen = list(first.requests)
    finished = [r for r in seen if r["model"] != "tester"]
    assert len(finished) == 9  # stateful, topic, state, skeleton, operations, 4 methods

    with MatchingReplayServer(full_script()) as second:
        done = subprocess.run(synth_command(second, seeds, config, out), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    bodies = [json.dumps(r, sort_keys=True) for r in second.requests]
    assert not set(bodies) & {json.dumps(r, sort_keys=True) for r in finished}, "a finished request was repeated"
    assert len(second.requests) == ENV_REQUESTS + 3 * SCENARIO_REQUESTS - len(finished)
    assert second.requests[0]["messages"] == seen[-1]["messages"], "the in-flight tester request is asked again"
    report = json.loads((out / "synth_report.json").read_text())
    assert report["stages"]["method"]["cached"] == 4 and report["stages"]["method"]["requests"] == 0
    assert report["accepted_envs"] == [ENV_ID] and len(report["accepted_scenarios"]) == 3


async def run_envs(server, tmp_path, seeds: list[dict], **settings):
    config = SynthConfig(base_url=server.base_url, stages=stage_models(), backoff_s=0.01, retries=1, **settings)
    async with synthesis(config, tmp_path / "cache", tmp_path / "report.json") as run:
        written = await run.environments([SeedTask.model_validate(s) for s in seeds], tmp_path / "out")
    return run.report, written


async def test_repair_loop_fixes_broken_code_returned_first(tmp_path):
    script = env_script()
    broken_skeleton = SKELETON.replace("def __init__(self, init_config: dict):", "def __init__(self, init_config: dict)")
    script["skeleton"].insert(0, answer({"class_name": CLASS_NAME, "code": broken_skeleton}))
    script["method"].insert(0, answer({"code": CRASHING_CANCEL}, match='"name": "cancel_booking"'))
    script["judge"].append(answer(ALL_PASS))
    with MatchingReplayServer(script) as server:
        report, written = await run_envs(server, tmp_path, [SEED], judge_threshold=0.9)
    assert written == [tmp_path / "out" / ENV_ID] and report.accepted_envs == [ENV_ID]

    skeleton_requests = server.requests_for("skeleton")
    assert len(skeleton_requests) == 2
    repair_prompt = skeleton_requests[1]["messages"][-1]["content"]
    assert "syntax error" in repair_prompt and "def __init__(self, init_config: dict)" in repair_prompt

    # The crashing method passed the static checks; the dual-agent check caught it at run time.
    cancels = [r for r in server.requests_for("method") if '"name": "cancel_booking"' in r["messages"][-1]["content"]]
    assert len(cancels) == 2
    assert "KeyError" in cancels[1]["messages"][-1]["content"] and "BK404" in cancels[1]["messages"][-1]["content"]
    assert len(server.requests_for("judge")) == 2
    assert report.stages["judge"].attempts == 2 and report.stages["judge"].accepted == 1
    assert report.stages["skeleton"].attempts == 2 and report.stages["skeleton"].accepted == 1
    code = load_bundle(tmp_path / "out" / ENV_ID).spec.env_class_code
    assert 'if booking is None:' in code and CRASHING_CANCEL.splitlines()[6].strip() not in code


@pytest.mark.parametrize("body", [
    "import os\n\ndef book_room(self, room_id: str, organizer: str, start: str, end: str, attendees: int) -> dict:\n"
    '    """Book.\n\n    Args:\n        room_id (str): Room.\n    """\n    os.system("true")\n    return {"success": True}\n',
    "def book_room(self, room_id: str, organizer: str, start: str, end: str, attendees: int) -> dict:\n"
    '    """Book.\n\n    Args:\n        room_id (str): Room.\n    """\n'
    '    open("/tmp/escaped", "w").write(room_id)\n    return {"success": True}\n',
])
async def test_policy_rejects_generated_os_import_and_open(tmp_path, body):
    script = env_script()
    script["method"] = [s for s in script["method"] if '"book_room"' not in s["match"]]
    script["method"] += [answer({"code": body}, match='"name": "book_room"') for _ in range(3)]
    with MatchingReplayServer(script) as server:
        report, written = await run_envs(server, tmp_path, [SEED], max_repairs=2)
    assert written == [] and report.accepted_envs == []
    assert [(r.subject, r.stage) for r in report.rejections] == [(ENV_ID, "method")]
    expected = "import of 'os' is not allowed" if "import os" in body else "use of 'open' is not allowed"
    assert expected in report.rejections[0].reason
    books = [r for r in server.requests_for("method") if '"name": "book_room"' in r["messages"][-1]["content"]]
    assert len(books) == 3, "the first answer and two repairs, then the env is dropped"
    assert expected in books[-1]["messages"][-1]["content"]
    assert not server.requests_for("tester"), "nothing downstream saw the rejected code"
    assert not Path("/tmp/escaped").exists()


async def test_triage_keeps_stateful_useful_distinct_topics(tmp_path):
    seeds = [SEED,
             {"task_id": "calc", "task": "Calculate (5+6)*3 for me please."},
             {"task_id": "low", "task": "Play a song on the kitchen speaker."},
             {"task_id": "dup", "task": "Reserve conference room B for Friday 10:00."}]
    script = env_script()
    script["stateful"] = [answer({"stateful": True}, match=SEED["task"]),
                          answer({"stateful": False, "reason": "pure computation"}, match="(5+6)*3"),
                          answer({"stateful": True}, match="kitchen speaker"),
                          answer({"stateful": True}, match="conference room B")]
    topic = json.loads(script["topic"][0]["content"])
    script["topic"] = [answer(topic, match=SEED["task"]),
                       answer({**topic, "env_name": "SpeakerControl", "modelability": 4}, match="kitchen speaker"),
                       answer({**topic, "env_name": "Meeting Room Booking"}, match="conference room B")]
    with MatchingReplayServer(script) as server:
        report, written = await run_envs(server, tmp_path, seeds)
    assert report.accepted_envs == [ENV_ID]
    reasons = {r.subject: (r.stage, r.reason) for r in report.rejections}
    assert reasons["calc"] == ("stateful", "pure computation")
    assert reasons["low"][0] == "topic" and "modelability 4" in reasons["low"][1]
    assert reasons["dup"] == ("topic", f"duplicate of environment {ENV_ID!r}")
    assert report.stages["stateful"].accepted == 3 and report.stages["topic"].accepted == 1
    assert len(server.requests_for("state")) == 1


def test_invalid_json_from_the_llm_is_retried_then_reported(tmp_path):
    seeds, config = write_inputs(tmp_path, json_retries=2)
    script = env_script()
    script["topic"] = [{"content": "MeetingRoomBooking, scores 8 and 9"} for _ in range(10)]
    out = tmp_path / "out"
    with MatchingReplayServer(script) as server:
        done = subprocess.run(synth_command(server, seeds, config, out), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert len(server.requests_for("topic")) == 3 and len(server.requests) == 4
    report = json.loads((out / "synth_report.json").read_text())
    assert report["accepted_envs"] == [] and report["stages"]["topic"]["invalid_answers"] == 3
    assert report["rejections"][0]["stage"] == "topic"
    assert "no valid JSON answer after 3 attempt(s)" in report["rejections"][0]["reason"]
    assert "dropped toolace_001 at topic" in done.stdout


def test_dead_endpoint_ends_the_run_with_a_partial_report(tmp_path):
    seeds, config = write_inputs(tmp_path)
    with MatchingReplayServer({}) as server:
        done = subprocess.run(synth_command(server, seeds, config, tmp_path / "out"), capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 1
    assert "failed 2 times" in done.stderr and "finished requests are cached" in done.stderr
    assert len(server.requests) == 2
    assert json.loads((tmp_path / "out" / "synth_report.json").read_text())["stages"]["stateful"]["requests"] == 2

