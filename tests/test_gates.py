"""Every quality gate passes on a good scenario and fails on a scenario broken for that gate."""

import json

import pytest

from envscaler import load_bundle
from envscaler.gates import GATES, check_bundle
from tests.support.bundles import (
    CHECK_A_IS_3,
    CHECK_NAME_KEPT,
    CHECK_ONE_ITEM,
    COUNTER_CODE,
    counter_bundle,
    counter_scenario,
    counter_spec,
    folders_bundle,
    second_scenario,
    tagger_bundle,
    users_scenario,
    users_spec,
    write_bundle,
)
from tests.support.cli import envscaler

CHECK_LOG_STARTS = {
    "check_item": "the log has an entry",
    "check_func": "def check_func(final_state):\n    return final_state['log'][0].startswith('add')",
}


def gate_verdicts(tmp_path, spec=None, scenarios=None):
    """{gate: passed} for the first scenario (env gates included) of a bundle written from the parts."""
    directory = write_bundle(tmp_path, spec or counter_spec(), scenarios or [counter_scenario()])
    report = check_bundle(load_bundle(directory), call_timeout_s=1.0, check_timeout_s=1.0)
    verdicts = {g.gate: g for g in report.env_gates}
    if report.scenarios:
        verdicts.update({g.gate: g for g in report.scenarios[0].gates})
    return report, verdicts


def test_good_bundle_passes_every_gate(tmp_path):
    report = check_bundle(load_bundle(counter_bundle(tmp_path)))
    assert report.passed, report.failures()
    assert [g.gate for g in report.env_gates + report.scenarios[0].gates] == list(GATES)
    assert report.tools == 11
    assert report.state_changing_tools == 2  # add and rename are the only tools the references see change state


def test_class_loads_fails_on_syntax_error_and_names_the_line(tmp_path):
    code = COUNTER_CODE.replace("def rename(self, item_id: str, name: str) -> dict:", "def rename(self, item_id: str name: str) -> dict:")
    report, verdicts = gate_verdicts(tmp_path, counter_spec(env_class_code=code))
    assert not verdicts["class_loads"].passed
    assert "line" in verdicts["class_loads"].detail and "syntax" in verdicts["class_loads"].detail.lower()
    assert not report.passed


def test_class_loads_fails_when_a_listed_tool_is_missing_or_mismatched(tmp_path):
    tools = [
        {"name": "get_item", "description": "Read one item.", "parameters": {"type": "object", "properties": {"item_id": {"type": "string"}}, "required": ["item_id"]}},
        {"name": "teleport", "description": "Not a method.", "parameters": {"type": "object", "properties": {}}},
        {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}},
    ]
    _, verdicts = gate_verdicts(tmp_path, counter_spec(tools=tools))
    detail = verdicts["class_loads"].detail
    assert not verdicts["class_loads"].passed
    assert "teleport" in detail and "add" in detail


def test_instantiates_fails_when_init_config_breaks_the_constructor(tmp_path):
    code = COUNTER_CODE.replace("self.items: Dict[str, Item] = {}", "self.items: Dict[str, Item] = dict(init_config['items'])")
    _, verdicts = gate_verdicts(tmp_path, counter_spec(env_class_code=code), [counter_scenario(init_config={"log": []})])
    assert not verdicts["instantiates"].passed
    assert "items" in verdicts["instantiates"].detail


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ([{"name": "add", "arguments": {"item_id": "a"}}, {"name": "fly", "arguments": {}}], "fly"),
        ([{"name": "add", "arguments": {"item_id": "zzz"}}], "the tool reported success: false"),
        ([{"name": "divide", "arguments": {"a": 1, "b": 0}}], "ZeroDivisionError"),
        ([{"name": "add", "arguments": {"item_id": 5}}], "item_id"),
    ],
)
def test_reference_runs_fails_on_tool_errors(tmp_path, reference, expected):
    _, verdicts = gate_verdicts(tmp_path, scenarios=[counter_scenario(reference_solution=reference)])
    assert not verdicts["reference_runs"].passed
    assert expected in verdicts["reference_runs"].detail


def test_reference_runs_fails_without_a_reference(tmp_path):
    _, verdicts = gate_verdicts(tmp_path, scenarios=[counter_scenario(reference_solution=None)])
    assert not verdicts["reference_runs"].passed
    assert "no reference_solution" in verdicts["reference_runs"].detail


