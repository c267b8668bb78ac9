"""What the project's own source files must hold to import on every Python it supports (3.11 and newer).

The suite runs on one interpreter, so a construct that only a newer one refuses passes here and breaks
there: Python 3.13 encodes each docstring as UTF-8 when it compiles it (to strip its indentation), and a
lone surrogate written as an escape (``"\\udfff"``) in a docstring makes the whole module fail to import,
which took ``envscaler farm`` away on 3.13.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("envscaler", "servers", "agent_client", "synth", "benchmarks", "tests")
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _sources() -> list[Path]:
    """The project's own Python files: not those of a virtual environment inside a package (``.ci/run``
    installs the interop clients' in ``tests/interop``: about 4,000 files of other projects)."""
    venvs = [marker.parent for package in PACKAGES for marker in (ROOT / package).rglob("pyvenv.cfg")]
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
                  if not any(path.is_relative_to(venv) for venv in venvs))


def test_the_packages_have_sources_to_check():
    names = {path.relative_to(ROOT).parts[0] for path in _sources()}
    assert names == set(PACKAGES)


def test_every_docstring_is_valid_utf8():
    unencodable = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, _DOCUMENTED):
                continue
            docstring = ast.get_docstring(node, clean=False)
            if docstring is None:
                continue
            try:
                docstring.encode("utf-8")
            except UnicodeEncodeError as e:
                line = node.body[0].lineno + docstring[:e.start].count("\n")
                unencodable.append(f"{path.relative_to(ROOT)}:{line}: {e.reason} ({docstring[e.start:e.end]!r}); "
                                   "write the escape itself (a doubled backslash) or make the docstring raw")
    assert not unencodable, "docstrings Python 3.13 cannot compile:\n" + "\n".join(unencodable)
