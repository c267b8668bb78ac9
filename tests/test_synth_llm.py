"""Stage requests over real HTTP: invalid JSON re-asked then reported, bounded retries, disk cache."""

from __future__ import annotations

import json

import pytest

from synth.cache import DiskCache
from envscaler.errors import LlmUnavailable
from synth.errors import InvalidAnswer
from synth.llm import StageLlm, parse_object
from synth.models import RunReport, SynthConfig, TopicAnswer
from synth.prompts import render
from tests.support.openai_replay import ReplayServer
from tests.support.synth_script import stage_models

pytestmark = pytest.mark.anyio

TOPIC = {"env_name": "MeetingRoomBooking", "summary": "Rooms.", "usefulness": 8, "modelability": 9}


def make_llm(server: ReplayServer, tmp_path, **settings) -> StageLlm:
    settings = {"retries": 1, **settings}
    config = SynthConfig(base_url=server.base_url, stages=stage_models(), backoff_s=0.01, **settings)
    return StageLlm(config, DiskCache(tmp_path / "cache"), RunReport())


def topic_messages(task: str = "Book a room for six.") -> list[dict[str, str]]:
    return render("topic", task=task, apis="(none)")


def test_parse_object_accepts_fences_and_rejects_the_rest():
    assert parse_object('```json\n{"a": 1}\n```') == {"a": 1}
    for bad, message in [("", "empty"), ("{'a': 1}", "not valid JSON"), ("[1, 2]", "expected a JSON object")]:
        with pytest.raises(ValueError, match=message):
            parse_object(bad)


async def test_invalid_json_is_sent_back_with_the_problem_then_accepted(tmp_path):
    with ReplayServer({"topic": [{"content": "Sure! Here is the topic: MeetingRoomBooking"},
                                 {"content": json.dumps({**TOPIC, "usefulness": 11})},
                                 {"content": json.dumps(TOPIC)}]}) as server:
        llm = make_llm(server, tmp_path)
        answer = await llm.ask("topic", TopicAnswer, topic_messages(), "seed-1")
        await llm.aclose()
    assert answer.env_name == "MeetingRoomBooking"
    assert len(server.requests) == 3
    second, third = server.requests[1]["messages"], server.requests[2]["messages"]
    assert second[-2] == {"role": "assistant", "content": "Sure! Here is the topic: MeetingRoomBooking"}
    assert "not valid JSON" in second[-1]["content"]
    assert "usefulness" in third[-1]["content"] and "less than or equal to 10" in third[-1]["content"]
    assert llm.stats("topic").invalid_answers == 2 and llm.stats("topic").requests == 3


async def test_invalid_json_forever_is_reported_after_a_bounded_number_of_requests(tmp_path):
    garbage = [{"content": "I cannot answer in JSON."} for _ in range(20)]
    with ReplayServer({"topic": garbage}) as server:
        llm = make_llm(server, tmp_path, json_retries=2)
        with pytest.raises(InvalidAnswer) as caught:
            await llm.ask("topic", TopicAnswer, topic_messages(), "seed-1")
        await llm.aclose()
    assert len(server.requests) == 3, "one request and two re-asks, never more"
    assert len(server.scripts["topic"]) == 17
    assert caught.value.stage == "topic" and caught.value.attempts == 3
    assert "not valid JSON" in str(caught.value)


async def test_transient_errors_back_off_and_a_dead_endpoint_stops_the_run(tmp_path):
    with ReplayServer({"topic": [{"status": 429}, {"status": 503}, {"content": json.dumps(TOPIC)}],
                       "state": [{"status": 500} for _ in range(10)]}) as server:
        llm = make_llm(server, tmp_path, retries=2)
        answer = await llm.ask("topic", TopicAnswer, topic_messages(), "seed-1")
        with pytest.raises(LlmUnavailable, match="failed 3 time"):
            await llm.complete("state", render("state", env_name="X", summary="s", task="t"))
        await llm.aclose()
    assert answer.usefulness == 8
    assert llm.stats("topic").http_retries == 2
    assert len(server.requests_for("state")) == 3


async def test_a_refused_request_stops_at_once(tmp_path):
    with ReplayServer({"topic": [{"status": 401, "message": "bad key"}]}) as server:
        llm = make_llm(server, tmp_path, retries=5)
        with pytest.raises(LlmUnavailable, match="HTTP 401"):
            await llm.complete("topic", topic_messages())
        await llm.aclose()
    assert len(server.requests) == 1


async def test_answers_come_from_disk_on_the_second_ask(tmp_path):
    with ReplayServer({"topic": [{"content": json.dumps(TOPIC)}]}) as server:
        first = make_llm(server, tmp_path)
        await first.ask("topic", TopicAnswer, topic_messages(), "seed-1")
        again = make_llm(server, tmp_path)
        answer = await again.ask("topic", TopicAnswer, topic_messages(), "seed-1")
        with pytest.raises(LlmUnavailable):
            await again.ask("topic", TopicAnswer, topic_messages("Another task entirely."), "seed-2")
        await first.aclose()
        await again.aclose()
    assert answer.modelability == 9
    assert again.stats("topic").cached == 1
    assert [r["messages"][-1]["content"] for r in server.requests[:1]] == [topic_messages()[-1]["content"]]
    assert len(server.requests) == 3, "one answered request, then the new task's request and its retry"
