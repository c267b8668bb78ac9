"""Stage prompts: one template file per stage under ``synth/prompts/``, rendered to chat messages.

Templates use ``$name`` placeholders (``string.Template``) so that the JSON braces in them need no
escaping. Values that are not strings are inserted as indented JSON.
"""

from __future__ import annotations

import functools
import json
import string
from importlib import resources
from typing import Any

ENV_STAGES = ("stateful", "topic", "state", "skeleton", "operations", "method", "tester", "judge")
SCENARIO_STAGES = ("initial_state", "task", "checklist", "check_funcs", "reference", "scenario_repair")
STAGES = ENV_STAGES + SCENARIO_STAGES


@functools.cache
def template(name: str) -> string.Template:
    """The template ``synth/prompts/<name>.md``."""
    text = resources.files("synth").joinpath("prompts", f"{name}.md").read_text(encoding="utf-8")
    return string.Template(text)


def as_text(value: Any) -> str:
    """A value as prompt text: strings as they are, anything else as indented JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=1, ensure_ascii=False)


def feedback_text(problems: list[str], previous: Any = None, attempt: int = 1) -> str:
    """The section that sends a failed draft and its problems back to the LLM ("" when there are none).

    ``attempt`` numbers the repair: a second identical failure still makes a new request, not a
    cache hit on the first repair's answer.
    """
    if not problems:
        return ""
    lines = "\n".join(f"- {p}" for p in problems)
    shown = f"\nYour previous answer:\n{as_text(previous)}\n" if previous is not None else ""
    return f"{shown}\nIt was rejected (repair attempt {attempt}). Fix every problem below and answer again in full:\n{lines}\n"


def render(stage: str, feedback: list[str] | None = None, previous: Any = None, attempt: int = 1,
           **values: Any) -> list[dict[str, str]]:
    """The chat messages of one stage request: the shared system prompt and the stage's prompt.

    ``feedback`` (problems) and ``previous`` (the rejected answer) make it repair request ``attempt``.
    """
    if stage not in STAGES:
        raise KeyError(f"unknown stage {stage!r}")
    fields = {k: as_text(v) for k, v in values.items()}
    fields["feedback"] = feedback_text(feedback or [], previous, attempt)
    user = template(stage).substitute(fields).strip()
    return [{"role": "system", "content": template("system").template.strip()}, {"role": "user", "content": user}]
