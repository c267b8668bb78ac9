"""An environment's state as JSON-ready data: snapshot, diff, hash, and patches from an initial state.

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
        # (path, path of what it refers to) for each back-link met (see _acyclic).
        self.back_links: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []

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


_JSON_SCALARS = (str, int, float, bool, type(None))
_BACK_LINK_NOTE = 'back-links -> {"$ref": JSON pointer to what they refer to}'


def _acyclic(value: Any, path: tuple[Any, ...], holders: dict[int, tuple[Any, ...]], converter: _Converter) -> Any:
    """A JSON-ready copy of ``value`` (at ``path``) in which a reference back to a container or an object that
    holds it (a ``parent`` link up a tree: ``holders`` are those on the way down) becomes ``{"$ref": "#/path"}``.

    The slow way to JSON, for what ``json.dumps`` refuses: every key is made a string and every other value
    converted as ``converter`` does. Containers are read from raw storage, so an overlay makes no copies.
    """
    if type(value) in _JSON_SCALARS:
        return value
    held = holders.get(id(value))
    if held is not None:
        converter._note(_BACK_LINK_NOTE)
        converter.back_links.append((path, held))
        return {"$ref": json_pointer(held)}
    holders[id(value)] = path
    try:
        if isinstance(value, dict):
            if any(not isinstance(key, str) for key in dict.keys(value)):
                converter._note("non-string keys -> strings")
            return {key if isinstance(key, str) else str(key): _acyclic(child, (*path, key), holders, converter)
                    for key, child in list(dict.items(value))}
        if isinstance(value, (list, tuple)):
            items = list(list.__iter__(value)) if isinstance(value, list) else list(value)
            return [_acyclic(child, (*path, index), holders, converter) for index, child in enumerate(items)]
        if hasattr(value, "__dict__") and not isinstance(value, type):
            # Objects as public attributes, dataclasses too: ``dataclasses.asdict`` would follow a back-link forever.
            converter._note(f"{type(value).__name__} -> dict of public attributes")
            replacement: Any = public_attributes(value)
        else:
            replacement = converter(value)
        return _acyclic(replacement, path, holders, converter)
    finally:
        del holders[id(value)]


def json_pointer(path: tuple[Any, ...] | list[Any]) -> str:
    """``path`` as a URI fragment JSON pointer from the state's root (RFC 6901): ``#/root/children/0``."""
    return "#" + "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in path)


def json_ready(value: Any) -> Any:
    """A JSON-ready copy of ``value``, converted as ``to_json_text`` does (back-links as ``{"$ref": ...}``),
    read from raw storage: for a value ``json.dumps`` cannot take as it is."""
    return _acyclic(value, (), {}, _Converter())


def find_back_link(value: Any) -> str | None:
    """The first reference in ``value`` back to a container or object that holds it, as ``'path' refers back
    to 'path'`` (JSON pointers); None when ``value`` is a tree (or a graph without cycles)."""
    converter = _Converter()
    _acyclic(value, (), {}, converter)
    if not converter.back_links:
        return None
    path, held = converter.back_links[0]
    return f"{json_pointer(path)} refers back to {json_pointer(held)}"


def public_attributes(instance: Any) -> dict[str, Any]:
    """The instance attributes whose names do not start with an underscore."""
    return public_items(vars(instance))


def public_items(attributes: dict[str, Any]) -> dict[str, Any]:
    """The attributes whose names do not start with an underscore: what a state is made of."""
    return {k: v for k, v in attributes.items() if not k.startswith("_")}


def to_json_text(value: Any, *, canonical: bool = False, ascii_only: bool = True) -> tuple[str, list[str]]:
    """Serialise ``value`` to compact JSON text, returning the text and the conversions made.

    ``canonical`` sorts keys, so equal values give equal text (for hashing). ``ascii_only`` escapes
    other characters: such text takes one byte a character in memory (states are kept per episode);
    text meant for a model to read is clearer without the escapes.

    A value that refers back to a container or an object holding it (a ``parent`` link up a tree) is
    written as ``{"$ref": "#/path/to/it"}``, and noted.
    """
    converter = _Converter()
    options: dict[str, Any] = {"default": converter, "sort_keys": canonical, "ensure_ascii": ascii_only, "separators": (",", ":")}
    try:
        text = json.dumps(value, **options)
    except (TypeError, ValueError, RecursionError):
        # Non-string keys json cannot coerce (tuples, objects) or keys of mixed types; or a back-link
        # ("Circular reference detected"; a RecursionError where the converter made new dicts each time).
        converter = _Converter()
        text = json.dumps(_acyclic(value, (), {}, converter), **{**options, "default": converter})
    return text, converter.notes


