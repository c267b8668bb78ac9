"""Settings of a server's OpenEnv listener (no ``openenv-core`` import: the base install reads them too)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class OpenEnvConfig(BaseModel):
    """Where the OpenEnv listener binds and how many sessions it keeps; reported by ``GET /info``."""

    openenv_port: int = Field(default=0, ge=0, le=65535)
    max_sessions: int = Field(default=2048, ge=1)
    session_idle_s: float = Field(default=600.0, gt=0)
    max_steps: int = Field(default=50, ge=1)
