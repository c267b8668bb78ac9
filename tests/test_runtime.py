"""The guarded runtime: EnvScaler semantics, the tool allowlist, argument checks, limits, checks."""

import importlib
import json
import sys
import threading
import time
import warnings

import pytest

from envscaler import ChecklistError, EnvCodeError, EnvRuntime, EnvSpec, default_catalog, derive_tools, load_bundle
from envscaler import loader
from envscaler import checks
from envscaler.checks import check_states, compile_checks_ahead
from envscaler.guard import Preempted, TimeLimitExceeded, call_preemptibly, call_with_limit
from envscaler.loader import compile_ahead
from envscaler.models import CheckItem
from tests.support.bundles import (
    CHECK_A_IS_3,
    CHECK_TMP_UNDER_ROOT,
    COUNTER_CODE,
    LINKS_CODE,
    counter_spec,
    folders_bundle,
    tagger_bundle,
    users_spec,
)

INIT = {"items": {"a": {"name": "A", "count": 0}}}


@pytest.fixture
def runtime():
    return EnvRuntime(EnvSpec.model_validate(counter_spec()), call_timeout_s=0.5, check_timeout_s=0.5)


def test_instance_follows_envscaler_semantics():
    code = '''
class WithArg:
    def __init__(self, init_config):
        self.seen = sorted(init_config)
        self.items = {}
class NoArg:
    def __init__(self):
        self.items = {}
        self._hidden = 1
'''
    with_arg = EnvRuntime(EnvSpec(env_id="e", env_class_name="WithArg", env_class_code=code))
    episode = with_arg.new_episode({"items": {"x": 1}, "extra": [1]})
    assert episode.state() == {"seen": ["extra", "items"], "items": {"x": 1}, "extra": [1]}
    no_arg = EnvRuntime(EnvSpec(env_id="e", env_class_name="NoArg", env_class_code=code))
    assert no_arg.new_episode({"items": {"y": 2}}).state() == {"items": {"y": 2}}


def test_init_config_is_copied(runtime):
    config = {"items": {"a": {"name": "A", "count": 0}}}
    episode = runtime.new_episode(config)
    episode.call("add", {"item_id": "a"})
    assert config["items"]["a"]["count"] == 0


def test_tools_are_derived_from_signatures_and_docstrings(runtime):
    tools = {t.name: t for t in derive_tools(runtime.env_class)}
    assert "_secret" not in tools and "__init__" not in tools
    add = tools["add"]
    assert add.description == "Add to an item's count."
    assert add.parameters == {
        "type": "object",
        "properties": {
            "item_id": {"type": "string", "description": "Id of the item."},
            "amount": {"type": "integer", "description": "How much to add."},
        },
        "required": ["item_id"],
        "additionalProperties": False,
    }


STRICT_CODE = '''
from typing import Dict, List, TypedDict


class Required(TypedDict):
    product_id: str
    quantity: int


class Line(Required, total=False):
    note: str


class Shop:
    def __init__(self, init_config: dict):
        self.lines = []

    def order(self, lines: List[Line], stock: Dict[str, int], extra: dict) -> dict:
        self.lines.extend(lines)
        return {"success": True}

    def ping(self) -> str:
        return "pong"

    def anything(self, **options) -> dict:
        return options
'''


def strict_problems(schema, where="$"):
    """Where a schema is not what OpenAI's strict mode accepts: an open object, an array without items."""
    problems = []
    if schema.get("type") == "object" and schema.get("additionalProperties") is not False:
        problems.append(where)
    if schema.get("type") == "array" and "items" not in schema:
        problems.append(where + "[]")
    for key, value in schema.items():
        if isinstance(value, dict):
            problems += strict_problems(value, f"{where}.{key}")
    return problems


