"""The policy check on generated code: what it rejects, what it lets through."""

from __future__ import annotations

import pytest

from synth.policy import check_check_function, check_class, check_code, check_method
from tests.support.synth_script import CLASS_NAME, METHODS, SKELETON


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os\n", "import of 'os' is not allowed"),
        ("from os import path\n", "import of 'os' is not allowed"),
        ("import subprocess\n", "import of 'subprocess'"),
        ("import socket as s\n", "import of 'socket'"),
        ("from . import sibling\n", "relative imports"),
        ("def f(self):\n    return open('/etc/passwd').read()\n", "use of 'open'"),
        ("def f(self):\n    return eval('1+1')\n", "use of 'eval'"),
        ("def f(self):\n    exec('x = 1')\n", "use of 'exec'"),
        ("def f(self):\n    return __import__('os')\n", "'__import__'"),
        ("def f(self):\n    return ().__class__.__bases__[0].__subclasses__()\n", "attribute '__class__'"),
        ("def f(self, g):\n    return g.__globals__\n", "attribute '__globals__'"),
        ("def f(self, fn):\n    return fn.__code__\n", "attribute '__code__'"),
        ("def f(self, e):\n    return e.__traceback__.tb_frame.f_globals\n", "attribute"),
        ("def f(self, x):\n    return getattr(x, '__cl' + 'ass__')\n", "getattr() needs a literal attribute name"),
        ("def f(self, x):\n    return getattr(x, '__dict__')\n", "getattr() of dunder attribute '__dict__'"),
        ("def f(self, x):\n    return '{0.__class__}'.format(x)\n", "format strings that read dunder attributes"),
        ("def f(self):\n    return __builtins__\n", "'__builtins__'"),
        ("def f(self):\n    return globals()\n", "use of 'globals'"),
        ("print('loaded')\n", "module-level Expr is not allowed"),
        ("for i in range(3):\n    pass\n", "module-level For is not allowed"),
        ("def f(self):\n    global counter\n    counter = 1\n", "'global' is not allowed"),
        ("def f(self:\n", "syntax error"),
    ],
)
def test_policy_rejects_escapes(source, expected):
    problems = check_code(source)
    assert any(expected in p for p in problems), problems
    assert all(p.startswith("line ") for p in problems)


def test_policy_accepts_ordinary_environment_code():
    code = (
        "from typing import Dict, TypedDict\nimport copy\nfrom datetime import datetime, timedelta\nimport re\n"
        "LIMIT = 3\n\n\nclass A:\n    \"\"\"Doc.\"\"\"\n\n    def __init__(self, init_config: dict):\n"
        "        super().__init__()\n        self.items: Dict[str, dict] = {}\n        setattr(self, 'mode', 'x')\n\n"
        "    def get(self, key: str) -> dict:\n        value = getattr(self, 'items').get(key)\n"
        "        return {'success': True, 'data': copy.deepcopy(value), 'kind': type(value).__name__}\n"
    )
    assert check_code(code) == []
    assert check_class(code, "A") == []


def test_structure_checks():
    assert check_class(SKELETON, CLASS_NAME) == []
    assert "defines no class" in check_class(SKELETON, "Other")[0]
    assert "__init__(self, init_config" in check_class("class A:\n    def __init__(self):\n        pass\n", "A")[0]
    for name, code in METHODS.items():
        assert check_method(code, name) == []
    assert "exactly one function" in check_method(METHODS["get_booking"], "cancel_booking")[0]
    assert "docstring" in check_method("def g(self):\n    return {}\n", "g")[0]
    assert check_check_function("def check_func(final_state):\n    return True\n") == []
    assert "check_func" in check_check_function("def other(final_state):\n    return True\n")[0]
    assert "import of 'os'" in check_check_function("import os\ndef check_func(s):\n    return os.path.exists('x')\n")[0]
