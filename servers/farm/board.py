"""The daemon's view of its farm, kept in memory and mirrored to the state file."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import anyio

from servers.farm.models import EnvStatus, FarmPaths, FarmPlan, FarmState, write_json

log = logging.getLogger("envscaler.farm")


class Board:
    """Live status of every environment; ``flush_forever`` writes it whenever it changed."""

    def __init__(self, plan: FarmPlan, paths: FarmPaths) -> None:
        self.plan = plan
        self.paths = paths
        now = time.time()
        self.state = FarmState(
            farm_id=plan.farm_id,
            backend=plan.backend,
            daemon_pid=os.getpid(),
            sandbox=plan.sandbox,
            started_at=now,
            updated_at=now,
            envs={env.env_id: EnvStatus(env_id=env.env_id, url=env.url) for env in plan.envs},
        )
        self._dirty = True
        self._write_problem: str | None = None

    def env(self, env_id: str) -> EnvStatus:
        """The status record of one environment."""
        return self.state.envs[env_id]

    def update(self, env_id: str, **changes: Any) -> None:
        """Change fields of one environment's status."""
        record = self.state.envs[env_id]
        for key, value in changes.items():
            setattr(record, key, value)
        self._dirty = True

    def set(self, **changes: Any) -> None:
        """Change farm-wide fields (gateway, ready, error)."""
        for key, value in changes.items():
            setattr(self.state, key, value)
        self._dirty = True

    def flush(self) -> None:
        """Write the state file now if anything changed."""
        # Without a plan the farm's files were deleted: writing would bring the folder back as litter.
        if self._dirty and self.paths.plan.exists():
            self._dirty = False
            self.state.updated_at = time.time()
            try:
                # Unindented: a third less to write, many times a second while a farm of 1,000 starts.
                write_json(self.paths.state, self.state, indent=None)
            except OSError as e:
                # Out of descriptors, a full disk: the farm runs on, and the next flush tries again.
                self._dirty = True
                if str(e) != self._write_problem:
                    log.error("the farm's state file cannot be written; retrying", extra={"path": str(self.paths.state), "error": str(e)})
                self._write_problem = str(e)
            else:
                self._write_problem = None

    async def flush_forever(self, interval_s: float = 0.1) -> None:
        """Write changes at most every ``interval_s`` so ``up`` and ``status`` see them promptly."""
        while True:
            self.flush()
            await anyio.sleep(interval_s)
