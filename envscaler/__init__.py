"""EnvScaler farm core: data model, guarded environment runtime, bundles, quality gates.

This package imports no other package of the project; ``servers``, ``synth`` and ``agent_client``
build on it.
"""

from envscaler.bundle import default_catalog, find_bundles, load_bundle, load_bundles, save_bundle
from envscaler.errors import BundleError, ChecklistError, EnvCodeError, EnvScalerError
from envscaler.gates import EnvReport, check_bundle
from envscaler.guard import TimeLimitExceeded, call_with_limit
from envscaler.models import (
    Bundle,
    CheckItem,
    CheckResult,
    EnvSpec,
    Scenario,
    StateChange,
    ToolCall,
    ToolOutcome,
    ToolSchema,
    ValidationResult,
)
from envscaler.runtime import EnvRuntime, Episode
from envscaler.tools import derive_tools
from envscaler.wire import EnvEndpoint, FarmCatalog

__all__ = [
    "Bundle",
    "BundleError",
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
