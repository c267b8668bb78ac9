"""Agents the harness can run: each drives one episode through its MCP tools and returns its messages.

- ``replay``: the scenario's reference solution (offline, the default);
- ``random``: random tools with schema-valid random arguments (a floor to compare against);
- ``openai``: any OpenAI-compatible chat model with native tool calls;
- ``command``: any external MCP-capable program, given the MCP URL and the task.

Every agent writes OpenAI chat ``messages`` (system, user, assistant with ``tool_calls``, tool), so
records are ready for SFT whoever produced them.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from agent_client.llm import LlmEndpoint, complete
from agent_client.models import AgentResult
from agent_client.remote import EnvControl, McpTools
from agent_client.user import SimulatedUser
from envscaler.jsonl import replace_surrogates
from envscaler.models import Scenario, Turn
from envscaler.wire import EpisodeCreated, TurnEnded

SYSTEM_PROMPT = (
    "You are an agent operating the following system through its tools.\n\n{introduction}\n\n"
    "Use the tools to do what the user asks. Follow the system's rules. When you are done, answer without a tool call."
)


@dataclass
class EpisodeContext:
    """Everything an agent may use for one episode."""

    env_id: str
    task_id: str
    info: EpisodeCreated
    tools: McpTools
    control: EnvControl
    max_steps: int
    user: SimulatedUser | None = None
    seed: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)
    # What the server answered as each scripted user turn ended, in order.
    turns_ended: list[TurnEnded] = field(default_factory=list)
    # Where in ``messages`` the agent's texts not yet passed to the server start.
    replies_from: int = 0

    def opening(self, first_user_message: str) -> list[dict[str, Any]]:
        self.messages = [
            {"role": "system", "content": SYSTEM_PROMPT.format(introduction=self.info.env_introduction)},
            {"role": "user", "content": first_user_message},
        ]
        self.replies_from = 0
        return self.messages

    @property
    def scripted(self) -> bool:
        """True when the scenario has scripted user turns (the server holds the next user messages)."""
        return self.info.turns > 0

    def pending_replies(self) -> list[str]:
        """The agent's texts to the user since its last ended turn: what the checks read as ``agent_replies``."""
        return agent_texts(self.messages[self.replies_from:])

    async def end_turn(self) -> str | None:
        """End the current scripted user turn (the agent answered without a tool call): the user's next
        message, added to ``messages``; None when no turn is left, or the scenario has none."""
        if len(self.turns_ended) >= self.info.turns:
            return None
        ended = await self.control.end_turn(self.info.episode_id, self.pending_replies())
        self.turns_ended.append(ended)
        self.replies_from = len(self.messages)
        if ended.next_message is not None:
            self.messages.append({"role": "user", "content": ended.next_message})
        return ended.next_message


def agent_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The agent's texts to the user in ``messages`` (its non-empty assistant contents), as checks read them."""
    return [m["content"] for m in messages if m.get("role") == "assistant" and isinstance(m.get("content"), str) and m["content"]]


def texts_by_turn(messages: list[dict[str, Any]]) -> list[list[str]]:
    """The agent's texts to the user, one list per user turn (a user message after the first starts the next)."""
    starts = [i for i, m in enumerate(messages) if m.get("role") == "user"][1:]
    bounds = [0, *starts, len(messages)]
    return [agent_texts(messages[start:end]) for start, end in zip(bounds, bounds[1:])]


class Agent(Protocol):
    name: str
    # True when the agent holds a conversation: a scenario's simulated user then speaks to it.
    converses: bool
    # What else tells this agent's runs apart (the model, the command line); None when nothing does.
    model: str | None

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        """Drive the episode until done; tool calls go through ``ctx.tools``."""


def _tool_call(number: int, name: str, arguments: dict[str, Any] | str) -> dict[str, Any]:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{number}", "type": "function", "function": {"name": name, "arguments": raw}}


async def _run_call(ctx: EpisodeContext, call_id: str, name: str, arguments: dict[str, Any]) -> None:
    text, _ = await ctx.tools.call(name, arguments)
    ctx.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})