def test_derived_schemas_are_closed_and_typed_wherever_the_signature_says():
    runtime = EnvRuntime(EnvSpec(env_id="shop", env_class_name="Shop", env_class_code=STRICT_CODE))
    order = runtime.tools["order"].parameters
    assert order["additionalProperties"] is False
    assert order["properties"]["lines"]["items"] == {
        "type": "object",
        "properties": {"product_id": {"type": "string"}, "quantity": {"type": "integer"}, "note": {"type": "string"}},
        "additionalProperties": False,
        "required": ["product_id", "quantity"],
    }
    assert order["properties"]["stock"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert order["properties"]["extra"] == {"type": "object"}  # a bare dict says nothing more
    assert runtime.tools["ping"].parameters == {"type": "object", "properties": {}, "additionalProperties": False}
    assert "additionalProperties" not in runtime.tools["anything"].parameters  # **options takes any name
    episode = runtime.new_episode({})
    wrong = episode.call("order", {"lines": [{"product_id": "P1", "quantity": 1, "colour": "red"}], "stock": {"P1": "many"}, "extra": {}, "x": 1})
    assert wrong.error_kind == "agent"
    assert "unexpected field 'colour'" in wrong.error and "'stock'.P1: expected integer" in wrong.error
    assert wrong.error.count("unexpected argument 'x'") == 1
    assert episode.call("anything", {"a": 1}).result == {"a": 1}


def test_every_bundled_tool_schema_is_strict_friendly():
    for directory in sorted(p for p in default_catalog().iterdir() if (p / "env.json").exists()):
        runtime = EnvRuntime(load_bundle(directory).spec)
        for tool in runtime.tool_list():
            assert strict_problems(tool.parameters) == [], (directory.name, tool.name)


def test_only_listed_public_methods_are_tools():
    listed = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}} for n in ("spin", "_secret", "__init__", "missing")]
    runtime = EnvRuntime(EnvSpec.model_validate(counter_spec(tools=listed)))
    assert list(runtime.tools) == ["spin"]
    episode = runtime.new_episode(INIT)
    for name in ("_secret", "__init__", "__class__", "get_item", "missing"):
        outcome = episode.call(name, {})
        assert outcome.error_kind == "agent" and "Unknown tool" in outcome.error


def test_bad_arguments_are_agent_errors_the_model_can_act_on(runtime):
    episode = runtime.new_episode(INIT)
    unknown = episode.call("nope", {})
    assert unknown.error_kind == "agent" and "Available tools: get_item, add" in unknown.error
    wrong_type = episode.call("add", {"item_id": "a", "amount": "three"})
    assert wrong_type.error == "Invalid arguments for 'add': argument 'amount': expected integer, got string 'three'"
    missing = episode.call("add", {})
    assert missing.error == "Invalid arguments for 'add': missing required argument 'item_id'"
    not_object = episode.call("add", ["a"])
    assert "must be a JSON object" in not_object.error and not_object.arguments == {"_raw": ["a"]}
    boolean = episode.call("add", {"item_id": "a", "amount": True})
    assert "expected integer, got boolean" in boolean.error
    assert episode.state()["items"]["a"]["count"] == 0


def test_business_failure_is_a_tool_error_that_keeps_its_result(runtime):
    outcome = runtime.new_episode(INIT).call("get_item", {"item_id": "zz"})
    assert outcome.error_kind == "tool" and outcome.result == {"success": False, "error": "no item zz"}
    assert outcome.agent_text == '{"success":false,"error":"no item zz"}'


def test_the_error_policy_is_the_environments():
    code = (
        "class Texts:\n"
        "    def find(self, name: str) -> str:\n"
        "        return 'Error: user not found' if name == 'x' else 'yusuf_rossi_9620'\n"
        "    def report(self) -> dict:\n"
        "        return {'success': False}\n"
    )
    spec = {"env_id": "texts", "env_class_name": "Texts", "env_class_code": code}
    default = EnvRuntime(EnvSpec.model_validate(spec)).new_episode({})
    assert default.call("find", {"name": "x"}).error is None
    assert default.call("report", {}).error_kind == "tool"
    strict = EnvRuntime(EnvSpec.model_validate({**spec, "tool_errors": {"success_false": False, "text_prefixes": ["Error:"]}}))
    episode = strict.new_episode({})
    failed = episode.call("find", {"name": "x"})
    assert failed.error_kind == "tool" and failed.agent_text == "Error: user not found"
    found = episode.call("find", {"name": "y"})
    assert found.error is None and found.result == "yusuf_rossi_9620" and found.agent_text == "yusuf_rossi_9620"
    assert episode.call("report", {}).error is None


def test_exception_is_an_env_error_and_the_episode_keeps_its_state(runtime):
    episode = runtime.new_episode(INIT)
    episode.call("add", {"item_id": "a", "amount": 2})
    outcome = episode.call("divide", {"a": 1, "b": 0})
    assert outcome.error_kind == "env"
    assert "ZeroDivisionError: division by zero (env code line" in outcome.error and "in divide" in outcome.error
    changed = episode.call("half_then_fail", {"item_id": "a"})
    assert changed.error_kind == "env" and [c.path for c in changed.diff] == [["items", "a", "count"]]
    assert episode.call("get_item", {"item_id": "a"}).result["data"]["count"] == -1


