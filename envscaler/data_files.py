"""A bundle's data files: ``<bundle>/data/``, named by a scenario's ``init_config``.

A top-level ``init_config`` value ``{"$file": "data/NAME.json"}`` stands for the parsed JSON content
of that file. Benchmarks ship their databases as files of a hundred megabytes and more, shared by
every task: written inline, each scenario would carry a copy, and the server, which parses the
scenarios, would hold them all. A reference keeps the server's copy of a scenario small; it only
checks that the file is there (:func:`check_references`, no file is opened). The process that runs
the environment's code loads each file once (:class:`DataFiles`) and shares its content, frozen, by
every episode that names it, whatever the scenario (``envscaler.runtime``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from envscaler.errors import BundleError
from envscaler.models import Bundle, Scenario

DATA_DIR = "data"
"""The folder of a bundle that holds its data files."""
FILE_KEY = "$file"
"""The key of the one-key object that names a data file in an ``init_config``."""


def data_folders(bundle: Bundle) -> tuple[Path, ...]:
    """The bundle's data folder, where it has one: what a sandbox running its code must show (read-only)."""
    if bundle.directory is None or not (bundle.directory / DATA_DIR).is_dir():
        return ()
    return ((bundle.directory / DATA_DIR).resolve(),)


def data_megabytes(bundle: Bundle) -> float:
    """The size in MB of the data files the bundle's scenarios name (read from the folder, no file opened)."""
    names = {name for scenario in bundle.scenarios for name in references(scenario.init_config).values()}
    return sum(data_file_path(bundle.directory, name, bundle.env_id).stat().st_size for name in names) / (1024 * 1024)


def references(init_config: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys of ``init_config`` whose value names a data file, with what it names (not checked)."""
    return {key: value[FILE_KEY] for key, value in init_config.items() if isinstance(value, dict) and FILE_KEY in value}


def check_references(bundle_dir: Path | None, init_config: dict[str, Any], where: str) -> None:
    """BundleError naming ``where`` (the scenario) when a data file reference of ``init_config`` is malformed,
    leaves the bundle's data folder, or names no file. Only looks at paths: no file is opened."""
    for key, value in init_config.items():
        if isinstance(value, dict) and FILE_KEY in value:
            if len(value) != 1:
                raise BundleError(f"{where}: init_config.{key}: a data file reference is {{\"{FILE_KEY}\": \"{DATA_DIR}/NAME.json\"}} "
                                  f"alone, but it also has {', '.join(repr(k) for k in value if k != FILE_KEY)}")
            data_file_path(bundle_dir, value[FILE_KEY], f"{where}: init_config.{key}")


def data_file_path(bundle_dir: Path | None, name: Any, where: str) -> Path:
    """Where data file ``name`` (``data/NAME.json``, relative to the bundle) is; BundleError naming ``where``
    when it is not a relative path inside the bundle's data folder (no ``..``, no symlink out) to a file."""
    usage = f"name a file of the bundle's {DATA_DIR}/ folder, as \"{DATA_DIR}/NAME.json\""
    if not isinstance(name, str) or not name:
        raise BundleError(f"{where}: {FILE_KEY} must be a path: {usage}")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or "\\" in name or ".." in parts or len(parts) < 2 or parts[0] != DATA_DIR:
        raise BundleError(f"{where}: {FILE_KEY} {name!r} is not a path inside the bundle's {DATA_DIR}/ folder: {usage}")
    if bundle_dir is None:
        raise BundleError(f"{where}: {FILE_KEY} {name!r}: this bundle was not loaded from a folder, so it has no data files")
    folder = (bundle_dir / DATA_DIR).resolve()
    path = (bundle_dir / name).resolve()
    if not path.is_relative_to(folder):
        raise BundleError(f"{where}: {FILE_KEY} {name!r} leads out of the bundle's {DATA_DIR}/ folder (a symlink to {path}): "
                          f"put the file itself in {folder}")
    if not path.is_file():
        raise BundleError(f"{where}: {FILE_KEY} {name!r}: no such file in {folder}")
    return path


class DataFiles:
    """The data files one process has loaded, each parsed once and kept for as long as the process runs.

    What it hands out is shared by every episode that names the file: callers must never change it
    (``envscaler.runtime`` gives environment code copies of what it touches). ``container_ids`` holds
    the id of every dict and list in them (unless ``list_containers`` is False: a process that only reads
    them): they never change and never die, so their ids stay theirs.
    """

    def __init__(self, bundle_dir: Path | None, env_id: str, *, list_containers: bool = True) -> None:
        self.bundle_dir = bundle_dir
        self.env_id = env_id
        self.list_containers = list_containers
        self._loaded: dict[str, Any] = {}
        # id(a file's content) -> the file's name.
        self._names: dict[int, str] = {}
        self.container_ids: set[int] = set()

    def load(self, name: Any, where: str) -> Any:
        """The parsed content of data file ``name`` (loaded on first use). BundleError naming ``where``
        when the reference is bad or the file is not JSON."""
        if isinstance(name, str) and name in self._loaded:
            return self._loaded[name]
        path = data_file_path(self.bundle_dir, name, f"{self.env_id}: {where}")
        try:
            with path.open("rb") as file:
                value = json.load(file, parse_constant=_refuse_constant)
        except OSError as e:
            raise BundleError(f"{self.env_id}: {where}: cannot read {path}: {e.strerror}") from None
        except (ValueError, RecursionError) as e:
            raise BundleError(f"{self.env_id}: {where}: {path} is not JSON: {e}") from None
        if self.list_containers:
            _add_container_ids(value, self.container_ids)
        self._loaded[name] = value
        if type(value) in (dict, list):  # a scalar's object may be any other value's too (small ints, interned text)
            self._names[id(value)] = name
        return value

    def reference(self, value: Any) -> dict[str, str] | None:
        """The reference to the file whose content, as loaded here, ``value`` is, or None: what
        :meth:`resolved` in another process turns back into the same value, at the cost of loading the file."""
        name = self._names.get(id(value))
        return {FILE_KEY: name} if name is not None else None

    def load_all(self, scenarios: Iterable[Scenario]) -> list[Any]:
        """Load every file ``scenarios`` name (ahead of their episodes); the contents, one per file."""
        for scenario in scenarios:
            self.resolved(scenario.init_config, f"scenario {scenario.task_id!r}")
        return list(self._loaded.values())

    def resolved(self, init_config: dict[str, Any], where: str) -> dict[str, Any]:
        """``init_config`` with each data file reference replaced by the file's shared content."""
        names = references(init_config)
        if not names:
            return init_config
        return {key: self.load(names[key], f"{where}: init_config.{key}") if key in names else value
                for key, value in init_config.items()}


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _add_container_ids(value: Any, ids: set[int]) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            ids.add(id(item))
            stack.extend(item.values())
        elif type(item) is list:
            ids.add(id(item))
            stack.extend(item)
