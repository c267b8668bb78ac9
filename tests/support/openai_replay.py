"""A real OpenAI-compatible HTTP server that replays scripted chat completions.

Tests start it on a free port (``with ReplayServer(scripts) as server: server.base_url``) and point
real clients (the ``openai`` package, ``envscaler run``, ``envscaler synth``) at it. Each model name
has its own script, a list of steps served in order; a model without a script uses ``"*"``.

A step is one of:
- ``{"content": "text"}``: an assistant message;
- ``{"tool_calls": [{"name": "add", "arguments": {"n": 1}}]}``: tool calls (``arguments`` may be a
  raw string, to script malformed JSON), optionally with ``content``;
- ``{"status": 429}`` (or any status): an HTTP error with an OpenAI-style error body, with the
  response headers in ``"headers"`` if given (``{"status": 429, "headers": {"retry-after": "1"}}``);
- ``{"delay_s": 0.5, ...}``: wait first, combined with any of the above.

Every request body is recorded in ``server.requests`` (and when it arrived, in ``server.arrivals``)
so tests can count and inspect them. When a
script runs out the server answers 500 with a message naming the model, so a test never hangs.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import anyio
import uvicorn

Step = dict[str, Any]


class ReplayServer:
    """Serve ``POST /v1/chat/completions`` from scripts, on 127.0.0.1 in a background thread."""

    def __init__(self, scripts: dict[str, list[Step]] | None = None) -> None:
        self.scripts: dict[str, list[Step]] = {model: list(steps) for model, steps in (scripts or {}).items()}
        self.requests: list[dict[str, Any]] = []
        self.arrivals: list[float] = []
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def add(self, model: str, *steps: Step) -> None:
        """Append steps to a model's script (also while the server runs)."""
        with self._lock:
            self.scripts.setdefault(model, []).extend(steps)

    def requests_for(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r.get("model") == model]

    def __enter__(self) -> ReplayServer:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app, log_level="warning", lifespan="off", interface="asgi3")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the replay server did not start within 10 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def _next_step(self, model: str) -> Step | None:
        with self._lock:
            key = model if model in self.scripts else "*"
            steps = self.scripts.get(key, [])
            return steps.pop(0) if steps else None

    async def _app(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] != "POST" or not scope["path"].endswith("/chat/completions"):
            await _respond(send, 404, {"error": {"message": f"no route {scope['path']}", "type": "not_found"}})
            return
        request = json.loads(body)
        with self._lock:
            self.requests.append(request)
            self.arrivals.append(time.monotonic())
        model = request.get("model", "")
        step = self._next_step(model)
        if step is None:
            await _respond(send, 500, {"error": {"message": f"replay script for model {model!r} is exhausted",
                                                 "type": "server_error"}})
            return
        if step.get("delay_s"):
            await anyio.sleep(step["delay_s"])
        if "status" in step:
            await _respond(send, step["status"], {"error": {"message": step.get("message", "scripted error"),
                                                            "type": "scripted"}}, step.get("headers"))
            return
        await _respond(send, 200, _completion(model, step, len(self.requests)))


def _completion(model: str, step: Step, number: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": step.get("content")}
    calls = step.get("tool_calls") or []
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{number}_{i}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": call["arguments"] if isinstance(call.get("arguments"), str)
                    else json.dumps(call.get("arguments", {})),
                },
            }
            for i, call in enumerate(calls)
        ]
    return {
        "id": f"chatcmpl-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


async def _respond(send: Any, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    body = json.dumps(payload).encode()
    extra = [(name.encode(), value.encode()) for name, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})