@pytest.mark.parametrize("tool", ["spin", "stubborn_spin", "nap", "endless"])
def test_hanging_call_is_cut_off_on_the_main_thread(runtime, tool):
    episode = runtime.new_episode(INIT)
    started = time.monotonic()
    outcome = episode.call(tool, {})
    assert outcome.error_kind == "timeout" and "ran longer than 0.5 s" in outcome.error
    assert time.monotonic() - started < 1.5
    assert episode.call("add", {"item_id": "a"}).result["success"] is True


@pytest.mark.parametrize("tool", ["spin", "stubborn_spin"])
def test_hanging_loop_is_cut_off_on_a_worker_thread(runtime, tool):
    episode = runtime.new_episode(INIT)
    results = {}

    def work():
        started = time.monotonic()
        results["outcome"] = episode.call(tool, {})
        results["elapsed"] = time.monotonic() - started
        results["after"] = episode.call("add", {"item_id": "a"})

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(5)
    assert not thread.is_alive()
    assert results["outcome"].error_kind == "timeout" and results["elapsed"] < 1.5
    assert results["after"].error is None


def test_a_preempted_call_is_undone_exactly(runtime):
    episode = runtime.new_episode(INIT, scenario_key="s1")
    episode.call("add", {"item_id": "a", "amount": 4})
    before = episode.state()
    with pytest.raises(Preempted):
        episode.call("slow_add", {"item_id": "a", "amount": 2, "seconds": 5}, inline_budget_s=0.02)
    assert episode.state() == before and episode.state()["log"] == ["add a 4"]
    # Undone means the next call starts from the old state and its diff is measured against it.
    rerun = episode.call("slow_add", {"item_id": "a", "amount": 2, "seconds": 0}, inline_budget_s=0.02)
    assert rerun.result["data"]["count"] == 6
    assert [(c.path, c.before, c.after) for c in rerun.diff] == [
        (["items", "a", "count"], 4, 6),
        (["log", 1], None, "add a 2"),  # an append is one added item, not the list twice
    ]
    # The scenario's other episodes never saw any of it.
    assert runtime.new_episode(INIT, scenario_key="s1").state() == runtime.new_episode(INIT).state()


def test_a_state_that_cannot_be_shared_is_never_run_preemptibly():
    code = (
        "import threading\n"
        "class Locked:\n"
        "    def __init__(self, init_config):\n"
        "        self._lock = threading.Lock()\n"
        "        self.n = 0\n"
        "    def bump(self) -> dict:\n"
        "        \"\"\"Add one.\"\"\"\n"
        "        self.n += 1\n"
        "        return {'success': True}\n"
    )
    episode = EnvRuntime(EnvSpec(env_id="locked", env_class_name="Locked", env_class_code=code)).new_episode({})
    with pytest.raises(Preempted):
        episode.call("bump", {}, inline_budget_s=1.0)
    assert not episode.preemptible and episode.state() == {"n": 0}
    bumped = episode.call("bump", {})
    assert [(c.path, c.before, c.after) for c in bumped.diff] == [(["n"], 0, 1)]


def test_unchanged_state_gives_an_empty_diff_and_changes_are_listed(runtime):
    episode = runtime.new_episode(INIT)
    assert episode.call("get_item", {"item_id": "a"}).diff == []
    changed = episode.call("rename", {"item_id": "a", "name": "Ay"})
    assert [(c.path, c.before, c.after) for c in changed.diff] == [(["items", "a", "name"], "A", "Ay")]
    assert episode.call("get_item", {"item_id": "a"}).diff == []
    assert episode.call("rename", {"item_id": "a", "name": "Bee"}).diff[0].before == "Ay"


def _swallow_and_return() -> str:
    try:
        time.sleep(5)
    except BaseException:  # noqa: BLE001 - what careless environment code does
        pass
    return "finished anyway"


@pytest.mark.parametrize("code", ["sleeps", "swallows once and returns", "swallows forever"])
def test_call_preemptibly_stops_at_the_budget_whatever_the_code_does(runtime, code):
    fn = {"sleeps": lambda: time.sleep(5), "swallows once and returns": _swallow_and_return,
          "swallows forever": runtime.new_episode(INIT).instance.endless}[code]
    tracer = sys.gettrace()
    started = time.monotonic()
    with pytest.raises(Preempted):
        call_preemptibly(fn, 0.05)
    assert time.monotonic() - started < 1.0
    assert call_preemptibly(lambda x: x * 2, 0.05, 21) == 42
    assert sys.gettrace() is tracer  # the tracer that stopped the stubborn loop is gone


