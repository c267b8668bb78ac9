"""The check worker as a server holds it: one for every environment of the server process.

A check worker (``servers.workers.check_worker``) is a zygote that runs no untrusted code itself: it
forks a child for each validation. Nothing in it belongs to one environment more than another (their
data files and initial states, kept by env_id), so the environments of one process (``farm up
--envs-per-server N``) share it: one interpreter's pages instead of N (about 5 MB each, 2 cores:
benchmarks/farm.py). It runs each validation at once, in a child of its own, so one environment's
slow checks hold up none of the others'.

It starts with the first validation and stops once idle (``check_idle_s``), in a control group of its
own: the limits of one environment, with the CPU share of all of them.
"""

from __future__ import annotations

import logging
import time

import anyio

from envscaler import Bundle
from envscaler.cgroups import ChildGroup, GroupLimits
from envscaler.data_files import data_folders, data_megabytes, references
from envscaler.sandbox import CHILD_TASKS
from servers.errors import Overloaded
from servers.workers.process import CAUGHT_UP_TRIES, START_TIMEOUT_S, WorkerGone, WorkerProcess
from servers.workers.wire import CheckedEnv, CheckerSettings, CheckRequest

log = logging.getLogger("envscaler.server")

START_S_PER_DATA_MB = 1.0
"""Each worker loads (and the environment worker hashes) the data files at its start: a second more per MB to say hello."""
_ROOM_AGAIN_S = 0.05
"""How soon a validation the check worker had no room for is asked again."""
CHECK_IDLE_S = 30.0
"""How long the check worker may sit idle before it is stopped (the next validation starts it again).

A harness validates each episode once, after minutes of tool calls, so between validations a server
holds nothing for checks (the worker: about 4 MB), while a burst of validations (a batch ending, a
trainer's group of rollouts) finishes on the worker the first one started. A start is a fork from the
server's spawner: it adds milliseconds to the validation that needs it, and the data files' loading
where there are some."""


def checked_env(bundle: Bundle, check_timeout_s: float) -> CheckedEnv:
    """What a check worker is told of ``bundle``: its folder, the data files its scenarios name, the checks' limit."""
    files = sorted({name for scenario in bundle.scenarios for name in references(scenario.init_config).values()})
    return CheckedEnv(check_timeout_s=check_timeout_s, bundle_dir=bundle.directory, data_files=files)


class CheckWorker:
    """The check worker of the environments ``envs`` (bundle, check limit in seconds): a :class:`WorkerProcess`
    started by the first request, and the control group it runs in (``group``: one environment's limits;
    with ``sandbox`` only). Each environment's store :meth:`joins` it, and :meth:`leaves` it when it
    closes: the last to leave stops it."""

    def __init__(self, envs: list[tuple[Bundle, float]], *, sandbox: bool, group: GroupLimits | None = None,
                 idle_s: float | None = CHECK_IDLE_S) -> None:
        self._checked = {bundle.env_id: checked_env(bundle, limit_s) for bundle, limit_s in envs}
        self._members: set[str] = set()
        # The name it goes by in logs and in its control group's: its one environment's, else all of theirs.
        self.name = "+".join(self._checked)
        shared_group = group.model_copy(update={"cpu_weight": group.cpu_weight * len(envs)}) if group is not None else None
        self.group = ChildGroup.create(shared_group, self.name, "checks") if sandbox and shared_group is not None else None
        self._sandbox = sandbox
        readable = tuple(dict.fromkeys(folder for bundle, _ in envs for folder in data_folders(bundle)))
        start_timeout_s = START_TIMEOUT_S + START_S_PER_DATA_MB * sum(data_megabytes(bundle) for bundle, _ in envs)
        self.process = WorkerProcess("servers.workers.check_worker", self._settings(), role="check worker", on_lost=self._lost, lazy=True,
                                     idle_s=idle_s, new_processes=True, group=self.group, sandbox=sandbox, env_id=self.name,
                                     tasks=group.pids if group is not None else CHILD_TASKS, readable=readable,
                                     start_timeout_s=start_timeout_s)

    @property
    def shared(self) -> bool:
        """Whether it checks for more than one environment."""
        return len(self._checked) > 1

    def joins(self, env_id: str) -> None:
        """Environment ``env_id``'s store uses it from now on."""
        if env_id not in self._checked:
            raise ValueError(f"this check worker was made for {list(self._checked)}, not for {env_id!r}")
        self._members.add(env_id)
        # Only the environments that joined: one that could not be served (its data files broken, say) must not
        # keep the others' checks from starting.
        self.process.settings = self._settings()

    def leaves(self, env_id: str) -> None:
        """Environment ``env_id``'s store is closing; the last one to leave stops the worker and removes its group."""
        self._members.discard(env_id)
        if not self._members:
            self.process.close()
            if self.group is not None:
                self.group.remove()

    def _settings(self) -> CheckerSettings:
        envs = {env_id: checked for env_id, checked in self._checked.items() if env_id in self._members}
        return CheckerSettings(envs=envs, child_seccomp=self._sandbox)

    async def ask(self, request: CheckRequest, limit_s: float) -> bytes:
        """The check worker's answer to ``request`` (see :meth:`WorkerProcess.ask`). Checks change nothing, so a
        request only caught up in the worker's fall (another's checks were to blame) is asked again, in its
        turn, a few times at most; WorkerGone when it is to blame or the tries run out. One the worker had no
        room for (Overloaded: no process could be forked while other validations ran, at its group's task
        limit) is asked again as the others end, for as long as its checks may run; Overloaded after that."""
        tries, turn = 1, None
        room_by = time.monotonic() + limit_s
        while True:
            async with self.process.alone(turn):
                try:
                    return await self.process.ask(request, limit_s, "the checks", request.handle, again=tries < CAUGHT_UP_TRIES)
                except WorkerGone as e:
                    if e.blamed or tries == CAUGHT_UP_TRIES:
                        raise
                    tries, turn = tries + 1, e.turn
                    continue
                except Overloaded:
                    if time.monotonic() >= room_by:
                        raise
            await anyio.sleep(_ROOM_AGAIN_S)

    def _lost(self, reason: str) -> None:
        log.error("check worker lost", extra={"env": self.name, "reason": reason})
