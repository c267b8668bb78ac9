"""Python distributions an environment's code needs (``requires`` in env.json): checked where it is served.

Each entry is a PEP 508 requirement (``"mpmath>=1.3"``, ``"numpy; python_version >= '3.11'"``), read
with the ``packaging`` library pip itself uses. ``envscaler serve`` (and so the process backend, and a
container at its start) refuses an environment whose requirements this interpreter does not meet,
naming each one and the command that installs them; the quality gates fail ``class_loads`` the same
way. An environment image installs them when it is built (``servers.farm.backends.images``).
"""

from __future__ import annotations

import shlex
import sys
from typing import TYPE_CHECKING

from envscaler.errors import EnvCodeError

if TYPE_CHECKING:
    from packaging.requirements import Requirement


class MissingRequirements(EnvCodeError):
    """The environment needs Python distributions that are not installed (or not in a version it takes)."""


def parse_requirement(text: str) -> Requirement:
    """``text`` as a PEP 508 requirement; ValueError saying what is wrong with it."""
    # Imported here: packaging (with importlib.metadata, email, zipfile) costs every worker about 2.5 MB, and few
    # environments have requirements at all.
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        return Requirement(text)
    except InvalidRequirement as e:
        # Its first line: packaging goes on to draw a caret under the text, and errors here are one line.
        raise ValueError(f"{text!r} is not a PEP 508 requirement (such as 'mpmath>=1.3'): {str(e).splitlines()[0]}") from None


def unmet(requires: list[str]) -> list[str]:
    """What this interpreter lacks of ``requires``: one line per requirement it does not meet.

    A requirement whose marker does not apply here (``; sys_platform == 'win32'``) is met.
    """
    from importlib.metadata import PackageNotFoundError, version  # see parse_requirement

    problems = []
    for text in requires:
        requirement = parse_requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            problems.append(f"{text} (not installed)")
            continue
        if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{text} ({requirement.name} {installed} is installed)")
    return problems


def require_installed(env_id: str, requires: list[str] | None) -> None:
    """MissingRequirements naming every requirement of ``env_id`` this interpreter does not meet, and the
    pip command that installs them into it."""
    problems = unmet(requires or [])
    if problems:
        command = shlex.join([sys.executable, "-m", "pip", "install", *(requires or [])])
        raise MissingRequirements(f"{env_id}: needs Python distributions this interpreter lacks: {'; '.join(problems)}. "
                                  f"Install them with: {command}")