_SLOW_MODULE = """
import time
started = time.monotonic()
try:
    while time.monotonic() - started < 0.3:
        pass
except BaseException:  # noqa: BLE001 - swallowed once, as careless module code might
    pass
while time.monotonic() - started < 0.6:
    pass
WHOLE = True
"""


@pytest.mark.parametrize("how", ["preempted", "limited on the main thread", "limited on a call thread"])
def test_an_import_that_a_limit_ends_leaves_no_half_made_module(tmp_path, monkeypatch, how):
    name = "slow_module_" + how.replace(" ", "_")
    (tmp_path / f"{name}.py").write_text(_SLOW_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))

    def load() -> bool:
        return importlib.import_module(name).WHOLE

    ended: list[BaseException] = []

    def limited() -> None:
        try:
            call_preemptibly(load, 0.05) if how == "preempted" else call_with_limit(load, 0.05)
        except (Preempted, TimeLimitExceeded) as e:
            ended.append(e)

    if how == "limited on a call thread":
        thread = threading.Thread(target=limited)
        thread.start()
        thread.join(10)
    else:
        limited()
    assert ended, "the import ran past its limit and was not stopped"
    assert name not in sys.modules  # else every later import would get the module half made
    assert load() is True
    del sys.modules[name]


def test_call_preemptibly_refuses_other_threads():
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, call_preemptibly, lambda: 1, 0.1)))
    thread.start()
    thread.join(5)
    assert errors and "main thread" in str(errors[0].value)


def test_state_that_json_cannot_hold_is_converted_and_reported(runtime):
    episode = runtime.new_episode(INIT)
    outcome = episode.call("tag_set", {"tag": "x"})
    assert outcome.error is None
    assert episode.state()["tags"] == ["fixed", "x"]
    code = "import datetime\nclass Odd:\n    def __init__(self):\n        self.when = datetime.date(2024, 1, 2)\n        self.obj = Thing()\nclass Thing:\n    def __init__(self):\n        self.v = 1\n        self._p = 2\n"
    odd = EnvRuntime(EnvSpec(env_id="odd", env_class_name="Odd", env_class_code=code)).new_episode({})
    assert odd.state() == {"when": "2024-01-02", "obj": {"v": 1}}
    assert odd.conversions == ["date -> ISO string", "Thing -> dict of public attributes"]


def test_syntax_error_names_the_line():
    code = "class Broken:\n    def f(self):\n        return (\n"
    with pytest.raises(EnvCodeError, match=r"syntax error in class code, line 3"):
        EnvRuntime(EnvSpec(env_id="broken", env_class_name="Broken", env_class_code=code))


def test_a_class_compiled_ahead_loads_without_compiling_under_its_own_name(monkeypatch):
    code = "class Ahead:\n    def __init__(self, init_config):\n        raise ValueError('no')\n"
    compile_ahead(code)

    def compiled_again(*args):
        raise AssertionError("compiled again")

    monkeypatch.setattr(loader, "_compile", compiled_again)
    for env_id in ("ahead_1", "ahead_2"):  # replicas: one code, compiled once
        runtime = EnvRuntime(EnvSpec(env_id=env_id, env_class_name="Ahead", env_class_code=code))
        assert runtime.env_class.__init__.__code__.co_filename == loader.code_filename(code)
        # Its errors name the environment, and the line in its code.
        with pytest.raises(EnvCodeError, match=rf"{env_id}: cannot instantiate: ValueError: no \(env code line 3"):
            runtime.new_episode({})


def test_missing_class_and_failing_module_are_reported():
    with pytest.raises(EnvCodeError, match=r"defines no class 'Nope' \(it defines: Counter"):
        EnvRuntime(EnvSpec.model_validate(counter_spec(env_class_name="Nope")))
    with pytest.raises(EnvCodeError, match="class code failed to load: ZeroDivisionError"):
        EnvRuntime(EnvSpec(env_id="x", env_class_name="X", env_class_code="1/0\n"))