def snapshot(instance: Any) -> tuple[dict[str, Any], list[str]]:
    """A deep, JSON-ready copy of the instance's state, and the conversions it needed."""
    text, notes = to_json_text(public_attributes(instance))
    return json.loads(text), notes


def state_hash(state: dict[str, Any], digests: dict[int, bytes] | None = None) -> str:
    """A digest that is equal for equal states, whatever their key order or history.

    It is a Merkle hash. A dict's digest is the sum (mod 2**128) of one hash per entry, so the
    digest of a copy that differs from its original in a few keys is the original's digest with
    those entries' hashes swapped: ``digests`` caches the digests of containers that never change
    (a scenario's shared initial state, keyed by id), and a container that knows its original
    (``_origin``, an episode's copy of a shared one) is hashed from it, so hashing an episode costs
    in proportion to what it changed and what it copied, not to the size of its state.
    """
    # The root is hashed like any dict but never cached: it is a temporary, and its id will be reused.
    total = sum(_entry(key, value, digests) for key, value in dict.items(state)) & _MASK
    return total.to_bytes(16, "big").hex()[:16]


_MASK = (1 << 128) - 1


def _digest(value: Any, digests: dict[int, bytes] | None) -> bytes:
    known = digests.get(id(value)) if digests is not None else None
    if known is not None:
        return known
    if isinstance(value, dict):
        origin = getattr(value, "_origin", None)
        if digests is not None and origin is not None:
            total = _copied_dict_sum(value, origin, digests)
        else:
            total = sum(_entry(key, child, digests) for key, child in dict.items(value)) & _MASK
        digest = total.to_bytes(16, "big")
    else:
        hasher = hashlib.blake2b(b"[", digest_size=16)
        for child in list.__iter__(value):
            hasher.update(_bytes(child, digests))
        digest = hasher.digest()
    if digests is not None and getattr(value, "_origin", 0) == 0:
        digests[id(value)] = digest  # a plain container next to overlay copies is a shared, frozen one
    return digest


def _copied_dict_sum(copy: dict[str, Any], origin: dict[str, Any], digests: dict[int, bytes]) -> int:
    """The entry-hash sum of ``copy``, from its original's and the entries that are not the original's."""
    total = int.from_bytes(_digest(origin, digests), "big")
    shared_keys = 0
    for key, child in dict.items(copy):
        old = dict.get(origin, key, _ABSENT)
        if old is not _ABSENT:
            shared_keys += 1
            if old is child:
                continue
            total -= _entry(key, old, digests)
        total += _entry(key, child, digests)
    if shared_keys != len(origin):
        total -= sum(_entry(key, old, digests) for key, old in dict.items(origin) if not dict.__contains__(copy, key))
    return total & _MASK


_ABSENT = object()


def _entry(key: Any, value: Any, digests: dict[int, bytes] | None) -> int:
    return int.from_bytes(hashlib.blake2b(_scalar(key) + b"=" + _bytes(value, digests), digest_size=16).digest(), "big")


def _bytes(value: Any, digests: dict[int, bytes] | None) -> bytes:
    """A container as its kind and digest; a scalar as its typed text."""
    if isinstance(value, dict):
        return b"{" + _digest(value, digests)
    if isinstance(value, list):
        return b"[" + _digest(value, digests)
    return _scalar(value)


def _scalar(value: Any) -> bytes:
    # repr tells 1 from 1.0, True and "1"; the length prefix keeps neighbours apart in a list.
    text = repr(value).encode("utf-8", "backslashreplace")
    return len(text).to_bytes(4, "big") + text


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
    if isinstance(before, list) and isinstance(after, list):
        if len(before) == len(after):
            changes = []
            for index, (old, new) in enumerate(zip(before, after)):
                changes.extend(diff(old, new, [*path, index]))
            return changes
        grown_or_cut = list_changes(path, before, after, lambda value: value)
        if grown_or_cut:
            return grown_or_cut
    return [StateChange(path=path, before=before, after=after)]