def test_an_empty_reference_is_named_as_such(tmp_path):
    _, verdicts = gate_verdicts(tmp_path, scenarios=[counter_scenario(reference_solution=[])])
    assert not verdicts["reference_runs"].passed
    assert "empty (do nothing)" in verdicts["reference_runs"].detail


# tau-bench's way: tools answer "Error: ..." instead of raising. A lookup may legitimately find nothing; a write may not fail.
NOTE_TOOLS = """def note(self, text: str) -> str:
        \"\"\"Note a text (a write that answers an error string for an empty text).

        Args:
            text (str): What to note.
        \"\"\"
        if not text:
            return 'Error: nothing to note'
        self.log.append(text)
        return 'noted'

    def find(self, item_id: str) -> str:
        \"\"\"Look an item up (answers an error string for an unknown id).

        Args:
            item_id (str): Id of the item.
        \"\"\"
        if item_id not in self.items:
            return 'Error: item not found'
        return self.items[item_id]['name']

    def get_item("""
ERROR_PREFIX_SPEC = counter_spec(env_class_code=COUNTER_CODE.replace("def get_item(", NOTE_TOOLS), tool_errors={"text_prefixes": ["Error:"]})
ADD_THREE = [{"name": "add", "arguments": {"item_id": "a", "amount": 2}}, {"name": "add", "arguments": {"item_id": "a"}}]


def test_a_reference_write_that_answers_an_error_string_fails_the_reference(tmp_path):
    reference = [{"name": "note", "arguments": {"text": ""}}, *ADD_THREE]
    _, verdicts = gate_verdicts(tmp_path, ERROR_PREFIX_SPEC, [counter_scenario(reference_solution=reference)])
    assert not verdicts["reference_runs"].passed
    assert ("call 1 (note) failed, the tool's answer starts with 'Error:': Error: nothing to note: a reference call of a "
            "tool that changes the state must succeed") in verdicts["reference_runs"].detail


def test_a_reference_lookup_that_answers_an_error_string_passes(tmp_path):
    reference = [{"name": "find", "arguments": {"item_id": "zz"}}, *ADD_THREE]
    report, _ = gate_verdicts(tmp_path, ERROR_PREFIX_SPEC, [counter_scenario(reference_solution=reference)])
    assert report.passed, report.failures()
    # Without the prefix in the policy the answer is no error at all: the same reference passes as well.
    report, _ = gate_verdicts(tmp_path / "no_policy", counter_spec(env_class_code=ERROR_PREFIX_SPEC["env_class_code"]),
                              [counter_scenario(reference_solution=reference)])
    assert report.passed, report.failures()


RENAME_U1 = {"name": "rename_user", "arguments": {"user_id": "u1", "name": "Ann"}}


def test_a_reference_lookup_that_finds_nothing_by_a_declared_agent_error_passes(tmp_path):
    # tau-bench's tools raise on an unknown id: a gold lookup may find nothing, and changes nothing.
    reference = [{"name": "find_user", "arguments": {"user_id": "u9"}}, RENAME_U1]
    report, verdicts = gate_verdicts(tmp_path, users_spec(), [users_scenario(reference)])
    assert report.passed, report.failures()
    # Undeclared, the same exception is the environment's error.
    _, verdicts = gate_verdicts(tmp_path / "undeclared", users_spec(tool_errors=None), [users_scenario(reference)])
    assert not verdicts["reference_runs"].passed
    assert "call 1 (find_user): Environment error in 'find_user': NotFound: no user u9" in verdicts["reference_runs"].detail


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ({"name": "rename_user", "arguments": {"user_id": "u9", "name": "Ann"}},
         "call 1 (rename_user) failed, Error in 'rename_user': ValueError: no user u9 (a declared agent error): "
         "a reference call of a tool that changes the state must succeed"),
        ({"name": "tag_user", "arguments": {"user_id": "u1", "tag": "bad"}},
         "call 1 (tag_user) changed the state, then raised ValueError (a declared agent error)"),
    ],
)
def test_a_reference_write_that_fails_by_a_declared_agent_error_is_still_caught(tmp_path, call, expected):
    _, verdicts = gate_verdicts(tmp_path, users_spec(), [users_scenario([call, RENAME_U1])])
    assert not verdicts["reference_runs"].passed
    assert expected in verdicts["reference_runs"].detail