def test_constructor_failure_is_reported():
    code = "class Bad:\n    def __init__(self, init_config):\n        raise ValueError('no')\n"
    runtime = EnvRuntime(EnvSpec(env_id="bad", env_class_name="Bad", env_class_code=code))
    with pytest.raises(EnvCodeError, match=r"bad: cannot instantiate: ValueError: no \(env code line 3"):
        runtime.new_episode({})


def test_checks_see_initial_state_and_report_errors(runtime):
    episode = runtime.new_episode(INIT)
    episode.call("add", {"item_id": "a", "amount": 3})
    checklist = [
        CheckItem.model_validate(CHECK_A_IS_3),
        CheckItem(check_item="grew", check_func="def check_func(final_state):\n    return final_state['items']['a']['count'] > initial_state['items']['a']['count']"),
        CheckItem(check_item="raises", check_func="def check_func(final_state):\n    return final_state['nope']"),
        CheckItem(check_item="loops", check_func="def check_func(final_state):\n    while True:\n        pass"),
        CheckItem(check_item="bad syntax", check_func="def check_func(final_state)\n    return True"),
        CheckItem(check_item="mutates", check_func="def check_func(final_state):\n    final_state['items'].clear()\n    return True"),
        CheckItem.model_validate(CHECK_A_IS_3),
    ]
    result = episode.validate(checklist)
    verdicts = [(c.passed, c.error) for c in result.checks]
    assert verdicts[0] == (True, None) and verdicts[1] == (True, None)
    assert verdicts[2][0] is False and verdicts[2][1].startswith("KeyError: 'nope' (check line 2)")
    assert verdicts[3] == (False, "check ran longer than 0.5 s")
    assert verdicts[4][0] is False and verdicts[4][1].startswith("syntax error, line 1")
    assert verdicts[6] == (True, None)  # the mutating check did not affect the next one
    assert result.score == pytest.approx(4 / 7)
    assert result.check_errors == 3


def test_a_check_too_deep_for_the_compiler_is_a_failed_check(runtime):
    too_deep = "def check_func(final_state):\n    return " + "-" * 200_000 + "1"
    result = runtime.new_episode(INIT).validate([CheckItem(check_item="deep", check_func=too_deep), CheckItem.model_validate(CHECK_A_IS_3)])
    assert [(check.passed, (check.error or "").split(":")[0]) for check in result.checks] == [
        (False, "the check cannot be compiled"), (False, "")]
    assert result.check_errors == 1


def test_checks_compiled_ahead_run_nothing_and_skip_what_does_not_compile(tmp_path):
    ran = tmp_path / "ran"
    checklist = [CheckItem(check_item="writes", check_func=f"open({str(ran)!r}, 'w').close()\ndef check_func(final_state):\n    return True"),
                 CheckItem(check_item="bad syntax", check_func="def check_func(final_state)\n    return True"),
                 CheckItem(check_item="deep", check_func="x = " + "-" * 200_000 + "1")]
    compile_checks_ahead(checklist)
    assert not ran.exists()
    assert checklist[0].check_func in checks._COMPILED
    assert [check.passed for check in check_states(checklist, {}, {}, 1.0)] == [True, False, False]
    assert ran.exists()


def test_empty_checklist_is_an_error_the_caller_sees(runtime):
    with pytest.raises(ChecklistError, match="no checklist"):
        runtime.new_episode(INIT).validate([])


def test_state_hash_ignores_key_order(runtime):
    one = runtime.new_episode({"items": {"a": {"name": "A", "count": 0}, "b": {"name": "B", "count": 1}}})
    two = runtime.new_episode({"items": {"b": {"count": 1, "name": "B"}, "a": {"count": 0, "name": "A"}}})
    check = [CheckItem.model_validate(CHECK_A_IS_3)]
    assert one.validate(check).state_hash == two.validate(check).state_hash


def test_class_code_is_compiled_once_per_content():
    spec = EnvSpec.model_validate(counter_spec())
    assert EnvRuntime(spec).env_class is EnvRuntime(spec).env_class
    other = EnvSpec.model_validate(counter_spec(env_class_code=COUNTER_CODE + "\n# changed\n"))
    assert EnvRuntime(other).env_class is not EnvRuntime(spec).env_class


def test_a_type_error_inside_init_is_reported_not_hidden_by_the_fallback():
    code = COUNTER_CODE.replace("self.log: List[str] = []", "self.log: List[str] = list(1)")
    runtime = EnvRuntime(EnvSpec.model_validate(counter_spec(env_class_code=code)))
    with pytest.raises(EnvCodeError) as caught:
        runtime.new_episode(INIT)
    assert "TypeError: 'int' object is not iterable" in str(caught.value) and "line" in str(caught.value)


