"""An environment's state as JSON-ready data: snapshot, diff and hash.

State is the instance's public attributes. Values JSON cannot hold are converted (sets to sorted
lists, datetimes to ISO strings, objects to their public attributes) and each conversion is
reported, so an environment that keeps odd values still gets a state the checks can read.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import hashlib
import json
from decimal import Decimal
from typing import Any

from envscaler.models import StateChange


class _Converter:
    """``json.dumps(default=...)`` hook that converts what JSON lacks and remembers what it did."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def __call__(self, value: Any) -> Any:
        kind = type(value).__name__
        if isinstance(value, (set, frozenset)):
            self._note(f"{kind} -> sorted list")
            return sorted(value, key=repr)
        if isinstance(value, tuple):
            return list(value)
        if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
            self._note(f"{kind} -> ISO string")
            return value.isoformat()
        if isinstance(value, Decimal):
            self._note("Decimal -> float")
            return float(value)
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, bytes):
            self._note("bytes -> text")
            return value.decode("utf-8", errors="replace")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            self._note(f"{kind} -> dict")
            return dataclasses.asdict(value)
        if hasattr(value, "__dict__"):
            self._note(f"{kind} -> dict of public attributes")
            return public_attributes(value)
        self._note(f"{kind} -> repr string")
        return repr(value)

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def _stringify_keys(value: Any) -> Any:
    """Copy of ``value`` whose dict keys are all strings (JSON rejects tuple keys and the like)."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): _stringify_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_stringify_keys(v) for v in value]
    return value


def public_attributes(instance: Any) -> dict[str, Any]:
    """The instance attributes whose names do not start with an underscore."""
    return {k: v for k, v in vars(instance).items() if not k.startswith("_")}


def to_json_text(value: Any, *, canonical: bool = False, ascii_only: bool = True) -> tuple[str, list[str]]:
    """Serialise ``value`` to compact JSON text, returning the text and the conversions made.

    ``canonical`` sorts keys, so equal values give equal text (for hashing). ``ascii_only`` escapes
    other characters: such text takes one byte a character in memory (states are kept per episode);
    text meant for a model to read is clearer without the escapes.
    """
    converter = _Converter()
    options: dict[str, Any] = {"default": converter, "sort_keys": canonical, "ensure_ascii": ascii_only, "separators": (",", ":")}
    try:
        text = json.dumps(value, **options)
    except (TypeError, ValueError):
        # Non-string keys that json cannot coerce (tuples, objects) or keys of mixed types.
        converter.notes.append("non-string keys -> strings")
        text = json.dumps(_stringify_keys(value), **options)
    return text, converter.notes


def snapshot(instance: Any) -> tuple[dict[str, Any], list[str]]:
    """A deep, JSON-ready copy of the instance's state, and the conversions it needed."""
    text, notes = to_json_text(public_attributes(instance))
    return json.loads(text), notes


def state_hash(state: dict[str, Any]) -> str:
    """A digest that is equal for equal states, whatever their key order."""
    text, _ = to_json_text(state, canonical=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def diff(before: Any, after: Any, path: list[str | int] | None = None) -> list[StateChange]:
    """Every leaf that differs between two JSON-ready values, addressed by its path."""
    path = path or []
    if before == after:
        return []
    if isinstance(before, dict) and isinstance(after, dict):
        changes: list[StateChange] = []
        for key in before.keys() | after.keys():
            if key not in after:
                changes.append(StateChange(path=[*path, key], before=before[key], op="remove"))
            elif key not in before:
                changes.append(StateChange(path=[*path, key], after=after[key], op="add"))
            else:
                changes.extend(diff(before[key], after[key], [*path, key]))
        return sorted(changes, key=lambda c: [str(p) for p in c.path])
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        changes = []
        for index, (old, new) in enumerate(zip(before, after)):
            changes.extend(diff(old, new, [*path, index]))
        return changes
    return [StateChange(path=path, before=before, after=after)]