def test_class_loads_fails_when_the_python_requirements_are_not_installed(tmp_path):
    spec = counter_spec(requires=["pydantic>=2", "envscaler-test-absent-distribution"])
    report, verdicts = gate_verdicts(tmp_path, spec)
    assert not verdicts["class_loads"].passed and not report.scenarios
    assert "counter: needs Python distributions this interpreter lacks: envscaler-test-absent-distribution (not installed)" \
        in verdicts["class_loads"].detail


def test_checks_pass_on_reference_fails_when_the_reference_misses_a_check(tmp_path):
    wrong = {"check_item": "a counts 4", "check_func": "def check_func(final_state):\n    return final_state['items']['a']['count'] == 4"}
    _, verdicts = gate_verdicts(tmp_path, scenarios=[counter_scenario(checklist_with_func=[wrong, CHECK_NAME_KEPT, CHECK_ONE_ITEM])])
    assert not verdicts["checks_pass_on_reference"].passed
    assert "a counts 4" in verdicts["checks_pass_on_reference"].detail


def test_checks_pass_on_reference_reports_a_crashing_check(tmp_path):
    crash = {"check_item": "crashes", "check_func": "def check_func(final_state):\n    return final_state['nothing']"}
    _, verdicts = gate_verdicts(tmp_path, scenarios=[counter_scenario(checklist_with_func=[CHECK_A_IS_3, crash])])
    assert not verdicts["checks_pass_on_reference"].passed
    assert "KeyError" in verdicts["checks_pass_on_reference"].detail


def test_check_fails_on_initial_and_do_nothing_fail_when_every_check_already_passes(tmp_path):
    report, verdicts = gate_verdicts(tmp_path, scenarios=[counter_scenario(checklist_with_func=[CHECK_NAME_KEPT, CHECK_ONE_ITEM])])
    assert verdicts["checks_pass_on_reference"].passed
    assert not verdicts["check_fails_on_initial"].passed
    assert not verdicts["do_nothing_below_one"].passed
    assert "1.00" in verdicts["do_nothing_below_one"].detail
    assert not report.passed


def test_a_check_that_only_errors_on_the_initial_state_is_not_a_clean_failure(tmp_path):
    _, verdicts = gate_verdicts(tmp_path, scenarios=[counter_scenario(checklist_with_func=[CHECK_NAME_KEPT, CHECK_ONE_ITEM, CHECK_LOG_STARTS])])
    assert verdicts["checks_pass_on_reference"].passed
    assert not verdicts["check_fails_on_initial"].passed
    assert "IndexError" in verdicts["check_fails_on_initial"].detail
    assert verdicts["do_nothing_below_one"].passed


def counter_with_stamp(doc: str, stamp: str, class_lines: str = "") -> str:
    """The counter's code with a ``stamp`` tool that sets ``self.stamp_no`` to ``stamp``."""
    return COUNTER_CODE.replace(
        "    def _secret(self) -> dict:",
        f"{class_lines}    def stamp(self) -> dict:\n"
        f'        """{doc}"""\n'
        f"        self.stamp_no = {stamp}\n"
        '        return {"success": True, "data": self.stamp_no}\n\n'
        "    def _secret(self) -> dict:",
    )


STAMPED_REFERENCE = counter_scenario()["reference_solution"] + [{"name": "stamp", "arguments": {}}]


def test_deterministic_fails_when_the_reference_leaves_different_states(tmp_path):
    # An unseeded random number: the second replay stamps the state differently.
    code = "import random\n" + counter_with_stamp("Stamp the state with a random number.", "random.random()")
    _, verdicts = gate_verdicts(tmp_path, counter_spec(env_class_code=code), [counter_scenario(reference_solution=STAMPED_REFERENCE)])
    assert verdicts["checks_pass_on_reference"].passed
    assert not verdicts["deterministic"].passed
    assert "different states" in verdicts["deterministic"].detail


def test_a_reference_that_changes_class_attributes_fails_its_replay(tmp_path):
    # Class-level state would survive between episodes: the call is an environment error instead.
    code = counter_with_stamp("Stamp the state with a number kept in the class.", "Counter.calls.append(1) or len(Counter.calls)",
                              "    calls = []\n\n")
    report, verdicts = gate_verdicts(tmp_path, counter_spec(env_class_code=code), [counter_scenario(reference_solution=STAMPED_REFERENCE)])
    failed = [g for g in verdicts.values() if not g.passed]
    assert not report.passed and failed, verdicts
    assert "class attribute Counter.calls" in failed[0].detail and "every episode shares" in failed[0].detail