def test_a_constructor_without_init_config_falls_back_to_no_arguments():
    code = COUNTER_CODE.replace("def __init__(self, init_config: dict):", "def __init__(self):")
    episode = EnvRuntime(EnvSpec.model_validate(counter_spec(env_class_code=code))).new_episode(INIT)
    assert episode.state()["items"] == INIT["items"]


SHARING_CODE = '''
import time
SEEN = []
TABLE = {"rate": [1, 2]}
BIG = list(range(5000))


class Sharing:
    registry = []

    def __init__(self, init_config):
        self.n = 0

    def register(self, key: str) -> dict:
        """Remember a key in the class.

        Args:
            key (str): The key.
        """
        Sharing.registry.append(key)
        return {"success": True, "data": list(Sharing.registry)}

    def count(self) -> dict:
        """Count in a module global."""
        global SEEN
        SEEN = SEEN + [self.n]
        return {"success": True}

    def shrink(self) -> dict:
        """Take from a big module table."""
        BIG.pop()
        return {"success": True}

    def retag(self) -> dict:
        """Add an attribute to the episode's own class."""
        type(self).tag = "mine"
        return {"success": True}

    def slow_register(self, seconds: float) -> dict:
        """Remember, then wait.

        Args:
            seconds (float): How long.
        """
        TABLE["rate"].append(3)
        time.sleep(seconds)
        return {"success": True}

    def bump(self) -> dict:
        """Change the episode's own state, reading the shared table."""
        self.n += len(TABLE["rate"])
        return {"success": True}
'''


def test_a_scalar_global_after_the_deep_check_budget_is_spent_loads_and_is_still_watched():
    # A table that spends the whole budget, then a scalar (BFCL's long_context tables come before such constants).
    code = "TABLE = list(range(1000))\nLIMIT = 50\n\n\nclass Capped:\n    def __init__(self):\n        self.n = 0\n\n" \
           "    def raise_limit(self) -> int:\n        global LIMIT\n        LIMIT += 1\n        return LIMIT\n"
    runtime = EnvRuntime(EnvSpec(env_id="capped", env_class_name="Capped", env_class_code=code))
    outcome = runtime.new_episode({}).call("raise_limit", {})
    assert outcome.error_kind == "env" and "module global LIMIT" in outcome.error
    assert sys.modules[runtime.env_class.__module__].LIMIT == 50


def test_a_call_that_changes_what_every_episode_shares_is_an_env_error_and_is_put_back():
    runtime = EnvRuntime(EnvSpec(env_id="sharing", env_class_name="Sharing", env_class_code=SHARING_CODE))
    episode = runtime.new_episode({"n": 1}, scenario_key="s1")
    for tool, arguments, label in [("register", {"key": "x"}, "class attribute Sharing.registry"),
                                   ("count", {}, "module global SEEN"),
                                   ("shrink", {}, "module global BIG"),
                                   ("retag", {}, "class attribute Sharing.tag")]:
        outcome = episode.call(tool, arguments)
        assert outcome.error_kind == "env" and label in outcome.error and "every episode shares" in outcome.error, outcome
    module = sys.modules[runtime.env_class.__module__]
    assert (runtime.env_class.registry, module.SEEN, len(module.BIG)) == ([], [], 5000)
    assert not hasattr(type(episode.instance), "tag")
    # What belongs to the episode is no one else's business, and the other episodes saw nothing.
    assert episode.call("bump", {}).error is None and episode.state() == {"n": 3}
    other = runtime.new_episode({"n": 1}, scenario_key="s1")
    assert other.call("register", {"key": "y"}).result is None and runtime.env_class.registry == []


def test_a_preempted_call_that_changed_shared_values_leaves_nothing_for_its_rerun():
    runtime = EnvRuntime(EnvSpec(env_id="sharing", env_class_name="Sharing", env_class_code=SHARING_CODE))
    episode = runtime.new_episode({"n": 1}, scenario_key="s1")
    with pytest.raises(Preempted):
        episode.call("slow_register", {"seconds": 5}, inline_budget_s=0.02)
    assert sys.modules[runtime.env_class.__module__].TABLE == {"rate": [1, 2]}
    rerun = episode.call("slow_register", {"seconds": 0})
    assert rerun.error_kind == "env" and "module global TABLE" in rerun.error
    assert sys.modules[runtime.env_class.__module__].TABLE == {"rate": [1, 2]}


