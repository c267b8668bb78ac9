"""Merging a benchmark's modules into one env_class_code: colliding module-level names renamed, local ones left."""

import ast

import pytest

from envscaler.importers.python_sources import MergeProblem, merge_modules

SHARED = '''
LIMIT = 3
'''

FIRST = '''
from __future__ import annotations
from datetime import datetime
from pkg.func_source_code.shared import LIMIT

STATE = {"n": 1}


class First:
    def stamp(self) -> str:
        return datetime(2024, 1, 1).isoformat() + str(STATE["n"] + LIMIT)
'''

SECOND = '''
import datetime
import os.path
from pkg.func_source_code.shared import LIMIT as CAP

STATE = {"n": 2}


def helper(STATE=None):
    return STATE


class Second:
    def year(self) -> int:
        return datetime.date(2024, 1, 1).year + STATE["n"] + CAP

    def shadowed(self, STATE: int) -> int:
        return STATE + len([STATE for STATE in range(2)])

    def bump(self) -> None:
        global STATE
        STATE = {"n": STATE["n"] + 1}
'''


def local(node):
    module = getattr(node, "module", None) or ""
    return module.rsplit(".", 1)[-1] if "func_source_code." in module else None


def run(code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, "<merged>", "exec"), namespace)  # noqa: S102 - code written above, in this test
    return namespace


def test_colliding_names_of_a_later_module_are_renamed_and_both_modules_still_work():
    merged = merge_modules({"shared": SHARED, "first": FIRST, "second": SECOND}, ["first", "second"], local, {"First", "Second"})
    assert merged.renamed == {"second": {"CAP": "LIMIT", "datetime": "_second__datetime", "STATE": "_second__STATE"}}
    assert merged.code.startswith("from __future__ import annotations")
    assert "func_source_code" not in merged.code and merged.code.count("LIMIT = 3") == 1
    namespace = run(merged.code)
    assert namespace["First"]().stamp() == "2024-01-01T00:00:004"
    second = namespace["Second"]()
    assert second.year() == 2024 + 2 + 3
    assert second.shadowed(5) == 7  # a parameter and a comprehension variable of that name are left alone
    second.bump()
    assert namespace["_second__STATE"] == {"n": 3} and namespace["STATE"] == {"n": 1}
    assert namespace["helper"](7) == 7


def test_return_annotations_of_the_kept_classes_can_be_dropped():
    merged = merge_modules({"shared": SHARED, "first": FIRST}, ["first"], local, {"First"}, drop_return_annotations=True)
    method = next(n for n in ast.walk(ast.parse(merged.code)) if isinstance(n, ast.FunctionDef) and n.name == "stamp")
    assert method.returns is None


@pytest.mark.parametrize(("sources", "message"), [
    ({"first": "from pkg.func_source_code.gone import X\n"}, "imports the benchmark module 'gone', which is not in the checkout"),
    ({"first": "def broken(:\n"}, "first: syntax error, line 1"),
    ({"first": "class First:\n    pass\n", "second": "First = 1\n"}, "second defines 'First', which an earlier module binds too"),
    ({"first": "import os\n", "second": "os = 1\nimport os.path\n"}, "cannot rename the package bound by 'import os.path'"),
])
def test_what_cannot_be_merged_is_refused_with_the_reason(sources, message):
    with pytest.raises(MergeProblem, match=message.replace("(", r"\(").replace(".", r"\.")):
        merge_modules(sources, list(sources), local, {"First"})