class ReplayAgent:
    """Runs the scenario's reference solution, one tool call per assistant turn, then answers with its
    reference reply; in a scenario with scripted user turns, each turn's reference and reply in turn."""

    name = "replay"
    converses = False
    model = None

    def __init__(self) -> None:
        # A server's scenarios do not change while it runs: each is fetched (and parsed) once per run,
        # not once per repeat.
        self._scenarios: dict[tuple[str, str], Scenario] = {}

    async def _scenario(self, ctx: EpisodeContext) -> Scenario:
        key = (ctx.env_id, ctx.task_id)
        if key not in self._scenarios:
            self._scenarios[key] = await ctx.control.scenario(ctx.task_id)
        return self._scenarios[key]

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        scenario = await self._scenario(ctx)
        ctx.opening(ctx.info.task)
        script = scenario.turns or [Turn(message=scenario.task, reference_solution=scenario.reference_solution,
                                         reference_reply=scenario.reference_reply)]
        steps = 0
        for turn in script:
            for call in turn.reference_solution or []:
                if steps >= ctx.max_steps:
                    return AgentResult(messages=ctx.messages, termination="max_steps", steps=steps)
                steps += 1
                tool_call = _tool_call(steps, call.name, call.arguments)
                ctx.messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
                await _run_call(ctx, tool_call["id"], call.name, call.arguments)
            ctx.messages.append({"role": "assistant", "content": turn.reference_reply or "Done: the request has been carried out."})
            await ctx.end_turn()
        return AgentResult(messages=ctx.messages, termination="finished", steps=steps)


def random_value(schema: dict[str, Any], rng: random.Random) -> Any:
    """A value that satisfies a (simple) JSON schema."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = rng.choice([k for k in kind if k != "null"] or ["null"])
    if "anyOf" in schema:
        return random_value(rng.choice(schema["anyOf"]), rng)
    if kind == "integer":
        return rng.randint(0, 5)
    if kind == "number":
        return round(rng.uniform(0, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [random_value(schema.get("items", {}), rng) for _ in range(rng.randint(0, 2))]
    if kind == "object":
        properties = schema.get("properties", {})
        return {key: random_value(sub, rng) for key, sub in properties.items()}
    if kind == "null":
        return None
    return rng.choice(["A001", "1", "test", "X-100", ""])


class RandomAgent:
    """Calls random tools with random, schema-valid arguments for a few steps."""

    name = "random"
    converses = False
    model = None

    def __init__(self, steps: int = 5) -> None:
        self.steps = steps

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        """Its steps in each user turn (one turn unless the scenario scripts several), within ``max_steps`` in all."""
        rng = random.Random(f"{ctx.env_id}/{ctx.task_id}/{ctx.seed}")
        tools = await ctx.tools.list_tools()
        ctx.opening(ctx.info.task)
        steps = 0
        while True:
            for _ in range(self.steps):
                if steps >= ctx.max_steps:
                    return AgentResult(messages=ctx.messages, termination="max_steps", steps=steps)
                steps += 1
                tool = rng.choice(tools)
                schema = tool.get("inputSchema", {})
                arguments = {key: random_value(sub, rng) for key, sub in schema.get("properties", {}).items()
                             if key in schema.get("required", []) or rng.random() < 0.5}
                tool_call = _tool_call(steps, tool["name"], arguments)
                ctx.messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
                await _run_call(ctx, tool_call["id"], tool["name"], arguments)
            ctx.messages.append({"role": "assistant", "content": "Done."})
            if await ctx.end_turn() is None:
                return AgentResult(messages=ctx.messages, termination="finished", steps=steps)


class OpenAIAgent:
    """A chat model with native tool calls; several calls per turn are run in order."""

    name = "openai"
    converses = True

    def __init__(self, endpoint: LlmEndpoint) -> None:
        self.endpoint = endpoint
        self.model = endpoint.model  # recorded, and checked when a run resumes
        self.client = endpoint.client()

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        result = AgentResult()
        tools = ctx.info.tools
        if ctx.user is not None:
            first = _sendable(await ctx.user.start(result.user_usage), result)
        else:
            first = ctx.info.task
        ctx.opening(first)
        result.messages = ctx.messages
        while True:
            if result.steps >= ctx.max_steps:
                result.termination = "max_steps"
                return result
            response = await complete(self.endpoint, self.client, result.usage, messages=ctx.messages, tools=tools)
            message = response.choices[0].message
            content = _sendable(message.content, result)
            calls = [{"id": c.id, "type": "function", "function": {"name": _sendable(c.function.name, result),
                                                                  "arguments": _sendable(c.function.arguments, result)}}
                     for c in message.tool_calls or []]
            entry: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                entry["tool_calls"] = calls
            ctx.messages.append(entry)
            if not calls:
                if ctx.scripted:
                    if await ctx.end_turn() is None:
                        return result
                    continue
                if ctx.user is None:
                    return result
                reply, stop = await ctx.user.reply(content or "", result.user_usage)
                if stop:
                    result.termination = "user_stop"
                    return result
                ctx.messages.append({"role": "user", "content": _sendable(reply, result)})
                continue
            for call in calls:
                result.steps += 1
                await self._answer(ctx, call, result)

    async def _answer(self, ctx: EpisodeContext, call: dict[str, Any], result: AgentResult) -> None:
        name, raw = call["function"]["name"], call["function"]["arguments"]
        try:
            arguments = json.loads(raw or "{}")
        except json.JSONDecodeError as e:
            text = f"Error: the arguments of {name!r} are not valid JSON ({e.msg} at position {e.pos}). Send a JSON object."
            ctx.messages.append({"role": "tool", "tool_call_id": call["id"], "content": text})
            return
        if not isinstance(arguments, dict):
            ctx.messages.append({"role": "tool", "tool_call_id": call["id"], "content": "Error: arguments must be a JSON object."})
            return
        text, _ = await ctx.tools.call(name, arguments)
        ctx.messages.append({"role": "tool", "tool_call_id": call["id"], "content": _sendable(text, result)})


def _sendable(text: str | None, result: AgentResult) -> str | None:
    """``text`` as a model request can carry it (UTF-8): lone surrogates replaced by U+FFFD, counted in ``result``."""
    if text is None:
        return None
    text, replaced = replace_surrogates(text)
    result.replaced_surrogates += replaced
    return text


BASE_ENVIRONMENT = ("PATH", "HOME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "USER", "LOGNAME", "SHELL")
"""What a command agent inherits from the harness's environment (when set); nothing else unless passed by name."""