def test_a_constructor_that_changes_class_attributes_is_refused_and_put_back():
    code = "class Tally:\n    made = 0\n    def __init__(self, init_config):\n        Tally.made += 1\n        self.id = Tally.made\n"
    runtime = EnvRuntime(EnvSpec(env_id="tally", env_class_name="Tally", env_class_code=code))
    for _ in range(2):
        with pytest.raises(EnvCodeError, match=r"tally: the constructor changed class attribute Tally.made"):
            runtime.new_episode({})
    assert runtime.env_class.made == 0


def test_environment_code_cannot_patch_the_checker():
    code = SHARING_CODE + '''
    def cheat(self) -> dict:
        """Make every check pass."""
        import envscaler.checks
        envscaler.checks.run_check = lambda item, views, limit_s: envscaler.checks.CheckResult(check_item=item.check_item, passed=True)
        return {"success": True}
'''
    runtime = EnvRuntime(EnvSpec(env_id="cheat", env_class_name="Sharing", env_class_code=code))
    untouched = runtime.new_episode({"n": 1})
    assert runtime.new_episode({"n": 1}).call("cheat", {}).error is None
    never = CheckItem(check_item="never", check_func="def check_func(final_state):\n    return False")
    assert untouched.validate([never]).score == 0.0
    assert runtime.env_globals.restore_checker() == []  # all put back by the validation


def test_a_planted_object_that_claims_equality_is_still_found_and_no_env_code_runs_outside_the_limit():
    code = SHARING_CODE.replace("class Sharing:", '''class Liar:
    def __eq__(self, other):
        while True:
            pass

    def __len__(self):
        while True:
            pass


LIAR = Liar()


class Sharing:''') + '''
    def plant(self) -> dict:
        """Replace the checker's run_check with an object that says it is equal to anything."""
        import envscaler.checks
        envscaler.checks.run_check = LIAR
        return {"success": True}
'''
    runtime = EnvRuntime(EnvSpec(env_id="liar", env_class_name="Sharing", env_class_code=code), call_timeout_s=0.5)
    started = time.monotonic()
    episode = runtime.new_episode({"n": 1})
    assert episode.call("plant", {}).error is None
    assert time.monotonic() - started < 0.5
    assert runtime.env_globals.restore_checker() == ["envscaler.checks.run_check"]
    assert callable(sys.modules["envscaler.checks"].run_check)


WARNING_CODE = SHARING_CODE.replace("import time", "import copy\nimport datetime\nimport locale\nimport time\nimport warnings") + '''
    def old_ways(self) -> dict:
        """Use deprecated paths: warnings Python hides by default, written to this module's registry."""
        warnings.warn("bump is deprecated", DeprecationWarning)
        warnings.warn("so is its caller", DeprecationWarning, stacklevel=2)
        locale.getdefaultlocale()  # DeprecationWarning since 3.11, aimed at this module
        datetime.datetime.utcnow()  # DeprecationWarning since 3.12
        copy.deepcopy(self)  # copyreg caches __slotnames__ on the class
        self.n += 1
        return {"success": True}
'''


def test_python_bookkeeping_in_shared_namespaces_is_not_a_shared_change():
    runtime = EnvRuntime(EnvSpec(env_id="warns", env_class_name="Sharing", env_class_code=WARNING_CODE))
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every warning goes through the registry, not only the first
        for episode in (runtime.new_episode({"n": 1}, scenario_key="s1"), runtime.new_episode({"n": 1})):
            for _ in range(2):
                outcome = episode.call("old_ways", {})
                assert outcome.error is None, outcome.error
            assert episode.state() == {"n": 3}
        module = sys.modules[runtime.env_class.__module__]
        assert "__warningregistry__" in vars(module)
        # What is really shared is still watched, after the registry came.
        assert "module global SEEN" in runtime.new_episode({"n": 1}).call("count", {}).error
        # A check whose warning is aimed at the checker's own module does not read as a patched checker.
        warn = CheckItem(check_item="warns", check_func=(
            "import warnings\ndef check_func(final_state):\n"
            "    warnings.warn('old check', DeprecationWarning, stacklevel=2)\n    return final_state['n'] == 1"))
        assert runtime.new_episode({"n": 1}).validate([warn]).score == 1.0
        assert "__warningregistry__" in vars(sys.modules["envscaler.checks"])
        assert runtime.env_globals.restore_checker() == []


