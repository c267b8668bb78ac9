"""What every episode of an environment shares, kept as it was loaded: module globals and class attributes.

An episode is an instance, but the environment's module and classes exist once per process: a tool
that writes to a class attribute or a module global (``Env.registry.append(...)``, ``global
counter``) would change the world of every other episode, and a preempted call run again would
apply its change twice. Environment state belongs on ``self``. After each call the shared values
are compared with what they were at load; a changed one is put back and the caller is told which
it was, so the call can be reported as an environment error (and the gates reject such code).

The comparison must not make every call pay for the size of constant tables: a rebinding is seen
by identity, in place changes by equality with a copy taken at load, for containers of up to
``DEEP_CHECK_ITEMS`` items in all; bigger containers are compared by length only (an append or a
removal is seen, an element replaced in place is not).

The scorer's own namespaces (``envscaler.checks``, ``envscaler.runtime`` and their classes) are
compared by identity of every entry before each validation: a replaced ``run_check`` is put back
before any episode is scored. That stops a patch by assignment of what scoring calls, not a
replaced ``Episode.validate`` (the entry point that does the comparing) nor a determined attack from
inside the process: the sandbox and the time limits bound what such code can reach.

Some entries are Python's own bookkeeping, written into a namespace by the interpreter on the code's
behalf (``PYTHON_BOOKKEEPING``: a warning's ``__warningregistry__``, ``__annotations__`` made on first
read, ``copy``'s ``__slotnames__`` cache): they are not the environment's state and are never compared.
"""

from __future__ import annotations

import copy
import importlib
import sys
import types
from dataclasses import dataclass
from typing import Any

# Items (nested included) of the containers compared by equality after every call, all together.
DEEP_CHECK_ITEMS = 2_000
# The code that scores an episode: environment code may not patch it (``run_check = lambda ...``).
_CHECKER_MODULES = ("envscaler.checks", "envscaler.runtime")
_MISSING = object()
# Names the interpreter and the standard library write into a module's or a class's namespace by
# themselves: ``warnings.warn`` records what it showed in the caller's ``__warningregistry__`` (so any
# warning from a tool, a DeprecationWarning Python hides included, would read as a shared change),
# ``__annotations__`` is made on first read, ``copy``/``pickle`` cache ``__slotnames__`` on a class,
# and the import system owns the module's spec, loader, file, cache path and builtins.
PYTHON_BOOKKEEPING = frozenset({
    "__warningregistry__", "__annotations__", "__slotnames__",
    "__builtins__", "__cached__", "__file__", "__loader__", "__spec__",
})


@dataclass
class _Shared:
    owner: Any  # the module or the class the name lives on
    entries: Any  # its namespace (live)
    label: str  # "class attribute Env.registry", "module global counter"
    name: str
    value: Any  # the object bound at load (identity tells a rebinding)
    pristine: Any  # a copy taken at load, _MISSING when it cannot be copied
    deep: bool  # compared by equality with ``pristine``
    length: int | None  # else compared by length, when it has one


def _is_data(name: str, value: Any) -> bool:
    """Whether a namespace entry is data (as opposed to code: functions, classes, modules, descriptors)."""
    if name.startswith("__") and name.endswith("__"):
        return False
    if isinstance(value, (type, types.ModuleType)) or callable(value):
        return False
    kind = type(value)
    return not (hasattr(kind, "__get__") or hasattr(kind, "__set__"))


_PLAIN_SCALARS = (str, int, float, bool, bytes, type(None))


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is built of Python's own containers and scalars only: copying, comparing and
    measuring it then runs none of the environment's code (which would run outside any time limit)."""
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return True
    if depth > 32:
        return False
    if kind is dict:
        return all(type(k) in _PLAIN_SCALARS and _plain(v, depth + 1) for k, v in value.items())
    if kind in (list, tuple, set, frozenset):
        return all(_plain(item, depth + 1) for item in value)
    return False


def _items(value: Any, budget: int) -> int:
    """How many items ``value`` holds, nested ones included, counting no further than ``budget``."""
    if isinstance(value, dict):
        values: Any = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        values = value
    else:
        return 1
    total = len(value)
    for item in values:
        if total > budget:
            break
        total += _items(item, budget - total)
    return total