class CommandAgent:
    """Runs an external program per episode; it reaches the tools over MCP on its own.

    The template is split like a shell command and each part formatted with ``{mcp_url}``, ``{task}``,
    ``{env_id}`` and ``{task_id}``; the same values are in ``ENVSCALER_MCP_URL``, ``ENVSCALER_TASK``,
    ``ENVSCALER_ENV_ID`` and ``ENVSCALER_TASK_ID``. Exit 0 means the agent finished.

    The program is the agent under evaluation, so it gets only what it needs: those four values,
    the variables of BASE_ENVIRONMENT and the ones named in ``passed_env`` (an API key, say), and an
    empty working directory of its own. Not the harness's environment, tokens or files: the farm
    catalog holds every server's control token, which reaches the checks and reference solutions.
    """

    name = "command"
    converses = False

    def __init__(self, template: str, timeout_s: float = 600.0, passed_env: tuple[str, ...] = ()) -> None:
        self.template = shlex.split(template)
        self.model = template  # recorded, and checked when a run resumes
        self.timeout_s = timeout_s
        self.passed_env = passed_env

    def environment(self, ctx: EpisodeContext, task: str | None = None) -> dict[str, str]:
        """The command's whole environment for the episode ``ctx``, given ``task`` (the task's text when None)."""
        names = (*BASE_ENVIRONMENT, *self.passed_env)
        env = {name: os.environ[name] for name in names if name in os.environ}
        env.update(ENVSCALER_MCP_URL=ctx.info.mcp_url, ENVSCALER_TASK=ctx.info.task if task is None else task,
                   ENVSCALER_ENV_ID=ctx.env_id, ENVSCALER_TASK_ID=ctx.task_id)
        return env

    async def run(self, ctx: EpisodeContext) -> AgentResult:
        """Run the command once, or once per scripted user turn, given that turn's message as the task."""
        message: str | None = ctx.info.task
        ctx.opening(message)
        while message is not None:
            failed = await self._run_once(ctx, message)
            if failed is not None:
                return failed
            message = await ctx.end_turn()
        return AgentResult(messages=ctx.messages, termination="finished")

    async def _run_once(self, ctx: EpisodeContext, task: str) -> AgentResult | None:
        """One run of the command on ``task``; None when it finished, else the episode's end."""
        values = {"mcp_url": ctx.info.mcp_url, "task": task, "env_id": ctx.env_id, "task_id": ctx.task_id}
        command = [part.format(**values) for part in self.template]
        with tempfile.TemporaryDirectory(prefix="envscaler-agent-") as workdir:
            try:
                with anyio.fail_after(self.timeout_s):
                    done = await anyio.run_process(command, env=self.environment(ctx, task), cwd=workdir, check=False,
                                                   stdin=subprocess.DEVNULL)
            except FileNotFoundError as e:
                return AgentResult(messages=ctx.messages, termination="agent_error", error=f"cannot run {command[0]!r}: {e}")
            except TimeoutError:
                return AgentResult(messages=ctx.messages, termination="time_limit", error=f"command ran past {self.timeout_s:g} s")
        output = done.stdout.decode(errors="replace").strip()
        if output:
            ctx.messages.append({"role": "assistant", "content": output[-4000:]})
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip()[-500:]
            return AgentResult(messages=ctx.messages, termination="agent_error", error=f"exit {done.returncode}: {tail}")
        return None
