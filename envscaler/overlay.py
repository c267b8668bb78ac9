"""An episode's state as a copy-on-access overlay on its scenario's shared initial state.

Benchmark-sized environments hold megabytes of state per scenario, and a server holds thousands of
episodes. Copying the state per episode, or pickling it per call to find out what changed, makes
every call cost in proportion to the whole state. Instead:

- a scenario's initial state is built once and frozen (:class:`SharedState`): its containers are
  never handed to environment code;
- an episode sees its state through :class:`OverlayDict` / :class:`OverlayList`: reading a container
  out of one gives the episode its *own* shallow copy of it (made on first access, remembered by the
  shared container's id so that aliases stay aliases), so environment code can only ever mutate
  copies the episode owns;
- every write to an owned container notes the old value of what it changes, so a call's changes,
  and only those, are known when it ends (:meth:`Overlay.finish_call`);
- a copy that the call only read, and that nothing else holds, is given back at the end of the call
  (the shared original goes back in its slot), so an episode's memory follows what it changed, not
  what it read.

Containers the running call makes itself (``{"id": 1}`` stored into the state) stay plain Python
objects until the call ends, so code that keeps a reference and goes on mutating it sees normal
Python semantics; they are adopted (converted to overlay containers) when it ends.

Only JSON-shaped state qualifies (dicts with string keys, lists, strings, numbers, booleans, None):
it is what checks see after a JSON round trip anyway. Anything else (sets, tuples, objects) makes
the runtime fall back to a private copy per episode.

What is not seen: code that writes a list's raw storage from C (``heapq`` on a state list) changes
the episode's copy without a note, so that call's diff misses it; the copy itself is kept, because a
copy is only given back when it equals its original.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from typing import Any

from envscaler.models import StateChange
from envscaler.state import diff as json_diff
from envscaler.state import list_changes
from envscaler.state import find_back_link, json_pointer, json_ready, to_json_text

Path = tuple[str | int, ...]

MISSING: Any = object()
"""Stands for "no value here" (a key added or removed) in diffs."""
_NATIVE_SCALARS = (str, int, float, bool, type(None))


class NotNative(Exception):
    """The value holds something JSON does not (a set, a tuple, an object, a non-string key)."""


# -- the shared, frozen side ---------------------------------------------------------------------


class SharedState:
    """A scenario's constructed state, frozen: its containers are only ever read through overlays.

    ``attributes`` is the constructed instance's ``__dict__`` (private attributes included). Containers
    whose ids are in ``data_ids`` are a data file's content (``envscaler.data_files``), frozen for as long
    as the process runs and shared with other scenarios: they are neither walked nor listed again here,
    and their digests go to ``data_digests``, which every scenario naming the file shares.
    """

    __slots__ = ("attributes", "container_ids", "data_ids", "digests")

    def __init__(self, attributes: dict[str, Any], data_ids: set[int] | None = None,
                 data_digests: dict[int, bytes] | None = None) -> None:
        self.attributes = attributes
        self.container_ids: set[int] = set()
        self.data_ids: set[int] = data_ids if data_ids is not None else set()
        for value in attributes.values():
            _collect_native(value, self.container_ids, self.data_ids)
        # id(shared container) -> digest, filled as state hashes are asked for (see state.state_hash).
        self.digests: dict[int, bytes] = _Digests(self.data_ids, data_digests) if data_digests is not None else {}

    def is_shared(self, value: Any) -> bool:
        return id(value) in self.container_ids or id(value) in self.data_ids


class _Digests(dict):
    """A scenario's container digests, those of data files' containers kept in the files' own cache: their
    ids are theirs for good, while a scenario's own ids may be reused once it is let go of."""

    __slots__ = ("data_ids", "data")

    def __init__(self, data_ids: set[int], data: dict[int, bytes]) -> None:
        super().__init__()
        self.data_ids = data_ids
        self.data = data

    def get(self, key: Any, default: Any = None) -> Any:
        found = dict.get(self, key)
        return found if found is not None else self.data.get(key, default)

    def __setitem__(self, key: Any, value: Any) -> None:
        (self.data if key in self.data_ids else super()).__setitem__(key, value)


