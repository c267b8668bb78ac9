"""Tool calls read from a model's text, and tool results written back the way chat templates expect.

SkyRL and GEM hand the adapter the model's raw text. Two formats cover the common chat templates:

- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the text
  (a last block left open is read too: generation often stops at ``</tool_call>``);
- OpenAI: the text is JSON, ``{"tool_calls": [{"id", "type": "function", "function": {"name",
  "arguments": "<json>"}}]}``, a list of such calls, or one ``{"name", "arguments"}`` object.

A call that cannot be read is an agent error: it becomes an error message the model sees in place of
a result, saying what was wrong and how to write the call.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel

__all__ = ["ParsedCall", "ParsedText", "parse_tool_calls", "hermes_results"]

Style = Literal["hermes", "openai"]

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_HOW = {
    "hermes": 'Write each call as <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>.',
    "openai": 'Write the calls as {"tool_calls": [{"type": "function", "function": {"name": "<tool>", "arguments": "{...}"}}]}.',
}


class ParsedCall(BaseModel):
    """One tool call the model wrote, or why it could not be read (``error`` set, ``name`` may be empty)."""

    call_id: str
    name: str = ""
    arguments: dict[str, Any] = {}
    error: str | None = None


class ParsedText(BaseModel):
    """What one model turn holds: its tool calls in order (none: the turn is a plain answer)."""

    style: Style | None = None
    calls: list[ParsedCall] = []


def parse_tool_calls(text: str) -> ParsedText:
    """The tool calls in ``text``, in the Hermes/Qwen or the OpenAI format; none when it is a plain answer."""
    if "<tool_call>" in text:
        blocks = _HERMES_BLOCK.findall(text)
        return ParsedText(style="hermes", calls=[_read_call(block, n, "hermes") for n, block in enumerate(blocks, 1)])
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return ParsedText()
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError as e:
        if '"tool_calls"' in stripped or '"name"' in stripped:
            return ParsedText(style="openai", calls=[_malformed(1, f"it is not valid JSON ({e.msg} at position {e.pos})", "openai")])
        return ParsedText()
    items = value.get("tool_calls") if isinstance(value, dict) and "tool_calls" in value else value
    if isinstance(items, dict) and ("name" in items or "function" in items):
        items = [items]
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) and ("name" in i or "function" in i) for i in items):
        if isinstance(value, dict) and "tool_calls" in value:
            return ParsedText(style="openai", calls=[_malformed(1, "tool_calls must be a list of calls with a name", "openai")])
        return ParsedText()  # JSON that is not a call: the model's answer
    return ParsedText(style="openai", calls=[_read_call(item, n, "openai") for n, item in enumerate(items, 1)])


def _malformed(number: int, problem: str, style: Style) -> ParsedCall:
    return ParsedCall(call_id=f"call_{number}", error=f"Error: tool call {number} could not be read: {problem}. {_HOW[style]}")


def _read_call(raw: str | dict[str, Any], number: int, style: Style) -> ParsedCall:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw.strip())
        except json.JSONDecodeError as e:
            return _malformed(number, f"it is not valid JSON ({e.msg} at position {e.pos})", style)
    if not isinstance(raw, dict):
        return _malformed(number, "it must be a JSON object", style)
    call_id = raw.get("id") if isinstance(raw.get("id"), str) else f"call_{number}"
    function = raw.get("function") if isinstance(raw.get("function"), dict) else raw
    name, arguments = function.get("name"), function.get("arguments", function.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return _malformed(number, "it has no tool name", style)
    if isinstance(arguments, str):
        # OpenAI sends arguments as a JSON string; some models do so in Hermes blocks too.
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            return ParsedCall(call_id=call_id, name=name, error=f"Error: the arguments of {name!r} are not valid JSON ({e.msg} at position {e.pos}). {_HOW[style]}")
    if not isinstance(arguments, dict):
        return ParsedCall(call_id=call_id, name=name, error=f"Error: the arguments of {name!r} must be a JSON object. {_HOW[style]}")
    return ParsedCall(call_id=call_id, name=name, arguments=arguments)


def hermes_results(texts: list[str]) -> str:
    """Tool results as Qwen's and Hermes' templates render tool messages: one ``<tool_response>`` block each."""
    return "\n".join(f"<tool_response>\n{text}\n</tool_response>" for text in texts)