def test_a_reference_whose_tool_keeps_and_changes_a_list_argument_stays_deterministic(tmp_path):
    # keep() stores its list argument and more() extends it: on the scenario's own argument objects,
    # the second replay would start from ["a", "seen", "b"].
    bundle = load_bundle(tagger_bundle(tmp_path))
    report = check_bundle(bundle, call_timeout_s=1.0, check_timeout_s=1.0)
    assert report.passed, report.failures()
    assert bundle.scenarios[0].reference_solution[0].arguments == {"tags": ["a"]}


def test_deterministic_fails_when_a_check_answers_differently_on_the_same_state(tmp_path):
    # The check keeps a tally in the env class (reachable from the state's module), so it flips between runs.
    flip = {
        "check_item": "flips",
        "check_func": (
            "def check_func(final_state):\n"
            "    import sys\n"
            "    tally = sys.modules.setdefault('envscaler_test_tally', type(sys)('envscaler_test_tally'))\n"
            "    tally.n = getattr(tally, 'n', 0) + 1\n"
            "    return tally.n % 2 == 1 or final_state['items']['a']['count'] == 0"
        ),
    }
    _, verdicts = gate_verdicts(tmp_path, scenarios=[counter_scenario(checklist_with_func=[CHECK_A_IS_3, CHECK_NAME_KEPT, flip])])
    assert not verdicts["deterministic"].passed
    assert "different answers" in verdicts["deterministic"].detail


def test_a_reference_whose_tools_warn_passes_every_gate(tmp_path):
    # Python writes each warning into the module's __warningregistry__, hidden DeprecationWarnings included:
    # its own bookkeeping, not state the episodes share.
    code = "import warnings\n" + COUNTER_CODE.replace(
        "        self.log.append(f\"add {item_id} {amount}\")\n        return",
        "        self.log.append(f\"add {item_id} {amount}\")\n"
        "        warnings.warn('add is deprecated', DeprecationWarning)\n"
        "        warnings.warn('its caller too', DeprecationWarning, stacklevel=2)\n        return", 1)
    assert "add is deprecated" in code
    directory = write_bundle(tmp_path, counter_spec(env_class_code=code), [counter_scenario()])
    result = envscaler("catalog", "check", str(directory))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all gates pass" in result.stdout


SLOW_EVERY_OTHER_RUN = {
    "check_item": "slow on every other run",
    "check_func": (
        "import sys, time\n"
        "def check_func(final_state):\n"
        "    tally = sys.modules.setdefault('envscaler_test_slow', type(sys)('envscaler_test_slow'))\n"
        "    tally.n = getattr(tally, 'n', 0) + 1\n"
        "    if tally.n % 2 == 0:\n"
        "        time.sleep(0.8)\n"
        "    return True"
    ),
}


def test_a_check_near_its_time_limit_is_reported_as_a_timeout_and_the_limit_can_be_raised(tmp_path):
    # In the checker process: the tally starts again in each run of the command.
    directory = write_bundle(tmp_path, counter_spec(), [counter_scenario(checklist_with_func=[CHECK_A_IS_3, SLOW_EVERY_OTHER_RUN])])
    tight = envscaler("catalog", "check", str(directory), "--check-timeout", "0.3")
    assert tight.returncode == 1
    line = next(line for line in tight.stdout.splitlines() if "counter_001: deterministic" in line)
    assert "'slow on every other run' ran past the check time limit (0.3 s) in some runs" in line, tight.stdout
    assert "--check-timeout" in line and "different answers" not in tight.stdout
    roomy = envscaler("catalog", "check", str(directory), "--check-timeout", "5")
    assert roomy.returncode == 0, roomy.stdout + roomy.stderr


def test_catalog_check_call_timeout_limits_each_tool_call(tmp_path):
    slow = counter_scenario(reference_solution=[{"name": "slow_add", "arguments": {"item_id": "a", "amount": 3, "seconds": 0.8}}])
    directory = write_bundle(tmp_path, counter_spec(), [slow])
    tight = envscaler("catalog", "check", str(directory), "--call-timeout", "0.3")
    assert tight.returncode == 1 and "counter_001: reference_runs: call 1 (slow_add)" in tight.stdout
    assert "ran longer than 0.3 s" in tight.stdout
    assert envscaler("catalog", "check", str(directory), "--call-timeout", "5").returncode == 0


