"""A disk cache of LLM answers, one JSON file per request, keyed by a hash of the request.

A run killed at any point leaves every finished answer on disk (files are written whole and then
renamed into place), so the next run with the same inputs repeats no finished request.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def request_key(payload: Any) -> str:
    """The hex digest that identifies a request: canonical JSON of everything that shapes the answer."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class DiskCache:
    """``<root>/<stage>/<key[:2]>/<key>.json`` files holding one answer each."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _path(self, stage: str, key: str) -> Path:
        return self.root / stage / key[:2] / f"{key}.json"

    def get(self, stage: str, key: str) -> dict[str, Any] | None:
        """The stored answer, or None when there is none (or the file is unreadable)."""
        path = self._path(stage, key)
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None
        return value if isinstance(value, dict) else None

    def put(self, stage: str, key: str, value: dict[str, Any]) -> None:
        """Store an answer atomically: a reader sees the whole file or none."""
        path = self._path(stage, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(value, file, ensure_ascii=False)
        os.replace(temporary, path)
