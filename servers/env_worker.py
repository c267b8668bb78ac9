"""The environment worker: ``python -m servers.env_worker FD``, started by a server (``servers.worker_store``).

Everything the environment's code does happens in this process: loading the class, constructors,
tool calls, and turning what they return into JSON. It runs the same engine as a server without a
worker (``servers.episodes``: calls inline on the event loop within a budget, slow ones on call
threads, each under its limit), but keeps no trajectory, holds no token, listens on no socket and
runs no checks (``servers.check_worker`` does, on what this process says an episode changed): it
answers the server's requests on the inherited socket FD (``servers.worker_wire``).

The server kills this process (its whole process group) when an answer is overdue, or when a call
outlived its limit on a thread that cannot be stopped, and starts a new one, where it rebuilds the
episodes held here from their calls. So whatever the code does here (ignore SIGALRM, hold the GIL in
a C loop, exit, crash, fork) costs at most the call that did it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from typing import Any

from envscaler import EnvCodeError, EnvRuntime, ToolOutcome
from envscaler.errors import ChecklistError
from envscaler.guard import keep_alarm_handler, protect_time_limits
from servers.episodes import EpisodeStore, LiveEpisode
from servers.event_loop import loop_factory
from servers.memory import memory_status
from servers.errors import CallAbandoned, EpisodeLost, OutOfMemory, UnknownEpisode, UnknownScenario
from servers.worker_process import child_main
from servers.worker_wire import (
    FAILED,
    HELLO_ID,
    OK,
    FrameReader,
    InlineMark,
    WorkerFailure,
    WorkerHello,
    WorkerOutcome,
    WorkerRequest,
    WorkerSettings,
    EpisodeFinal,
    decode,
    frame,
    outcome_digest,
    recv_frame,
)

log = logging.getLogger("envscaler.worker")

_FAILURES = (EnvCodeError, UnknownScenario, UnknownEpisode, OutOfMemory, ChecklistError, CallAbandoned, EpisodeLost)


class WorkerLink(asyncio.Protocol):
    """Reads the server's requests and writes each answer as one frame.

    A tool call whose episode is free and that ends within the inline budget (almost every call) is
    answered right where its frame is read; anything else runs as a task. The answers ready by the
    end of one read go out in one write: under load, one system call carries many answers.
    """

    def __init__(self, store: MarkedEpisodeStore, closed: asyncio.Future[None]) -> None:
        self.store = store
        self.closed = closed
        self.transport: asyncio.Transport | None = None
        self.frames = FrameReader()
        self.outbox: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        # The server is trusted and caps its own frames: a FrameTooLarge here is a bug, and ends the worker.
        loop = asyncio.get_running_loop()
        for request_id, _, payload in self.frames.feed(data):
            try:
                request = decode(WorkerRequest, payload)
            except Exception as e:  # noqa: BLE001 - a request this worker cannot read costs only its answer
                self.outbox.append(frame(request_id, WorkerFailure(error="EnvCodeError", message=f"unreadable request: {e}"), FAILED))
                continue
            answer = self.answer_now(request)
            if answer is None:
                loop.create_task(self.answer(request_id, request))
            else:
                self.outbox.append(frame(request_id, answer))
        self.flush()

    def flush(self) -> None:
        if self.outbox and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.outbox))
        self.outbox.clear()

    def answer_now(self, request: WorkerRequest) -> WorkerOutcome | None:
        """The answer to a tool call that could run to its end at once, else None."""
        if request.op != "call":
            return None
        live = self.store.episodes.get(request.episode_id)
        if live is None:
            return None
        outcome = self.store.call_now(live, request.name, request.arguments)
        return None if outcome is None else _answer(outcome, stuck=False)

    async def answer(self, request_id: int, request: WorkerRequest) -> None:
        try:
            answer, status = await self.run(request), OK
        except _FAILURES as e:
            kind = next(cls.__name__ for cls in _FAILURES if isinstance(e, cls))
            answer, status = WorkerFailure(error=kind, message=str(e)), FAILED  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - whatever else environment code made of this request
            message = f"{self.store.env_id}: {request.op} failed: {type(e).__name__}: {e}"
            answer, status = WorkerFailure(error="EnvCodeError", message=message), FAILED
        self.outbox.append(frame(request_id, answer, status))
        self.flush()

    async def run(self, request: WorkerRequest) -> Any:
        """What ``request`` asks for, as a model or plain data."""
        store = self.store
        if request.op == "call":
            live = store.get(request.episode_id)
            outcome = await store.call_tool(live, request.name, request.arguments)
            return _answer(outcome, stuck=live.stuck)
        if request.op == "create":  # of a new episode, or again of one this worker holds (a reset)
            await self.build(request)
            return {}
        if request.op == "replay":
            await self.replay(request)
            return {}
        if request.op == "final":
            return await self.final(store.get(request.episode_id))
        if request.op == "initial":
            live = store.get(request.episode_id)
            assert live.episode is not None
            return live.episode.initial_state()
        if request.op == "state":
            return await store.state(store.get(request.episode_id))
        if request.op == "end":
            if request.episode_id in store.episodes:
                store.end(request.episode_id)
            return {}
        stats = await store.stats()  # stats: with the memory the episodes live in
        return stats.model_copy(update={"memory": memory_status()})


    async def final(self, live: LiveEpisode) -> EpisodeFinal:
        """The episode's state as its checks will see it (under the call limit: a private state's
        conversion to JSON may run environment code, a ``__repr__``)."""
        episode = live.episode
        assert episode is not None

        def read() -> EpisodeFinal:
            changes = episode.changes()
            if changes is None:
                return EpisodeFinal(state_hash=episode.state_hash(), final=episode.state(), initial=episode.initial_state())
            return EpisodeFinal(state_hash=episode.state_hash(), initial_hash=episode.initial_hash(), changes=changes)

        async with live.lock:
            return await self.store.runner.run(read, self.store.runtime.call_timeout_s)

    async def build(self, request: WorkerRequest) -> LiveEpisode:
        """The episode built from the request's scenario (or init_config), new or in place of the one held."""
        store = self.store
        live = store.episodes.get(request.episode_id)
        if live is None:
            return await store.create(request.scenario_id, request.init_config, request.episode_id)
        await store.reset(live, request.scenario_id, request.init_config)
        return live

    async def replay(self, request: WorkerRequest) -> None:
        """Build the episode, then run its calls again; EpisodeLost when one comes out differently."""
        live = await self.build(request)
        for number, call in enumerate(request.calls, 1):
            outcome = await self.store.call_tool(live, call.name, call.arguments)
            if outcome_digest(outcome) != call.digest or live.stuck:
                self.store.end(live.episode_id)
                what = f"an error: {outcome.error}" if outcome.error else "a different change of state"
                raise EpisodeLost(f"replaying call {number} of {len(request.calls)} ({call.name}) gave {what} "
                                  "(the environment does not answer the same calls the same way)")