def test_catalog_check_passes_a_state_whose_nodes_link_back_to_their_parents(tmp_path):
    result = envscaler("catalog", "check", str(folders_bundle(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all gates pass" in result.stdout


# A tool whose write the code reading cannot see: it goes through a helper outside the class.
PEEK_CODE = COUNTER_CODE.replace("import time", "import time\n\n\ndef _bump(store):\n    store['a']['count'] += 1\n").replace(
    "    def _secret(self) -> dict:",
    '    def peek(self) -> dict:\n        """Look at item a (and, through a helper, count the look)."""\n'
    '        _bump(self.items)\n        return {"success": True}\n\n    def _secret(self) -> dict:')


def test_catalog_check_writes_read_only_hints_its_reference_calls_disprove(tmp_path):
    reference = [{"name": "peek", "arguments": {}}, {"name": "add", "arguments": {"item_id": "a", "amount": 2}},
                 {"name": "rename", "arguments": {"item_id": "a", "name": "A"}}]  # a write that changes nothing
    spec = counter_spec(env_class_code=PEEK_CODE, tool_annotations={"get_item": {"title": "Read an item"}}, extra_field=[1])
    directory = write_bundle(tmp_path, spec, [counter_scenario(reference_solution=reference)])
    checked = envscaler("catalog", "check", str(directory), "--json", str(tmp_path / "report.json"))
    assert checked.returncode == 1 and "counter_001: read_only_tools: marked readOnlyHint but changed the state: call 1 (peek)" in checked.stdout
    observed = json.loads((tmp_path / "report.json").read_text())[0]["observed"]
    assert observed == {"peek": {"calls": 1, "changed": 1}, "add": {"calls": 1, "changed": 1}, "rename": {"calls": 1, "changed": 0}}
    assert json.loads((directory / "env.json").read_text())["tool_annotations"] == {"get_item": {"title": "Read an item"}}

    written = envscaler("catalog", "check", str(directory), "--write-annotations")
    assert written.returncode == 1, written.stdout + written.stderr
    lines = [line.strip() for line in written.stdout.splitlines() if line.strip().startswith("hint ")]
    assert lines == [
        "hint peek: writes (1 of 1 reference call changed the state); the code reads as read-only  -> readOnlyHint false written to env.json",
        "hint rename: read-only (0 of 1 reference call changed the state); the code reads as writing",
    ]
    env = json.loads((directory / "env.json").read_text())
    assert env["tool_annotations"] == {"get_item": {"title": "Read an item"},
                                       "peek": {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": False}}
    assert env["extra_field"] == [1] and env["env_class_code"] == PEEK_CODE
    again = envscaler("catalog", "check", str(directory), "--write-annotations")
    assert again.returncode == 0, again.stdout
    # The code still reads otherwise (said again), but env.json now settles it: nothing more is written.
    assert [line.strip() for line in again.stdout.splitlines() if line.strip().startswith("hint ")] == [
        lines[0].split("  -> ")[0], lines[1]]


def test_catalog_check_cli_exit_codes(tmp_path):
    good = envscaler("catalog", "check", str(counter_bundle(tmp_path / "good")))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "all gates pass" in good.stdout

    write_bundle(tmp_path / "bad", counter_spec(), [counter_scenario(checklist_with_func=[CHECK_NAME_KEPT, CHECK_ONE_ITEM]), second_scenario()])
    bad = envscaler("catalog", "check", str(tmp_path / "bad"))
    assert bad.returncode == 1
    assert "FAIL" in bad.stdout and "counter_001: check_fails_on_initial" in bad.stdout
    assert "counter_002" not in bad.stdout.split("FAIL", 1)[1].split("environments")[0]

    missing = envscaler("catalog", "check", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert "nowhere" in missing.stderr


def test_catalog_check_cli_survives_a_bundle_that_kills_its_checker(tmp_path):
    code = COUNTER_CODE.replace("import time", "import time\nimport os\nos._exit(3)")
    write_bundle(tmp_path, counter_spec(env_class_code=code), [counter_scenario()])
    result = envscaler("catalog", "check", str(tmp_path))
    assert result.returncode == 1
    assert "class_loads: loading the environment killed its checker process (exit 3)" in result.stdout
