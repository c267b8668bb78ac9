"""Bundles on disk: ``<dir>/<env_id>/env.json``, ``<dir>/<env_id>/scenarios.jsonl`` and data files under
``<dir>/<env_id>/data/`` (``envscaler.data_files``)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from envscaler.data_files import DATA_DIR, check_references
from envscaler.errors import BundleError
from envscaler.jsonl import dumps, escape_unsafe, read_values
from envscaler.models import Bundle, EnvSpec, Scenario

ENV_FILE = "env.json"
SCENARIOS_FILE = "scenarios.jsonl"

M = TypeVar("M", bound=BaseModel)


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem: ``field.path: message``."""
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def parse_model(model: type[M], data: Any, where: str) -> M:
    """Validate ``data`` as ``model``; on failure raise BundleError naming ``where`` and the fields."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BundleError(f"{where}: {describe_validation_error(e)}") from None


def read_json(path: Path) -> Any:
    """Parse a JSON file; BundleError with the file, line and column when it is not JSON."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise BundleError(f"{path}: cannot read: {e.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BundleError(f"{path}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}") from None


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, object)`` for each non-blank line of a JSON Lines file (split on ``"\\n"`` only)."""
    try:
        yield from read_values(path)
    except OSError as e:
        raise BundleError(f"{path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise BundleError(str(e)) from None


def load_bundle(directory: str | Path) -> Bundle:
    """Load one bundle directory. Raises BundleError naming the file and field on bad input."""
    directory = Path(directory)
    env_path = directory / ENV_FILE
    if not env_path.is_file():
        raise BundleError(f"{directory}: not a bundle (no {ENV_FILE})")
    spec = parse_model(EnvSpec, read_json(env_path), str(env_path))
    scenarios: list[Scenario] = []
    scenarios_path = directory / SCENARIOS_FILE
    if not scenarios_path.is_file():
        # Most likely a half-copied bundle: serving it would offer no tasks without saying why.
        raise BundleError(f"{directory}: no {SCENARIOS_FILE} (an environment with no scenarios yet needs an empty one)")
    for number, item in read_jsonl(scenarios_path):
        scenario = parse_model(Scenario, item, f"{scenarios_path}:{number}")
        if scenario.env_id != spec.env_id:
            raise BundleError(
                f"{scenarios_path}:{number}: env_id: {scenario.env_id!r} does not match "
                f"{ENV_FILE}'s {spec.env_id!r}"
            )
        check_references(directory, scenario.init_config, f"{scenarios_path}:{number}: scenario {scenario.task_id!r}")
        scenarios.append(scenario)
    require_unique_task_ids(spec.env_id, scenarios, str(scenarios_path))
    return Bundle(spec=spec, scenarios=scenarios, directory=directory.resolve())


def require_unique_task_ids(env_id: str, scenarios: list[Scenario], where: str) -> None:
    """BundleError when two scenarios share a task_id: episodes, gate reports and records are keyed by it."""
    counts = Counter(s.task_id for s in scenarios)
    repeated = [f"{task_id!r} ({n} times)" for task_id, n in counts.items() if n > 1]
    if repeated:
        raise BundleError(
            f"{where}: {env_id}: duplicate task_id {', '.join(repeated[:5])}"
            f"{' and more' if len(repeated) > 5 else ''}: every scenario needs its own id; rename or drop the repeats"
        )


def save_bundle(bundle: Bundle, root: str | Path) -> Path:
    """Write ``bundle`` under ``root/<env_id>/`` and return that directory."""
    directory = Path(root) / bundle.spec.env_id
    directory.mkdir(parents=True, exist_ok=True)
    data = bundle.directory / DATA_DIR if bundle.directory is not None else None
    if data is not None and data.is_dir() and data.resolve() != (directory / DATA_DIR).resolve():
        shutil.copytree(data, directory / DATA_DIR, dirs_exist_ok=True)
    write_env_json(directory, bundle.spec.model_dump(mode="json", exclude_none=True))
    lines = [dumps(s.model_dump(mode="json", exclude_none=True)) for s in bundle.scenarios]
    (directory / SCENARIOS_FILE).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return directory


def write_env_json(directory: Path, spec: dict[str, Any]) -> None:
    """Write ``spec`` (env.json's object, as JSON data) into bundle ``directory``, as every writer here does."""
    text = escape_unsafe(json.dumps(spec, indent=2, ensure_ascii=False))
    (directory / ENV_FILE).write_text(text + "\n", encoding="utf-8")


def find_bundles(path: str | Path) -> list[Path]:
    """Bundle directories at ``path``: the directory itself if it is one, else its bundle children."""
    path = Path(path)
    if (path / ENV_FILE).is_file():
        return [path]
    if not path.is_dir():
        raise BundleError(f"{path}: no such directory")
    return sorted(child for child in path.iterdir() if (child / ENV_FILE).is_file())


def load_bundles(path: str | Path) -> list[Bundle]:
    """Every bundle at ``path`` (see find_bundles), in env_id order."""
    return [load_bundle(d) for d in find_bundles(path)]


def default_catalog() -> Path:
    """The catalog shipped inside this package."""
    return Path(__file__).parent / "catalog"


def bundle_path(where: str | Path) -> Path:
    """A bundle or folder of bundles given as a path, or as the env_id of a bundled environment.

    BundleError when it is neither, naming both readings, so that ``serve online_retail`` and
    ``catalog scenarios online_retail`` take the same names.
    """
    path = Path(where)
    if path.exists():
        return path
    bundled = default_catalog() / str(where)
    if path.name == str(where) and (bundled / ENV_FILE).is_file():
        return bundled
    raise BundleError(f"{where}: no such folder, and no environment of that name in the bundled catalog "
                      "('envscaler catalog list' shows them)")
