"""What the server and its environment worker process say to each other over one socket pair.

Every message is a frame: a header (payload length, request id, status) and a JSON payload. The
server sends requests (:class:`WorkerRequest`); the worker answers each one with the same request
id, in any order. The server never unpickles or evaluates what the worker sends: the worker runs
untrusted code, so its frames are parsed as JSON into the models below, with a size cap, and
anything else is a broken worker.

Any text an agent sends crosses, a lone surrogate (``"\\udfff"``) included: it is written as its JSON
escape (``servers.transport.asgi.json_bytes``) and read back by :func:`decode`.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import zlib
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from envscaler.models import Bundle, CheckContext, CheckItem, CheckResult, StateChange, ToolAnnotations, ToolOutcome, ToolSchema
from servers.episodes.calls import QUEUE_WAIT_S
from servers.transport.asgi import json_bytes

M = TypeVar("M", bound=BaseModel)

HEADER = struct.Struct(">IIB")
"""Payload length, request id, status (:data:`OK` or :data:`FAILED`)."""
OK = 0
FAILED = 1
# A frame larger than this ends the worker: no single answer is allowed to hold the server's memory.
MAX_FRAME_BYTES = 256 * 1024 * 1024
HELLO_ID = 0
"""The request id of the worker's first frame (:class:`WorkerHello`), sent unasked once it is ready."""

Operation = Literal["create", "call", "replay", "final", "initial", "state", "end", "stats"]


EXIT_FOREIGN_THREAD = 70
"""The worker's exit status when a thread that environment code started runs on after its call."""
EXIT_REASONS = {EXIT_FOREIGN_THREAD: "a thread started by environment code ran on after its call"}
"""Why a worker ends itself, by exit status (``servers.workers.process`` names it in the error)."""


class WorkerSettings(BaseModel):
    """What the worker is told when it starts (its first frame in), never through argv or environment."""

    bundle: Bundle
    # The memory file of its :class:`RunningMarks`, inherited at this descriptor.
    mark_fd: int | None = None
    call_timeout_s: float
    check_timeout_s: float
    max_result_chars: int
    worker_threads: int
    queue_wait_s: float = QUEUE_WAIT_S
    inline_budget_s: float
    memory_reserve_mb: float


class WorkerHello(BaseModel):
    """The worker's first frame out: it loaded the environment, and these are its tools."""

    tools: list[ToolSchema]
    annotations: dict[str, ToolAnnotations]


class ReplayCall(BaseModel):
    """One call of an episode as a replay runs it again: what was called, and the digest it gave."""

    name: str
    arguments: Any = None
    digest: int


class WorkerRequest(BaseModel):
    """One thing the server asks of the worker, about one episode (``stats``: about the worker).

    The episode is named by its ``handle``, which the server gives it for the workers alone: never its
    episode id, the key to its MCP endpoint (no route accepts a handle).

    ``replay`` builds the episode as ``create`` does, then runs ``calls`` again in order; each must
    come out with the digest it had (:func:`outcome_digest`), else the episode cannot be rebuilt.
    """

    op: Operation
    handle: str = ""
    scenario_id: str | None = None
    init_config: dict[str, Any] | None = None
    name: str = ""
    arguments: Any = None
    checklist: list[CheckItem] | None = None
    calls: list[ReplayCall] = []


class EpisodeFinal(BaseModel):
    """The answer to ``final``: the state's hash, and the state as the checks will see it.

    An episode on its scenario's shared state sends what it changed (``changes``) and the hash of the
    initial state it changed (the check worker keeps initial states by it); a private one sends both
    states whole.
    """

    state_hash: str
    initial_hash: str | None = None
    changes: list[StateChange] | None = None
    final: dict[str, Any] | None = None
    initial: dict[str, Any] | None = None


class CheckedEnv(BaseModel):
    """One environment whose checks a check worker runs."""

    check_timeout_s: float
    # The bundle's folder, whose data files the initial states it is sent name (``envscaler.data_files``),
    # and the files its scenarios name: loaded at start, so that loading never counts against a check's limit.
    bundle_dir: Path | None = None
    data_files: list[str] = []


class CheckerSettings(BaseModel):
    """What the check worker is told when it starts: the environments it checks for, by env_id (every
    environment of a server process shares one check worker)."""

    envs: dict[str, CheckedEnv]
    # Each check's process loads the no-new-processes seccomp policy: the sandbox lets the worker fork.
    child_seccomp: bool = False


class CheckRequest(BaseModel):
    """One episode's checks, for the check worker: the final state is ``final``, or ``changes`` made to
    the initial state ``initial_key`` (sent in ``initial`` when the check worker does not hold it; a top-level
    value that is a data file's content is sent as the file's reference, ``envscaler.data_files``).
    ``handle`` names the episode, as in :class:`WorkerRequest`; ``env_id`` its environment."""

    env_id: str
    handle: str
    checklist: list[CheckItem]
    initial_key: str | None = None
    initial: dict[str, Any] | None = None
    changes: list[StateChange] | None = None
    final: dict[str, Any] | None = None
    # What the checks read besides the states (``turn_results``, ``agent_replies``).
    context: CheckContext = CheckContext()


class CheckResults(BaseModel):
    """The check worker's answer: each check's verdict, or that it needs the initial state sent."""

    checks: list[CheckResult] = []
    missing_initial: bool = False


class WorkerOutcome(BaseModel):
    """The answer to ``call``: the outcome, with the text the agent is shown (not part of its record).

    ``digest`` is what a replay of the call must reproduce. ``stuck`` says the call outlived its limit
    and its thread could not be stopped: the worker must be replaced to get rid of it.
    """

    outcome: ToolOutcome
    text: str | None = None
    digest: int = 0
    stuck: bool = False


