"""EnvScaler farm core: data model, guarded environment runtime, bundles, quality gates.

This package imports no other package of the project; ``servers``, ``synth`` and ``agent_client``
build on it. Its names load on first use (PEP 562), so that ``import envscaler`` costs nothing: a
command line that starts with it can take Ctrl-C as a command, not as a traceback of its imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envscaler.bundle import default_catalog, find_bundles, load_bundle, load_bundles, save_bundle
    from envscaler.errors import BundleError, ChecklistError, EnvCodeError, EnvScalerError
    from envscaler.gates import EnvReport, check_bundle
    from envscaler.guard import TimeLimitExceeded, call_with_limit
    from envscaler.models import (
        Bundle,
        CheckContext,
        CheckItem,
        CheckResult,
        EnvSpec,
        Scenario,
        StateChange,
        ToolCall,
        ToolOutcome,
        ToolSchema,
        Turn,
        ValidationResult,
    )
    from envscaler.runtime import EnvRuntime, Episode
    from envscaler.tools import derive_tools
    from envscaler.wire import EnvEndpoint, FarmCatalog

_WHERE = {
    "Bundle": "envscaler.models",
    "BundleError": "envscaler.errors",
    "CheckContext": "envscaler.models",
    "CheckItem": "envscaler.models",
    "CheckResult": "envscaler.models",
    "ChecklistError": "envscaler.errors",
    "EnvCodeError": "envscaler.errors",
    "EnvEndpoint": "envscaler.wire",
    "EnvReport": "envscaler.gates",
    "EnvRuntime": "envscaler.runtime",
    "EnvScalerError": "envscaler.errors",
    "EnvSpec": "envscaler.models",
    "Episode": "envscaler.runtime",
    "FarmCatalog": "envscaler.wire",
    "Scenario": "envscaler.models",
    "StateChange": "envscaler.models",
    "TimeLimitExceeded": "envscaler.guard",
    "ToolCall": "envscaler.models",
    "ToolOutcome": "envscaler.models",
    "ToolSchema": "envscaler.models",
    "Turn": "envscaler.models",
    "ValidationResult": "envscaler.models",
    "call_with_limit": "envscaler.guard",
    "check_bundle": "envscaler.gates",
    "default_catalog": "envscaler.bundle",
    "derive_tools": "envscaler.tools",
    "find_bundles": "envscaler.bundle",
    "load_bundle": "envscaler.bundle",
    "load_bundles": "envscaler.bundle",
    "save_bundle": "envscaler.bundle",
}
"""Where each public name lives."""


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'envscaler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__all__ = [
    "Bundle",
    "BundleError",
    "CheckContext",
    "CheckItem",
    "CheckResult",
    "ChecklistError",
    "EnvCodeError",
    "EnvEndpoint",
    "EnvReport",
    "EnvRuntime",
    "EnvScalerError",
    "EnvSpec",
    "Episode",
    "FarmCatalog",
    "Scenario",
    "StateChange",
    "TimeLimitExceeded",
    "ToolCall",
    "ToolOutcome",
    "ToolSchema",
    "Turn",
    "ValidationResult",
    "call_with_limit",
    "check_bundle",
    "default_catalog",
    "derive_tools",
    "find_bundles",
    "load_bundle",
    "load_bundles",
    "save_bundle",
]