def test_a_method_gets_its_own_copy_of_the_arguments(tmp_path):
    runtime = EnvRuntime(load_bundle(tagger_bundle(tmp_path)).spec, call_timeout_s=5.0)
    episode = runtime.new_episode({}, scenario_key="tagger_001")
    arguments = {"tags": ["a"]}
    kept = episode.call("keep", arguments)
    assert episode.call("more", {"tag": "b"}).result == {"success": True, "data": 3}
    # Neither the call in the method nor a later call changed what the caller passed, or what was recorded.
    assert arguments == {"tags": ["a"]} and kept.arguments == {"tags": ["a"]}
    assert episode.state() == {"tags": ["a", "seen", "b"]}
    # A preempted call runs again on the arguments as they were sent, not as its first run left them.
    arguments = {"tags": ["x"], "seconds": 1.0}
    with pytest.raises(Preempted):
        episode.call("keep", arguments, inline_budget_s=0.05)
    assert episode.call("keep", arguments).result == {"success": True, "data": 2}
    assert episode.state() == {"tags": ["x", "seen"]} and arguments["tags"] == ["x"]


def test_a_state_whose_nodes_link_back_to_their_parents_is_served_with_references(tmp_path):
    runtime = EnvRuntime(load_bundle(folders_bundle(tmp_path)).spec)
    episode = runtime.new_episode({"names": ["home"]}, scenario_key="folders_001")
    home = {"name": "home", "parent": {"$ref": "#/root"}, "children": []}
    assert episode.state() == {"root": {"name": "/", "parent": None, "children": [home]}, "names": ["home"]}
    assert any("$ref" in note for note in episode.conversions)
    made = episode.call("mkdir", {"name": "tmp"})
    assert made.error is None and made.result["data"] == ["home", "tmp"]
    assert [(c.path, c.after) for c in made.diff] == [(["root", "children", 1], {"name": "tmp", "parent": {"$ref": "#/root"}, "children": []})]
    shown = episode.call("root_folder", {})
    assert shown.error is None and shown.result["children"][0] == {"name": "home", "parent": {"$ref": "#"}, "children": []}
    check = CheckItem.model_validate(CHECK_TMP_UNDER_ROOT)
    assert episode.validate([check]).score == 1.0
    assert runtime.new_episode({"names": ["home"]}, scenario_key="folders_001").validate([check]).score == 0.0


def test_a_call_that_links_shared_state_back_to_itself_moves_the_episode_to_its_own_copy():
    runtime = EnvRuntime(EnvSpec(env_id="links", env_class_name="Links", env_class_code=LINKS_CODE))
    episode = runtime.new_episode({}, scenario_key="s1")
    assert episode.shares_state
    made = episode.call("mkdir", {"name": "tmp"})
    assert made.error is None and not episode.shares_state
    assert [c.path for c in made.diff] == [["root", "children", 0]]
    assert episode.state() == {"root": {"name": "/", "children": [{"name": "tmp", "parent": {"$ref": "#/root"}}]}}
    assert episode.call("mkdir", {"name": "var"}).result["data"] == ["tmp", "var"]
    # The scenario's shared state, and the episodes on it, saw nothing.
    other = runtime.new_episode({}, scenario_key="s1")
    assert other.shares_state and other.state() == {"root": {"name": "/", "children": []}}
    assert episode.state_hash() != other.state_hash()


def test_a_declared_agent_error_covers_its_subclasses_and_names_dotted_classes():
    spec = users_spec(tool_errors={"agent_errors": ["LookupError", "json.JSONDecodeError"]})
    runtime = EnvRuntime(EnvSpec.model_validate(spec))
    episode = runtime.new_episode({"users": {}})
    found, bug, bad = episode.call("find_user", {"user_id": "u9"}), episode.call("broken", {}), episode.call("rename_user", {"user_id": "u9", "name": "A"})
    assert (found.error_kind, found.exception) == ("agent", "NotFound")
    assert (bug.error_kind, bug.exception) == ("agent", "KeyError")
    assert (bad.error_kind, bad.exception) == ("env", "ValueError")
    # Declared as json exports it, the class is matched, whatever module defines it.
    with pytest.raises(json.JSONDecodeError) as decoding:
        json.loads("{")
    assert runtime.is_agent_error(decoding.value) and runtime.exception_name(decoding.type) == "json.decoder.JSONDecodeError"
