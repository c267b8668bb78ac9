"""Import EnvScaler's released files into bundles.

EnvScaler ships env metadata as one JSON object keyed by env_id, and scenarios as a JSON list of
task items. The SFT scenarios carry no ``checklist_with_func``: they import as unscored scenarios.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from envscaler.bundle import parse_model, read_json, read_jsonl, require_unique_task_ids, save_bundle
from envscaler.errors import BundleError
from envscaler.models import Bundle, EnvSpec, Scenario


class LeftOut(BaseModel):
    """One thing of the source an import could not express, and why."""

    item: str
    reason: str


class ImportReport(BaseModel):
    """What an import wrote and what it had to leave out."""

    environments: int = 0
    scenarios: int = 0
    unscored: int = 0
    orphans: dict[str, int] = Field(default_factory=dict)
    written: list[str] = Field(default_factory=list)
    left_out: list[LeftOut] = Field(default_factory=list)


def read_env_metadata(path: Path) -> list[EnvSpec]:
    """EnvScaler's ``*_env_metadata.json``: ``{env_id: item}``. The key fills a missing env_id."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise BundleError(f"{path}: expected a JSON object keyed by env_id, got {type(data).__name__}")
    specs = []
    for env_id, item in data.items():
        if not isinstance(item, dict):
            raise BundleError(f"{path}: {env_id}: expected an object, got {type(item).__name__}")
        specs.append(parse_model(EnvSpec, {"env_id": env_id, **item}, f"{path}: {env_id}"))
    return specs


def read_scenarios(path: Path) -> list[Scenario]:
    """A JSON list of task items (EnvScaler's release) or JSON Lines (our own bundles)."""
    if path.suffix == ".jsonl":
        items: list[tuple[str, Any]] = [(f"{path}:{n}", item) for n, item in read_jsonl(path)]
    else:
        data = read_json(path)
        if not isinstance(data, list):
            raise BundleError(f"{path}: expected a JSON list of task items, got {type(data).__name__}")
        items = [(f"{path}: item {i}", item) for i, item in enumerate(data)]
    return [parse_model(Scenario, item, where) for where, item in items]


def import_envscaler(envs_path: Path, scenario_paths: list[Path], out: Path) -> ImportReport:
    """Write one bundle per environment under ``out``; scenarios of unknown envs are counted, not written."""
    specs = read_env_metadata(envs_path)
    by_env: dict[str, list[Scenario]] = defaultdict(list)
    for path in scenario_paths:
        for scenario in read_scenarios(path):
            by_env[scenario.env_id].append(scenario)
    report = ImportReport()
    known = {s.env_id for s in specs}
    report.orphans = {env_id: len(items) for env_id, items in by_env.items() if env_id not in known}
    for spec in specs:
        scenarios = by_env.get(spec.env_id, [])
        require_unique_task_ids(spec.env_id, scenarios, ", ".join(str(p) for p in scenario_paths))
        directory = save_bundle(Bundle(spec=spec, scenarios=scenarios), out)
        report.environments += 1
        report.scenarios += len(scenarios)
        report.unscored += sum(1 for s in scenarios if not s.checklist_with_func)
        report.written.append(str(directory))
    return report