class EnvGlobals:
    """The data an environment's code shares between episodes: its module's globals and the attributes
    of the classes it defines."""

    def __init__(self, env_class: type, *, subclasses: tuple[type, ...] = ()) -> None:
        """``subclasses``: classes made from ``env_class`` at run time, whose attributes are shared as well."""
        module = sys.modules.get(env_class.__module__)
        classes = [value for value in list(vars(module).values())
                   if isinstance(value, type) and value.__module__ == module.__name__] if module is not None else [env_class]
        owners: list[tuple[Any, str]] = [(module, "module global ")] if module is not None else []
        owners += [(cls, f"class attribute {cls.__name__}.") for cls in [*classes, *subclasses]]
        # vars() of a class makes a new proxy on every call: each namespace's is taken once, and stays live.
        self._owners = [(owner, vars(owner), prefix, set(vars(owner))) for owner, prefix in owners]
        # The checker's namespaces, every entry as it was, and their identities: compared by ``==``, an
        # object planted there could claim to equal what it replaced.
        self._checker = [(namespace, vars(namespace), dict(vars(namespace)), _identities(vars(namespace)))
                         for namespace in _checker_namespaces()]
        self._shared: list[_Shared] = []
        budget = DEEP_CHECK_ITEMS
        for owner, prefix in owners:
            for name, value in list(vars(owner).items()):
                if not _is_data(name, value):
                    continue
                # Other objects (a lock, an instance of the environment's own class) are told by identity only.
                plain = _plain(value)
                pristine = copy.deepcopy(value) if plain else _MISSING
                size = _items(value, budget) if plain else 0
                deep = plain and size <= budget
                budget -= size if deep else 0
                # A scalar past the budget is immutable: its identity tells every change.
                length = len(value) if plain and not deep and isinstance(value, (dict, list, tuple, set, frozenset)) else None
                self._shared.append(_Shared(owner, vars(owner), prefix + name, name, value, pristine, deep, length))

    def restore_changed(self) -> list[str]:
        """Put back every shared value changed since load; the labels of those changed (none: ``[]``)."""
        changed = [shared for shared in self._shared if self._differs(shared)]
        added = []
        for owner, entries, prefix, names in self._owners:
            if len(entries) != len(names):
                present = set(entries)
                # Python's own entries come and go freely: follow them, so that the length tells again.
                names -= PYTHON_BOOKKEEPING - present
                names |= PYTHON_BOOKKEEPING & present
                added += [(owner, prefix, name) for name in present - names]
        for shared in changed:
            value = shared.value if shared.pristine is _MISSING else copy.deepcopy(shared.pristine)
            setattr(shared.owner, shared.name, value)
            shared.value = value
            shared.length = len(value) if shared.length is not None else None
        for owner, _, name in added:
            delattr(owner, name)
        return [shared.label for shared in changed] + [prefix + name for _, prefix, name in added]

    def restore_checker(self) -> list[str]:
        """Put back every entry of the checker's namespaces that was replaced since load; their names.

        Run before scoring rather than after every call: comparing ~130 entries by identity costs ~10 us.
        """
        patched = []
        for index, (namespace, live, entries, identities) in enumerate(self._checker):
            if _identities(live) != identities:
                patched += [f"{_qualified(namespace)}.{name}" for name in _put_back(namespace, entries)]
                self._checker[index] = (namespace, live, entries, _identities(live))  # put back, maybe in another order
        return patched

    @staticmethod
    def _differs(shared: _Shared) -> bool:
        current = shared.entries.get(shared.name, _MISSING)
        if current is not shared.value:
            return True
        if shared.deep:
            return bool(current != shared.pristine)
        return shared.length is not None and len(current) != shared.length


def _identities(entries: Any) -> tuple[int, ...]:
    # The originals are held in the snapshot, so no new object can take one of their ids.
    return tuple(id(value) for name, value in entries.items() if name not in PYTHON_BOOKKEEPING)


def _checker_namespaces() -> list[Any]:
    modules = [importlib.import_module(name) for name in _CHECKER_MODULES]
    classes = [value for module in modules for value in vars(module).values()
               if isinstance(value, type) and value.__module__ == module.__name__]
    return [*modules, *classes]


def _qualified(namespace: Any) -> str:
    return namespace.__name__ if isinstance(namespace, types.ModuleType) else f"{namespace.__module__}.{namespace.__qualname__}"


def _put_back(namespace: Any, entries: dict[str, Any]) -> list[str]:
    """Restore ``namespace`` (a module or a class) to ``entries``; the names that differed."""
    current = dict(vars(namespace))
    names = sorted(name for name in (current.keys() | entries.keys()) - PYTHON_BOOKKEEPING
                   if current.get(name, _MISSING) is not entries.get(name, _MISSING))
    for name in names:
        if name in entries:
            setattr(namespace, name, entries[name])
        else:
            delattr(namespace, name)
    return names


def describe_change(labels: list[str]) -> str:
    """What a caller reports about a call that changed shared values (``EnvGlobals.restore_changed``)."""
    return (f"changed {', '.join(labels)}, which every episode shares; it was put back "
            "(environment state belongs on self)")