def _collect_native(value: Any, ids: set[int], known: set[int] | frozenset[int] = frozenset()) -> None:
    """Add the ids of every container under ``value`` but those under ``known`` ones (a data file's, checked
    when it was loaded); NotNative when something is not JSON-shaped, a back-link (a container holding one
    that holds it) included."""
    stack = [value]
    repeated = False
    while stack:
        item = stack.pop()
        kind = type(item)
        if id(item) in known:
            continue
        if kind is dict:
            if id(item) in ids:
                repeated = True
                continue
            ids.add(id(item))
            for key, child in item.items():
                if type(key) is not str:
                    raise NotNative(f"a dict key of type {type(key).__name__} ({key!r})")
                stack.append(child)
        elif kind is list:
            if id(item) in ids:
                repeated = True
                continue
            ids.add(id(item))
            stack.extend(item)
        elif kind is float:
            if not math.isfinite(item):
                raise NotNative(f"the float {item!r}")
        elif kind not in _NATIVE_SCALARS:
            raise NotNative(f"a value of type {kind.__name__}")
    # A container met twice is held in two places, or holds itself: only a search tells (rare, so paid only then).
    back_link = find_back_link(value) if repeated else None
    if back_link is not None:
        raise NotNative(f"a back-link: {back_link}")


# -- overlay containers --------------------------------------------------------------------------


