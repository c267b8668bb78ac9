"""The ``envscaler.commands`` entry points of this checkout's pyproject.toml, for child processes.

``envscaler`` finds its subcommands through installed package metadata, which names the commands of
the checkout that was installed. A test of a command added since then (or in another worktree) puts
a stand-in metadata folder, written from this checkout's pyproject.toml, first on the child's
PYTHONPATH: importlib.metadata takes the first distribution of a name it finds, so the child sees
this checkout's commands and nothing is reinstalled.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def checkout_commands_env(root: Path) -> dict[str, str]:
    """An environment for ``tests.support.cli.envscaler(env=...)`` whose ``envscaler`` has this checkout's commands."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = root / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = ["[console_scripts]", *(f"{k} = {v}" for k, v in project["scripts"].items()), "", "[envscaler.commands]",
             *(f"{k} = {v}" for k, v in project["entry-points"]["envscaler.commands"].items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    path = os.pathsep.join(p for p in (str(root), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}
