"""The simulated user of conversational scenarios: an LLM that holds the task and the user profile.

It reveals the task turn by turn, answers only from what it was given, and ends the conversation
with ``###STOP###`` once its request is handled (or cannot be).
"""

from __future__ import annotations

from typing import Any

from agent_client.llm import LlmEndpoint, complete
from agent_client.models import Usage

STOP = "###STOP###"

USER_PROMPT = """You play a customer talking to a service agent. Stay in character.

Your profile:
{profile}

What you want (your task; do not reveal it all at once):
{task}

Rules:
- Write only your next message to the agent, in the first person, short and natural.
- Reveal the details of your task step by step, when they are relevant or asked for.
- Never invent facts (ids, names, numbers) that are not in your profile or task; if asked for one you do not have, say you do not know.
- When your request has been fully handled, or the agent says it cannot be done, reply with exactly {stop}
"""


class SimulatedUser:
    """One conversation's user; the agent's messages come in, the user's replies go out."""

    def __init__(self, endpoint: LlmEndpoint, task: str, profile: str) -> None:
        self.endpoint = endpoint
        self.client = endpoint.client()
        self.history: list[dict[str, Any]] = [{"role": "system", "content": USER_PROMPT.format(profile=profile, task=task, stop=STOP)}]

    async def start(self, usage: Usage) -> str:
        """The user's opening message."""
        reply, _ = await self._say("(The agent greets you: 'Hello, how can I help you today?')", usage)
        return reply

    async def reply(self, agent_message: str, usage: Usage) -> tuple[str, bool]:
        """(the user's answer to the agent, whether the user ended the conversation)."""
        return await self._say(agent_message, usage)

    async def _say(self, agent_message: str, usage: Usage) -> tuple[str, bool]:
        # Roles are mirrored: to the user model, the agent is the one speaking to it.
        self.history.append({"role": "user", "content": agent_message})
        response = await complete(self.endpoint, self.client, usage, messages=self.history)
        text = (response.choices[0].message.content or "").strip()
        self.history.append({"role": "assistant", "content": text})
        return text.replace(STOP, "").strip(), STOP in text