class OverlayDict(dict):
    """A dict an overlay owns: containers read out of it are the overlay's own; writes are noted."""

    __slots__ = ("_overlay", "_path", "_before", "_written", "_origin")

    # reads that hand out values ------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Any:
        value = dict.__getitem__(self, key)
        if type(value) in _CONTAINERS:
            return self._overlay.resolve(self, key, value)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        value = dict.get(self, key, MISSING)
        if value is MISSING:
            return default
        if type(value) in _CONTAINERS:
            return self._overlay.resolve(self, key, value)
        return value

    def __iter__(self) -> Iterator[Any]:
        # Overriding __iter__ makes dict(d), {**d} and d2.update(d) read values through __getitem__.
        return dict.__iter__(self)

    def values(self) -> _Values:  # type: ignore[override]
        return _Values(self)

    def items(self) -> _Items:  # type: ignore[override]
        return _Items(self)

    def copy(self) -> dict[str, Any]:
        return {key: self[key] for key in dict.__iter__(self)}

    def __or__(self, other: Any) -> dict[str, Any]:
        merged = self.copy()
        merged.update(other)
        return merged

    def __copy__(self) -> dict[str, Any]:
        return self.copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return _deep_plain(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (dict, (_deep_plain(self),))

    # writes --------------------------------------------------------------------------------------

    def _note(self, key: Any) -> None:
        before = self._before
        if before is None:
            # Listed before anything is noted: a call preempted in between must still be undone.
            self._overlay.touched.append(self)
            before = self._before = {}
            self._written = True
        if key not in before:
            before[key] = dict.get(self, key, MISSING)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._note(key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: Any) -> None:
        if dict.__contains__(self, key):
            self._note(key)
        dict.__delitem__(self, key)

    def pop(self, key: Any, *default: Any) -> Any:
        if not dict.__contains__(self, key):
            return dict.pop(self, key, *default)
        value = self[key]  # the episode's own version of what leaves the state
        self._note(key)
        dict.__delitem__(self, key)
        return value

    def popitem(self) -> tuple[Any, Any]:
        if not self:
            raise KeyError("popitem(): dictionary is empty")
        key = next(reversed(dict.keys(self)))
        return key, self.pop(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            return self[key]
        self[key] = default
        return default

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> OverlayDict:
        self.update(other)
        return self

    def clear(self) -> None:
        for key in list(dict.__iter__(self)):
            self._note(key)
        dict.clear(self)


class _Values:
    """``d.values()``: each container handed out is the overlay's own, made as iteration reaches it."""

    __slots__ = ("_mapping",)

    def __init__(self, mapping: OverlayDict) -> None:
        self._mapping = mapping

    def __iter__(self) -> Iterator[Any]:
        mapping = self._mapping
        for key in list(dict.__iter__(mapping)):
            yield mapping[key]

    def __len__(self) -> int:
        return len(self._mapping)

    def __contains__(self, value: Any) -> bool:
        return value in dict.values(self._mapping)

    def __reversed__(self) -> Iterator[Any]:
        mapping = self._mapping
        for key in list(reversed(dict.keys(mapping))):
            yield mapping[key]

    def __repr__(self) -> str:
        return f"dict_values({list(dict.values(self._mapping))!r})"


class _Items(_Values):
    """``d.items()``, as :class:`_Values` does it."""

    __slots__ = ()

    def __iter__(self) -> Iterator[tuple[Any, Any]]:  # type: ignore[override]
        mapping = self._mapping
        for key in list(dict.__iter__(mapping)):
            yield key, mapping[key]

    def __contains__(self, item: Any) -> bool:
        return item in dict.items(self._mapping)

    def __reversed__(self) -> Iterator[tuple[Any, Any]]:  # type: ignore[override]
        mapping = self._mapping
        for key in list(reversed(dict.keys(mapping))):
            yield key, mapping[key]

    def __repr__(self) -> str:
        return f"dict_items({list(dict.items(self._mapping))!r})"


class OverlayList(list):
    """A list an overlay owns: containers read out of it are the overlay's own; writes are noted."""

    __slots__ = ("_overlay", "_path", "_before", "_written", "_origin")

    # reads -----------------------------------------------------------------------------------------

    def __getitem__(self, index: Any) -> Any:
        if type(index) is slice:
            return [self[i] for i in range(*index.indices(len(self)))]
        value = list.__getitem__(self, index)
        if type(value) in _CONTAINERS:
            return self._overlay.resolve(self, index if index >= 0 else index + len(self), value)
        return value

    def __iter__(self) -> Iterator[Any]:
        for index in range(len(self)):
            yield self[index]

    def __reversed__(self) -> Iterator[Any]:
        for index in range(len(self) - 1, -1, -1):
            yield self[index]

    def copy(self) -> list[Any]:
        return self[:]

    def __add__(self, other: Any) -> list[Any]:
        return self[:] + list(other)

    def __mul__(self, count: Any) -> list[Any]:
        return self[:] * count

    __rmul__ = __mul__

    def __copy__(self) -> list[Any]:
        return self[:]

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return _deep_plain(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (list, (_deep_plain(self),))

    # writes: the first one in a call keeps the list as it was ---------------------------------------

    def _note(self) -> None:
        if self._before is None:
            self._overlay.touched.append(self)
            self._before = list.copy(self)
            self._written = True

    def __setitem__(self, index: Any, value: Any) -> None:
        self._note()
        list.__setitem__(self, index, value)

    def __delitem__(self, index: Any) -> None:
        self._note()
        list.__delitem__(self, index)

    def __iadd__(self, other: Any) -> OverlayList:
        self._note()
        list.extend(self, other)
        return self

    def __imul__(self, count: Any) -> OverlayList:
        self._note()
        list.__imul__(self, count)
        return self

    def append(self, value: Any) -> None:
        self._note()
        list.append(self, value)

    def extend(self, values: Any) -> None:
        self._note()
        list.extend(self, values)

    def insert(self, index: Any, value: Any) -> None:
        self._note()
        list.insert(self, index, value)

    def pop(self, index: Any = -1) -> Any:
        value = self[index]
        self._note()
        list.pop(self, index)
        return value

    def remove(self, value: Any) -> None:
        self._note()
        list.remove(self, value)

    def clear(self) -> None:
        self._note()
        list.clear(self)

    def reverse(self) -> None:
        self._note()
        list.reverse(self)

    def sort(self, *, key: Any = None, reverse: bool = False) -> None:
        self._note()
        list.sort(self, key=key, reverse=reverse)


_CONTAINERS = (dict, list, OverlayDict, OverlayList)
_OWNED = (OverlayDict, OverlayList)


def _deep_plain(value: Any) -> Any:
    """A deep, plain (dict/list) copy, read from raw storage: for serialising, copying, pickling."""
    kind = type(value)
    if kind is dict or kind is OverlayDict:
        return {key: _deep_plain(child) for key, child in dict.items(value)}
    if kind is list or kind is OverlayList:
        return [_deep_plain(child) for child in list.__iter__(value)]
    return value


def plain(value: Any) -> Any:
    """``value`` with overlay containers turned into plain ones (a deep copy of containers only).

    Serialise state and results through this: ``json.dumps`` on an overlay dict would call its
    ``items()``, which makes copies for the episode as it goes.
    """
    return _deep_plain(value)


def plain_graph(value: Any, memo: dict[int, Any]) -> Any:
    """A deep, plain copy like :func:`plain` in which what is held in two places (a back-link included) is
    one copy held in two places: for an episode that leaves shared state with such links in it."""
    kind = type(value)
    if kind not in _CONTAINERS:
        return value
    done = memo.get(id(value))
    if done is not None:
        return done
    copy: Any
    if kind is dict or kind is OverlayDict:
        copy = memo[id(value)] = {}
        for key, child in list(dict.items(value)):
            copy[key] = plain_graph(child, memo)
    else:
        copy = memo[id(value)] = []
        copy.extend([plain_graph(child, memo) for child in list.__iter__(value)])
    return copy


# -- the overlay -----------------------------------------------------------------------------------


def _calibrate_spare_references() -> int:
    """References to a materialised copy that the settle loop itself holds (CPython version dependent)."""
    parent: dict[str, Any] = {}
    memo: dict[int, Any] = {}
    created: list[tuple[Any, Any, Any, Any]] = []
    copy = OverlayDict()
    parent["k"] = copy
    memo[0] = copy
    created.append((parent, "k", None, copy))
    del copy
    while created:
        parent, key, shared, copy = created.pop()
        return sys.getrefcount(copy)
    raise AssertionError("unreachable")


class Overlay:
    """One episode's (or one check's) owned copies, and what the running call has touched.

    ``shared`` says which plain containers are the frozen originals: for an episode, the scenario's
    :class:`SharedState`; for a read-only view (what a check gets), None: every container not owned
    by this overlay is then treated as shared, the episode's own copies included.

    ``attributes`` is the dict that holds the top-level values (an instance's ``__dict__``): a copy
    in it is given back by deleting it, so that the next read comes back to the overlay for it.
    """

    __slots__ = ("shared", "attributes", "memo", "touched", "created")

    def __init__(self, shared: SharedState | None, attributes: dict[str, Any] | None = None) -> None:
        self.shared = shared
        self.attributes = attributes
        # id(shared container) -> this overlay's copy of it.
        self.memo: dict[int, OverlayDict | OverlayList] = {}
        # Owned containers written during the running call, each once.
        self.touched: list[OverlayDict | OverlayList] = []
        # (parent, key, shared, copy) for every copy made during the running call.
        self.created: list[tuple[Any, Any, Any, Any]] = []

    def resolve(self, parent: Any, key: Any, value: Any) -> Any:
        """The overlay's own version of container ``value`` found at ``parent[key]`` (made on first access)."""
        kind = type(value)
        if kind is OverlayDict or kind is OverlayList:
            if value._overlay is self:
                return value
        elif self.shared is not None and not self.shared.is_shared(value):
            return value  # a container the running call made: plain until the call ends
        copy = self.memo.get(id(value))
        if copy is None:
            copy = self.own(value, (*parent._path, key) if type(parent) in _OWNED else (key,))
            self.created.append((parent, key, value, copy))
        (list.__setitem__ if type(parent) is OverlayList else dict.__setitem__)(parent, key, copy)
        return copy

    def own(self, value: Any, path: Path) -> OverlayDict | OverlayList:
        """A shallow copy of shared container ``value`` owned by this overlay, remembered by its id."""
        copy: OverlayDict | OverlayList
        kind = type(value)
        # From raw storage: a copy's own reads would make copies. A plain source takes C's fast path.
        if kind is dict:
            copy = OverlayDict(value)
        elif kind is list:
            copy = OverlayList(value)
        elif kind is OverlayDict:
            copy = OverlayDict(dict.items(value))
        else:
            copy = OverlayList(list.__iter__(value))
        _init(copy, self, path, written=False, origin=value if self.shared is not None else None)
        self.memo[id(value)] = copy
        return copy

    def release(self) -> None:
        """Forget every copy: copies point back at their overlay, and the cycle would wait for the collector."""
        self.memo.clear()
        self.created.clear()
        self.touched.clear()

    def view(self, attributes: dict[str, Any]) -> OverlayDict:
        """A root over ``attributes`` whose containers this (read-only view) overlay copies on access."""
        return _init(OverlayDict(attributes), self, (), written=True)

    def detach(self, value: Any, frozen: set[int]) -> Any:
        """``value`` (made by code that read this read-only view's containers) with plain containers only: a
        copy this overlay made goes back to being its original when nothing was written to it or to a copy
        under it, else becomes a plain dict or list; plain containers are changed in place. Containers whose
        ids are in ``frozen`` are left as they are, unread: the cost follows what the code copied and made."""
        originals: dict[int, Any] = {}
        kept: set[int] = set()  # copies that cannot go back: written, or holding a copy that was
        for parent, _, original, copy in reversed(self.created):  # children before their parents
            originals[id(copy)] = original
            if copy._written or id(copy) in kept:
                kept.add(id(copy))
                kept.add(id(parent))
        done: dict[int, Any] = {}

        def walk(item: Any) -> Any:
            kind = type(item)
            if kind not in _CONTAINERS or id(item) in frozen:
                return item
            if id(item) in done:
                return done[id(item)]
            if id(item) in originals and id(item) not in kept:
                result = done[id(item)] = originals[id(item)]
                return result
            if kind is OverlayDict or kind is dict:
                target = done[id(item)] = {} if kind is OverlayDict else item
                for key, child in list(dict.items(item)):
                    new = walk(child)
                    if target is not item or new is not child:
                        dict.__setitem__(target, key, new)
                return target
            target = done[id(item)] = [] if kind is OverlayList else item
            children = [walk(child) for child in list.__iter__(item)]
            if target is item:
                list.__setitem__(target, slice(None), children)
            else:
                target.extend(children)
            return target

        result = walk(value)
        self.release()
        return result

    # -- the end of a call --------------------------------------------------------------------------

    def adopt(self, value: Any, path: Path, adopted: dict[int, Any], holders: tuple[int, ...] = ()) -> Any:
        """``value`` with the plain containers the running call made turned into owned ones (recursively).

        Shared originals and owned copies inside it stay as they are. NotNative when it holds
        something that is not JSON-shaped, or refers back to one of ``holders`` (the ids of the
        containers it is stored under) or to a container of its own that holds it.
        """
        kind = type(value)
        if kind is dict or kind is list:
            if self.shared is not None and self.shared.is_shared(value):
                return value
            if id(value) in holders:
                raise NotNative(f"a back-link: {json_pointer(path)} refers back to a container that holds it")
            done = adopted.get(id(value))
            if done is not None:
                return done
            copy: Any
            inner = (*holders, id(value))
            if kind is dict:
                copy = adopted[id(value)] = _init(OverlayDict(), self, path, written=True)
                for key, child in value.items():
                    if type(key) is not str:
                        raise NotNative(f"a dict key of type {type(key).__name__} ({key!r})")
                    dict.__setitem__(copy, key, self.adopt(child, (*path, key), adopted, inner))
            else:
                copy = adopted[id(value)] = _init(OverlayList(), self, path, written=True)
                list.extend(copy, [self.adopt(child, (*path, i), adopted, inner) for i, child in enumerate(value)])
            return copy
        if kind is OverlayDict or kind is OverlayList:
            self._refuse_back_link(value, path, holders)
            return value
        if kind is float and not math.isfinite(value):
            raise NotNative(f"the float {value!r}")
        if kind not in _NATIVE_SCALARS:
            raise NotNative(f"a value of type {kind.__name__}")
        return value

    def finish_call(self) -> tuple[list[StateChange], NotNative | None]:
        """Adopt what the call stored, list what it changed, give back the copies it only read.

        Returns the changes, and the problem when the call stored something not JSON-shaped (the
        caller must then stop sharing: the overlay's notes are cleared all the same).
        """
        touched, self.touched = self.touched, []
        changes: list[StateChange] = []
        adopted: dict[int, Any] = {}
        problem: NotNative | None = None
        for container in touched:
            before = container._before
            if before is None:
                continue  # listed, then interrupted before its first note
            container._before = None
            try:
                self._adopt_written(container, before, adopted)
            except NotNative as e:
                problem = problem or e  # still listed: values JSON lacks, back-links too, are diffed as JSON text has them
            changes.extend(_container_changes(container, before))
        self.settle()
        return changes, problem

    def undo_call(self) -> None:
        """Put every owned container the running call wrote back as it was before the call."""
        touched, self.touched = self.touched, []
        for container in touched:
            before, container._before = container._before, None
            if before is None:
                continue
            if type(container) is OverlayDict:
                for key, old in before.items():
                    if old is MISSING:
                        dict.pop(container, key, None)
                    else:
                        dict.__setitem__(container, key, old)
            else:
                list.__setitem__(container, slice(None), before)
        self.settle()

    def _adopt_written(self, container: Any, before: Any, adopted: dict[int, Any]) -> None:
        holders = (id(container),)
        if type(container) is OverlayDict:
            for key, old in before.items():
                value = dict.get(container, key, MISSING)
                kind = type(value)
                if kind is dict or kind is list:
                    dict.__setitem__(container, key, self.adopt(value, (*container._path, key), adopted, holders))
                elif (kind is OverlayDict or kind is OverlayList) and value is not old:
                    self._refuse_back_link(value, (*container._path, key), holders)
        else:
            was_here: set[int] | None = None
            for index, value in enumerate(list.__iter__(container)):
                kind = type(value)
                if kind is dict or kind is list:
                    list.__setitem__(container, index, self.adopt(value, (*container._path, index), adopted, holders))
                elif kind is OverlayDict or kind is OverlayList:
                    # Only an item new to the list makes a new link (a sort or a reverse moves the old ones).
                    was_here = {id(item) for item in before} if was_here is None else was_here
                    if id(value) not in was_here:
                        self._refuse_back_link(value, (*container._path, index), holders)

    def _refuse_back_link(self, owned: Any, path: Path, holders: tuple[int, ...]) -> None:
        """NotNative when ``owned`` (an owned container a call stored at ``path``) reaches one of ``holders``.

        A search of the episode's own containers under it, paid only when a call stores a container the
        episode already holds elsewhere: frozen originals hold no owned container, so it stops at them.
        """
        if not holders:
            return
        targets = set(holders)
        seen: set[int] = set()
        stack = [owned]
        shared = self.shared
        while stack:
            item = stack.pop()
            if id(item) in targets:
                raise NotNative(f"a back-link: {json_pointer(path)} refers back to a container that holds it "
                                f"({json_pointer(owned._path)})")
            if id(item) in seen or (shared is not None and shared.is_shared(item)):
                continue
            seen.add(id(item))
            children = dict.values(item) if isinstance(item, dict) else list.__iter__(item)
            stack.extend(child for child in children if isinstance(child, (dict, list)))

    def settle(self) -> None:
        """Give back the copies made during this call that were never written and nothing else holds.

        Children come back before their parents; a copy must also still equal its original, which
        covers writes that bypassed the notes (C code writing a list's raw storage).
        """
        created, self.created = self.created, []
        memo, attributes = self.memo, self.attributes
        while created:
            # Popped, not iterated: a child's entry must not keep its parent referenced.
            parent, key, shared, copy = created.pop()
            if copy._written or sys.getrefcount(copy) > _SPARE_REFERENCES:
                continue
            if type(parent) is OverlayList:
                if not (0 <= key < len(parent) and list.__getitem__(parent, key) is copy):
                    continue
            elif dict.get(parent, key) is not copy:
                continue
            if (dict.__eq__ if type(copy) is OverlayDict else list.__eq__)(copy, shared) is not True:
                continue
            if parent is attributes:
                del parent[key]
            else:
                (list.__setitem__ if type(parent) is OverlayList else dict.__setitem__)(parent, key, shared)
            del memo[id(shared)]


def _init(container: Any, overlay: Overlay, path: Path, *, written: bool, origin: Any = None) -> Any:
    container._overlay = overlay
    container._path = path
    container._before = None
    container._written = written
    # The shared container this one copies (None for one a call made): state hashes start from its digest.
    container._origin = origin
    return container


_SPARE_REFERENCES = _calibrate_spare_references()


def _container_changes(container: Any, before: Any) -> list[StateChange]:
    """What one call changed in one owned container, as leaf changes under its path."""
    path = list(container._path)
    changes: list[StateChange] = []
    if type(container) is OverlayDict:
        for key, old in before.items():
            new = dict.get(container, key, MISSING)
            if new is old:
                continue
            changes.extend(value_changes([*path, key], old, new))
        return changes
    old_items, new_items = before, list(list.__iter__(container))
    if len(old_items) == len(new_items):
        for index, (old, new) in enumerate(zip(old_items, new_items)):
            if old is not new:
                changes.extend(value_changes([*path, index], old, new))
        return changes
    return list_changes(path, old_items, new_items, _jsonable) or value_changes(path, old_items, new_items)


def value_changes(path: list[str | int], old: Any, new: Any) -> list[StateChange]:
    """The leaf changes between two values at ``path`` (``MISSING`` on one side: added or removed)."""
    if old is MISSING:
        return [StateChange(path=path, after=_jsonable(new), op="add")]
    if new is MISSING:
        return [StateChange(path=path, before=_jsonable(old), op="remove")]
    return json_diff(_jsonable(old), _jsonable(new), path)


def _jsonable(value: Any) -> Any:
    """A plain copy of a value, converted the way the state is for JSON when it is not JSON-shaped."""
    if type(value) in _NATIVE_SCALARS:
        return value
    try:
        copied = _deep_plain(value)
    except RecursionError:  # a back-link the call stored (the episode then goes private): written as {"$ref": ...}
        return json_ready(value)
    try:
        _collect_native(copied, set())
    except NotNative:
        return json.loads(to_json_text(copied)[0])
    return copied
