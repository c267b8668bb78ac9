"""Multi-class environments: several classes of one ``env_class_code`` served as one environment.

BFCL's tasks combine API classes (a file system, a messaging app, a trading bot) whose attribute
names collide, each loading its own part of the scenario. :func:`compose` builds one class whose
instance holds one instance per part (``EnvSpec.classes``), under the part's name: the runtime then
treats it as any environment. Its state, the public attributes, is ``{part.name: that instance}``,
which the state module writes as that instance's public attributes. Its tools are forwarders to
the parts' public methods, carrying their signatures, docstrings and annotations, so schemas,
argument checks and result schemas come out as for the part's own method.

Each part is built as ``cls()`` and then ``getattr(instance, loader)(config, **loader_arguments)``
when the part names a loader; otherwise as EnvScaler does (``cls(config)``, falling back to ``cls()``, then every key set
as an attribute). A tool name found in two parts is refused: the agent could not say which it means.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from envscaler.errors import BundleError
from envscaler.models import ClassPart
from envscaler.tools import public_methods

_PARTS = "__envscaler_parts__"


def compose(env_id: str, name: str, parts: list[tuple[ClassPart, type]], module: str) -> type:
    """One class, named ``name`` in ``module``, whose instances hold the ``parts`` and forward their tools.

    Raises BundleError when two parts define the same tool, or a tool is named like a part.
    """
    owners: dict[str, ClassPart] = {}
    namespace: dict[str, Any] = {}
    part_names = {part.name for part, _ in parts}
    for part, cls in parts:
        for tool, function in public_methods(cls).items():
            other = owners.get(tool)
            if other is not None:
                first = next(c for p, c in parts if p is other)
                raise BundleError(f"{env_id}: tool {tool!r} is a method of both {first.__name__} (part {other.name!r}) "
                                  f"and {cls.__name__} (part {part.name!r}); an agent could not tell which it calls")
            if tool in part_names:
                raise BundleError(f"{env_id}: {cls.__name__}.{tool} has the name of the part {tool!r}; rename the part")
            owners[tool] = part
            namespace[tool] = _forwarder(part.name, tool, function)

    def __init__(self: Any, init_config: dict[str, Any] | None = None) -> None:
        config = init_config or {}
        unknown = sorted(set(config) - part_names)
        if unknown:
            raise ValueError(f"init_config names {', '.join(map(repr, unknown))}, which are not parts of this environment "
                             f"(its parts: {', '.join(sorted(part_names))})")
        for part, cls in parts:
            setattr(self, part.name, _build(part, cls, config.get(part.name) or {}))

    namespace.update({"__init__": __init__, _PARTS: tuple(parts), "__module__": module, "__qualname__": name,
                      "__doc__": f"The classes {', '.join(cls.__name__ for _, cls in parts)} side by side."})
    return type(name, (), namespace)


def part_classes(cls: type) -> list[type]:
    """The classes a composed class holds, or ``[cls]`` for a class of its own."""
    parts = getattr(cls, _PARTS, None)
    return [part_cls for _, part_cls in parts] if parts else [cls]


def _build(part: ClassPart, cls: type, config: Any) -> Any:
    if part.loader is None:
        if not isinstance(config, dict):
            raise ValueError(f"the configuration of part {part.name!r} must be an object, got {type(config).__name__}")
        return construct(cls, config)
    instance = cls()
    getattr(instance, part.loader)(config, **(part.loader_arguments or {}))
    return instance


def construct(cls: type, config: dict[str, Any]) -> Any:
    """EnvScaler's construction: ``cls(config)`` (``cls()`` when it takes no argument), then every key set as an
    attribute. A composed class builds its parts itself, from ``{part.name: config}``."""
    if getattr(cls, _PARTS, None):
        return cls(config)
    # EnvScaler falls back to cls() when cls(init_config) fails; falling back only when the
    # constructor cannot take the argument keeps a TypeError inside __init__ visible.
    instance = cls(config) if _takes_config(cls) else cls()
    for key, value in config.items():
        setattr(instance, key, value)
    return instance


@functools.lru_cache(maxsize=256)
def _takes_config(cls: type) -> bool:
    try:
        inspect.signature(cls).bind({})
    except TypeError:
        return False
    except ValueError:  # no signature to inspect: let the call decide
        return True
    return True


def _forwarder(part: str, tool: str, function: Any) -> Any:
    """A method that calls ``tool`` on the instance's ``part``, looking to ``inspect`` and ``typing`` like ``function``."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, part), tool)(*args, **kwargs)

    return functools.update_wrapper(forward, function)
