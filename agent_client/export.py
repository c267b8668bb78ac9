"""Turn run records into SFT files: OpenAI chat format or ShareGPT."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from agent_client.errors import HarnessError
from agent_client.models import Record
from envscaler.bundle import describe_validation_error
from envscaler.jsonl import dumps, iter_lines, validate_json

ExportFormat = Literal["openai", "sharegpt"]

_SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}


def read_records(path: Path) -> list[Record]:
    """Every record in a run file (lines split on ``"\\n"`` only); a malformed line is an error naming the line."""
    if not path.exists():
        raise HarnessError(f"{path}: no such run file")
    records = []
    for number, line in iter_lines(path):
        if not line.strip():
            continue
        try:
            records.append(validate_json(Record, line))
        except ValidationError as e:
            # The whole reason, with its position: the first line of pydantic's text is only a count.
            raise HarnessError(f"{path}:{number}: not a run record: {describe_validation_error(e)}") from None
    return records


def to_sharegpt(record: Record) -> dict[str, Any]:
    conversations = []
    for message in record.messages:
        value = message.get("content") or ""
        if message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")
                      if _is_json(c["function"]["arguments"]) else c["function"]["arguments"]} for c in message["tool_calls"]]
            conversations.append({"from": "function_call", "value": json.dumps(calls if len(calls) > 1 else calls[0])})
            if not value:
                continue
        conversations.append({"from": _SHAREGPT_ROLE[message["role"]], "value": value})
    return {"conversations": conversations, "tools": json.dumps(record.tools)}


def _is_json(text: str) -> bool:
    try:
        json.loads(text or "{}")
        return True
    except json.JSONDecodeError:
        return False


def rewarded(records: list[Record], min_reward: float) -> list[Record]:
    """The judged records whose reward is ``min_reward`` or more, in order."""
    return [r for r in records if r.judged and (r.reward or 0.0) >= min_reward]


def export(source: Path, target: Path, *, min_reward: float, fmt: ExportFormat) -> tuple[int, int]:
    """Write records with reward >= ``min_reward`` to ``target``; (written, read)."""
    records = read_records(source)
    kept = rewarded(records, min_reward)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", encoding="utf-8") as sink:
        for record in kept:
            item = {"messages": record.messages, "tools": record.tools} if fmt == "openai" else to_sharegpt(record)
            sink.write(dumps(item) + "\n")
    return len(kept), len(records)
