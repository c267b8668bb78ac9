"""A run file as an Inspect AI evaluation log, for ``inspect view``, Docent and Inspect Scout.

Written with ``inspect_ai``'s own types and writer (the ``[inspect]`` extra), so the file is whatever
that version of Inspect reads. One log per run file; one sample per episode: the sample id is
``ENV/TASK``, the epoch is the repeat + 1, the target is the scenario's checklist, and the score
``checks`` is the reward with each check's verdict in its metadata (and, for a scenario with scripted
user turns, each check's turn and each turn's result: the messages hold every user turn). An episode that could not be
judged (infra error) is a sample with an error and no score, as Inspect records a failed sample.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_client.errors import HarnessError
from agent_client.models import Record

if TYPE_CHECKING:
    from inspect_ai.log import EvalLog, EvalSample

SCORER = "checks"


def _inspect():
    """The ``inspect_ai`` modules this writer uses; HarnessError saying how to install them when absent."""
    try:
        import inspect_ai.log as log
        import inspect_ai.model as model
        import inspect_ai.scorer as scorer
        import inspect_ai.tool as tool
    except ImportError:
        raise HarnessError("--format inspect needs inspect-ai: pip install 'envscaler-farm[inspect]' "
                           "(or pip install 'inspect-ai>=0.3,<0.4')") from None
    return log, model, scorer, tool


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()


def _arguments(raw: Any) -> tuple[dict[str, Any], str | None]:
    """A tool call's arguments as Inspect holds them: an object, or ``{}`` and why the text was not one."""
    if isinstance(raw, dict):
        return raw, None
    try:
        parsed = json.loads(raw or "{}")
    except (TypeError, json.JSONDecodeError) as e:
        return {}, f"arguments are not JSON: {e}"
    return (parsed, None) if isinstance(parsed, dict) else ({}, "arguments are not a JSON object")


def _messages(record: Record) -> list[Any]:
    """The episode's OpenAI chat messages as Inspect chat messages, each failed tool call marked with its cause.

    Tool results are matched to the server's trajectory in order (one tool message per call); where the
    counts differ (an agent whose calls did not all reach the server) no call is marked.
    """
    _, model, _, tool = _inspect()
    names: dict[str, str] = {}
    tool_messages = [m for m in record.messages if m.get("role") == "tool"]
    outcomes = iter(record.trajectory if len(record.trajectory) == len(tool_messages) else [None] * len(tool_messages))
    converted = []
    for message in record.messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "system":
            converted.append(model.ChatMessageSystem(content=content))
        elif role == "user":
            converted.append(model.ChatMessageUser(content=content))
        elif role == "assistant":
            calls = []
            for call in message.get("tool_calls") or []:
                function = call.get("function", {})
                names[call.get("id", "")] = function.get("name", "")
                arguments, problem = _arguments(function.get("arguments"))
                calls.append(tool.ToolCall(id=call.get("id", ""), function=function.get("name", ""), arguments=arguments,
                                           parse_error=problem))
            converted.append(model.ChatMessageAssistant(content=content, tool_calls=calls or None, model=record.model or record.agent))
        elif role == "tool":
            outcome = next(outcomes)
            error = None
            if outcome is not None and outcome.error is not None:
                kind = "timeout" if outcome.error_kind == "timeout" else "unknown"
                error = tool.ToolCallError(kind, f"{outcome.error_kind} error: {outcome.error}")
            converted.append(model.ChatMessageTool(content=content, tool_call_id=message.get("tool_call_id"),
                                                   function=names.get(message.get("tool_call_id") or ""), error=error,
                                                   metadata={"error_kind": outcome.error_kind} if error else None))
    return converted