class MarkedEpisodeStore(EpisodeStore):
    """The engine, marking the episode whose call runs inline on the event loop (the server reads the
    mark when this process freezes or dies, to know which request to blame)."""

    def __init__(self, *args: Any, mark: InlineMark | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mark = mark

    def _call_inline(self, live: LiveEpisode, name: str, arguments: Any) -> ToolOutcome | None:
        if self.mark is None:
            return super()._call_inline(live, name, arguments)
        self.mark.set(live.episode_id)
        try:
            return super()._call_inline(live, name, arguments)
        finally:
            self.mark.clear()


def _answer(outcome: ToolOutcome, *, stuck: bool) -> WorkerOutcome:
    return WorkerOutcome(outcome=outcome, text=outcome.result_text, digest=outcome_digest(outcome), stuck=stuck)


def _read_settings(sock: socket.socket) -> WorkerSettings:
    """The first frame in, read before the event loop exists."""
    try:
        _, _, payload = recv_frame(sock)
    except EOFError:
        raise SystemExit(0) from None  # the server went away before we started
    return decode(WorkerSettings, payload)


def run_worker(sock: socket.socket) -> None:
    """Load the environment named by the server's settings, say hello, answer requests until EOF."""
    settings = _read_settings(sock)
    protect_time_limits()
    bundle = settings.bundle
    try:
        runtime = EnvRuntime(bundle.spec, call_timeout_s=settings.call_timeout_s, check_timeout_s=settings.check_timeout_s,
                             max_result_chars=settings.max_result_chars)
    except Exception as e:  # noqa: BLE001 - loading is environment code: report it to the server, then stop
        sock.sendall(frame(HELLO_ID, WorkerFailure(error="EnvCodeError", message=f"{bundle.env_id}: {e}"), FAILED))
        raise SystemExit(1) from None
    mark = InlineMark(settings.mark_fd) if settings.mark_fd is not None else None
    store = MarkedEpisodeStore(bundle, runtime, max_episodes=2**31, idle_ttl_s=float("inf"), worker_threads=settings.worker_threads,
                               inline_budget_s=settings.inline_budget_s, memory_reserve_mb=settings.memory_reserve_mb, records=False,
                               mark=mark)
    keep_alarm_handler()
    hello = WorkerHello(tools=runtime.tool_list(), annotations=runtime.annotations)
    sock.sendall(frame(HELLO_ID, hello))
    sock.setblocking(False)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()
        await loop.connect_accepted_socket(lambda: WorkerLink(store, closed), sock=sock)
        await closed

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(serve())


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m servers.env_worker FD`` (FD: the server's end of a socket pair)."""
    return child_main("servers.env_worker", run_worker, argv)


if __name__ == "__main__":
    sys.exit(main())