class WorkerFailure(BaseModel):
    """Any failed request: which of the server's errors it is, and its message."""

    error: Literal["EnvCodeError", "UnknownScenario", "UnknownEpisode", "OutOfMemory", "ChecklistError", "CallAbandoned", "EpisodeLost",
                   "BundleError", "Overloaded"]
    message: str


class RunningMarks:
    """A page of memory the server shares with its worker: which episode (by handle) each of the worker's
    threads runs the code of right now (slot 0: its event loop's thread). The worker writes a thread's
    slot around every call that thread runs; when the worker freezes or dies with several requests in
    flight, the server reads the page for the one to try first, alone (``servers.workers.process``).

    The page is in the worker's memory, so the environment code it runs can write anything there: it
    is a hint, never a reason to blame a request.
    """

    SLOTS = 64
    SLOT_BYTES = 64
    _LENGTH = struct.Struct("<B")

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            fd = os.memfd_create("envscaler-running-marks", 0)
            os.ftruncate(fd, self.SLOTS * self.SLOT_BYTES)
        self.fd = fd
        self._memory = mmap.mmap(fd, self.SLOTS * self.SLOT_BYTES)

    def set(self, slot: int, subject: str) -> None:
        data = subject.encode()[: self.SLOT_BYTES - self._LENGTH.size]
        start = slot * self.SLOT_BYTES
        self._memory[start + self._LENGTH.size : start + self._LENGTH.size + len(data)] = data
        self._LENGTH.pack_into(self._memory, start, len(data))

    def clear(self, slot: int | None = None) -> None:
        """Empty ``slot`` (every slot when None)."""
        for index in range(self.SLOTS) if slot is None else (slot,):
            self._LENGTH.pack_into(self._memory, index * self.SLOT_BYTES, 0)

    def close(self) -> None:
        """Unmap the page and close its descriptor (a forked child that must not write it)."""
        self._memory.close()
        os.close(self.fd)

    def read(self) -> dict[int, str]:
        """The subject of every slot that names one, by slot."""
        marks = {}
        for slot in range(self.SLOTS):
            start = slot * self.SLOT_BYTES
            (length,) = self._LENGTH.unpack_from(self._memory, start)
            if 0 < length <= self.SLOT_BYTES - self._LENGTH.size:
                marks[slot] = self._memory[start + self._LENGTH.size : start + self._LENGTH.size + length].decode(errors="replace")
        return marks


def outcome_digest(outcome: ToolOutcome) -> int:
    """What a replay of a call must reproduce: whether (and how) it failed, and what it changed in the state.

    Not what it answered: a call that reads the clock changes nothing a rebuild must restore.
    """
    return zlib.crc32(json_bytes([outcome.error_kind, outcome.diff]))


def frame(request_id: int, message: Any, status: int = OK) -> bytes:
    """One frame of ``message`` (a model or plain data) as JSON."""
    payload = json_bytes(message)
    return HEADER.pack(len(payload), request_id, status) + payload


class FrameTooLarge(ValueError):
    """A frame's header announces more than MAX_FRAME_BYTES."""


class FrameReader:
    """Whole frames out of bytes that arrive in pieces (an asyncio protocol's ``data_received``)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """The frames ``data`` completes, as (request id, status, payload). Raises FrameTooLarge."""
        buffer = self.buffer
        buffer += data
        frames = []
        while len(buffer) >= HEADER.size:
            length, request_id, status = HEADER.unpack_from(buffer)
            if length > MAX_FRAME_BYTES:
                raise FrameTooLarge(f"a frame of {length} bytes (the limit is {MAX_FRAME_BYTES})")
            end = HEADER.size + length
            if len(buffer) < end:
                break
            frames.append((request_id, status, bytes(buffer[HEADER.size:end])))
            del buffer[:end]
        if not buffer:
            self.buffer = bytearray()  # an emptied bytearray keeps its room: that of the largest frame so far
        return frames


def recv_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    """One whole frame from a blocking socket, before any event loop: (request id, status, payload).

    Raises EOFError when the socket closes first, FrameTooLarge, or OSError (TimeoutError among them).
    """
    length, request_id, status = HEADER.unpack(_recv_exactly(sock, HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"a frame of {length} bytes (the limit is {MAX_FRAME_BYTES})")
    return request_id, status, _recv_exactly(sock, length)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def decode(model: type[M], payload: bytes) -> M:
    """``payload`` read as ``model``. Raises ValueError (ValidationError among them) or RecursionError.

    pydantic's JSON parser refuses the escape of a lone surrogate, which ``json.loads`` reads: the
    rare payload that holds one is read that way, every other one by the faster parser.
    """
    try:
        return model.model_validate_json(payload)
    except ValidationError as e:
        if not any(error["type"] == "json_invalid" for error in e.errors()):
            raise
    return model.model_validate(json.loads(payload))


def checked_object(payload: bytes) -> bytes:
    """``payload`` itself once it is known to be the JSON text of one object; ValueError (RecursionError) when not.

    Read without keeping what it holds: each object is dropped as soon as it is read, so checking a
    state of 100 MB costs a fraction of parsing it.
    """
    if payload.lstrip()[:1] != b"{" or json.loads(payload, object_pairs_hook=_drop, parse_constant=_refuse) is not None:
        raise ValueError("not a JSON object")
    return payload


def _drop(pairs: list[tuple[str, Any]]) -> None:
    return None


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_settings(sock: socket.socket, model: type[M]) -> M:
    """A child's settings: the first frame on its socket, read before any event loop. Ends the child
    (SystemExit 0) when the server went away before it sent them."""
    try:
        _, _, payload = recv_frame(sock)
    except EOFError:
        raise SystemExit(0) from None
    return decode(model, payload)