def _sample(record: Record) -> EvalSample:
    log, model, scorer, _ = _inspect()
    name = record.model or f"envscaler/{record.agent}"
    task = next((m.get("content") for m in record.messages if m.get("role") == "user"), None) or ""
    answer = next((m.get("content") for m in reversed(record.messages) if m.get("role") == "assistant" and m.get("content")), "")
    scores = None
    if record.judged:
        explanation = "\n".join(f"{'pass' if c.passed else 'FAIL'}: " + (f"turn {c.turn}: " if c.turn is not None else "")
                                + c.check_item + (f" ({c.error})" if c.error else "") for c in record.checks)
        metadata: dict[str, Any] = {"success": record.reward == 1.0, "checks": [c.model_dump() for c in record.checks]}
        if record.turns:
            metadata["turns"] = [t.model_dump(exclude={"episode_id"}) for t in record.turns]
        scores = {SCORER: scorer.Score(value=record.reward, answer=answer, explanation=explanation, metadata=metadata)}
    usage = record.usage
    return log.EvalSample(
        id=f"{record.env_id}/{record.task_id}", epoch=record.repeat + 1, input=task,
        target=[c.check_item for c in record.checks], messages=_messages(record),
        output=model.ModelOutput.from_content(name, answer), scores=scores,
        metadata={"env_id": record.env_id, "task_id": record.task_id, "repeat": record.repeat, "agent": record.agent,
                  "model": record.model, "episode_id": record.episode_id, "termination": record.termination,
                  "steps": record.steps, "agent_errors": record.agent_errors, "env_errors": record.env_errors,
                  "tool_errors": record.tool_errors,
                  "tool_calls": [c.model_dump(include={"name", "error_kind", "error", "latency_s", "diff"}) for c in record.trajectory]},
        model_usage={name: model.ModelUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                            total_tokens=usage.prompt_tokens + usage.completion_tokens)} if usage.requests else {},
        started_at=_iso(record.started_at), completed_at=_iso(record.started_at + record.duration_s),
        total_time=record.duration_s,
        error=log.EvalError(message=record.error or "infra error", traceback="", traceback_ansi="") if record.infra_failed else None,
    )


def eval_log(records: list[Record], source: Path) -> EvalLog:
    """The Inspect log of the run ``records`` read from ``source``."""
    if not records:
        raise HarnessError(f"{source}: no run records to export")
    log, _, _, _ = _inspect()
    agents = sorted({r.agent for r in records})
    models = sorted({r.model for r in records if r.model})
    name = models[0] if len(models) == 1 else f"envscaler/{'+'.join(agents)}"
    samples = [_sample(r) for r in sorted(records, key=lambda r: (r.env_id, r.task_id, r.repeat))]
    scored = [r for r in records if r.judged]
    metrics = {"mean": log.EvalMetric(name="mean", value=sum(r.reward or 0.0 for r in scored) / len(scored) if scored else 0.0),
               "success": log.EvalMetric(name="success", value=sum(r.reward == 1.0 for r in scored) / len(scored) if scored else 0.0)}
    started = min(r.started_at for r in records)
    ended = max(r.started_at + r.duration_s for r in records)
    ids = sorted({s.id for s in samples})
    return log.EvalLog(
        status="success",
        eval=log.EvalSpec(created=_iso(started), task=f"envscaler/{source.stem}", dataset=log.EvalDataset(
            name=source.stem, location=str(source), samples=len(ids), sample_ids=ids), model=name,
            config=log.EvalConfig(epochs=max(r.repeat for r in records) + 1),
            metadata={"agents": agents, "models": models, "env_ids": sorted({r.env_id for r in records})}),
        results=log.EvalResults(total_samples=len(records), completed_samples=len(scored),
                                scores=[log.EvalScore(name=SCORER, scorer=SCORER, scored_samples=len(scored),
                                                      unscored_samples=len(records) - len(scored), metrics=metrics)]),
        stats=log.EvalStats(started_at=_iso(started), completed_at=_iso(ended)),
        samples=samples,
    )


def write_inspect_log(records: list[Record], source: Path, target: Path) -> None:
    """Write the Inspect log of ``records`` to ``target`` (``.eval``: Inspect's zip format; ``.json``: plain JSON)."""
    if target.suffix not in (".eval", ".json"):
        raise HarnessError(f"--out {target}: an Inspect log ends in .eval (Inspect's own format) or .json")
    log, _, _, _ = _inspect()
    target.parent.mkdir(parents=True, exist_ok=True)
    log.write_eval_log(eval_log(records, source), str(target))