def list_changes(path: list[str | int], before: list[Any], after: list[Any], copy: Any) -> list[StateChange]:
    """A list grown or cut at its end, as one ``add`` or ``remove`` per item there (values through ``copy``);
    empty when the lists differ elsewhere too. Appending to a long list then costs a change of one item,
    not two copies of the list."""
    common = min(len(before), len(after))
    if after[:common] != before[:common]:  # compares item by item in C, identical items at once
        return []
    if len(after) > len(before):
        return [StateChange(path=[*path, index], after=copy(after[index]), op="add") for index in range(common, len(after))]
    return [StateChange(path=[*path, index], before=copy(before[index]), op="remove") for index in range(len(before) - 1, common - 1, -1)]


def changes_since(initial: dict[str, Any], current: dict[str, Any]) -> list[StateChange]:
    """What turns ``initial`` into ``current``: a value set (``add``/``replace`` with ``after``) or removed per path.

    Made for an episode's state over its scenario's shared one (``envscaler.overlay``): subtrees the
    episode never copied are the same objects in both and are skipped by identity, so the cost follows
    what the episode copied, not the size of the state. Containers are read from their raw storage
    (an overlay's reads would make copies). A list whose length changed is sent whole.
    """
    changes: list[StateChange] = []
    _walk([], initial, current, changes)
    return changes


def _walk(path: list[str | int], old: Any, new: Any, changes: list[StateChange]) -> None:
    if new is old:
        return
    if isinstance(old, dict) and isinstance(new, dict):
        for key, value in dict.items(new):
            before = dict.get(old, key, _ABSENT)
            if before is _ABSENT:
                changes.append(StateChange(path=[*path, key], after=_plain(value), op="add"))
            else:
                _walk([*path, key], before, value, changes)
        if len(new) != len(old) or any(not dict.__contains__(new, key) for key in dict.__iter__(old)):
            changes.extend(StateChange(path=[*path, key], op="remove") for key in dict.__iter__(old) if not dict.__contains__(new, key))
        return
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for index, (before, value) in enumerate(zip(list.__iter__(old), list.__iter__(new))):
            _walk([*path, index], before, value, changes)
        return
    if type(old) is type(new) and not isinstance(new, (dict, list)) and old == new:
        return
    changes.append(StateChange(path=path, after=_plain(new)))


def _plain(value: Any) -> Any:
    """A plain deep copy of a JSON-shaped value, read from raw storage."""
    if isinstance(value, dict):
        return {key: _plain(child) for key, child in dict.items(value)}
    if isinstance(value, list):
        return [_plain(child) for child in list.__iter__(value)]
    return value


def apply_changes(initial: dict[str, Any], changes: list[StateChange]) -> dict[str, Any]:
    """The state ``changes`` (from :func:`changes_since`) make of ``initial``, which is left as it is.

    Only the containers on a changed path are copied; everything else is shared with ``initial``.
    Raises ValueError when a path does not fit the state (the patch was made from another one).
    """
    root = dict(initial)
    copied: set[int] = {id(root)}
    for change in changes:
        if not change.path:
            raise ValueError("a change without a path")
        parent: Any = root
        for depth, key in enumerate(change.path[:-1]):
            try:
                child = parent[key]
            except (KeyError, IndexError, TypeError):
                raise ValueError(f"no value at {change.path[: depth + 1]}") from None
            if id(child) not in copied:
                if not isinstance(child, (dict, list)):
                    raise ValueError(f"{change.path[: depth + 1]} holds no container")
                child = parent[key] = type(child)(child)
                copied.add(id(child))
            parent = child
        last = change.path[-1]
        try:
            if change.op == "remove":
                del parent[last]
            elif change.op == "add" and isinstance(parent, list) and last == len(parent):
                parent.append(change.after)
            else:
                parent[last] = change.after
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"the change at {change.path} does not fit the state") from None
    return root
