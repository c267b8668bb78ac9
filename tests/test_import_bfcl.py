"""``envscaler import bfcl``: a tiny BFCL checkout written here (tests/fixtures/bfcl, BFCL's layout and shapes) imported,
gated, and played through a real process farm by the replay and random agents."""

import json
import shutil
from pathlib import Path

import pytest

from envscaler import load_bundle
from envscaler.importers.bfcl import json_schema, parse_call
from tests.support.cli import envscaler

FIXTURE = Path(__file__).parent / "fixtures" / "bfcl"
LEADERBOARD = FIXTURE / "berkeley-function-call-leaderboard"
BUNDLES = ["bfcl_notebook_api_long_context", "bfcl_notebook_api_unit_math_api", "bfcl_notebook_api_wallet_api",
           "bfcl_wallet_api"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = tmp_path_factory.mktemp("bfcl") / "bundles"
    result = envscaler("import", "bfcl", str(FIXTURE), "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result.stdout + result.stderr


def test_one_bundle_per_combination_of_classes_and_a_report_of_what_was_left_out(imported):
    out, printed = imported
    assert sorted(p.name for p in out.iterdir()) == BUNDLES
    assert "imported 4 environment(s) and 6 scenario(s)" in printed
    assert "multi_turn_miss_func_0: category miss_func: functions are withheld until a later turn (read_note)" in printed
    assert "multi_turn_base_4: gold call: \"transfer(to='Sam', amount=get_balance())\" has an argument that is not a literal" in printed
    assert "BFCL_v3_multi_turn_base.json: an older version of a category that a newer file holds too" in printed
    assert ("multi_turn_base_5: a gold call of turn 1 fails in BFCL's own code: Environment error in 'audit': the call "
            "changed module global AUDITS, which every episode shares") in printed


def test_the_bundle_holds_every_class_as_a_part_with_the_benchmarks_tools(imported):
    out, _ = imported
    bundle = load_bundle(out / "bfcl_notebook_api_wallet_api")
    spec = bundle.spec
    assert [(p.name, p.class_name, p.loader) for p in spec.classes] == [
        ("NotebookAPI", "NotebookAPI", "_load_scenario"), ("WalletAPI", "WalletAPI", "_load_scenario")]
    # Both modules define DEFAULT_STATE and bind datetime differently: the later module's are renamed, its import dropped.
    assert "_wallet_api__DEFAULT_STATE" in spec.env_class_code and "import datetime as _wallet_api__datetime" in spec.env_class_code
    assert "func_source_code" not in spec.env_class_code and "NOTE_FILLER = " in spec.env_class_code
    tools = {t.name: t for t in spec.listed_tools()}
    assert tools["deposit"].parameters["properties"]["amount"] == {"type": "number", "description": "How much; more than zero."}
    assert spec.tool_errors.agent_errors == ["AttributeError", "IndexError", "KeyError", "NoteNotFound", "TypeError", "ValueError"]
    stateless = load_bundle(out / "bfcl_notebook_api_unit_math_api").spec.classes
    assert [(p.name, p.loader) for p in stateless] == [("NotebookAPI", "_load_scenario"), ("UnitMathAPI", None)]

    scenario = bundle.scenarios[0]
    assert scenario.task_id == "multi_turn_base_0" and len(scenario.turns) == 2
    assert scenario.init_config == {"NotebookAPI": {"owner": "sam"}, "WalletAPI": {"balance": 3.0}}
    second = scenario.turns[1]
    assert second.message == "Now put 20 in my wallet and send 5 of it to Sam."
    assert [(c.name, c.arguments) for c in second.reference_solution] == [("deposit", {"amount": 20.0}),
                                                                         ("transfer", {"to": "Sam", "amount": 5.0})]
    # The gold run's state, played in the child process, is what the state check expects.
    assert "'balance': 18.0" in second.checklist_with_func[1].check_func
    wallet = load_bundle(out / "bfcl_wallet_api").scenarios
    # A positional gold argument goes to the method's parameter of that place.
    assert [(c.name, c.arguments) for c in wallet[1].turns[0].reference_solution] == [("deposit", {"amount": 5.0})]
    asking = wallet[2]
    assert asking.task_id == "multi_turn_miss_param_0" and asking.turns[0].reference_solution == []
    assert "return not turn_results" in asking.turns[0].checklist_with_func[0].check_func


def test_long_context_tasks_load_their_classes_with_long_context(imported):
    out, _ = imported
    bundle = load_bundle(out / "bfcl_notebook_api_long_context")
    assert [(p.loader, p.loader_arguments) for p in bundle.spec.classes] == [("_load_scenario", {"long_context": True})]
    check = bundle.scenarios[0].turns[0].checklist_with_func[0].check_func
    assert "'filler': '(more text)'" in check  # what the loader added, as BFCL's long-context run has it


def test_catalog_check_passes_the_imported_bundles(imported):
    out, _ = imported
    result = envscaler("catalog", "check", str(out), "--jobs", "1", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_replay_through_a_farm_scores_one_and_random_scores_below(imported, tmp_path):
    out, _ = imported
    catalog = tmp_path / "farm.json"
    up = envscaler("farm", "up", *(str(out / name) for name in BUNDLES), "--backend", "process", "--catalog", str(catalog),
                   timeout=300)
    assert up.returncode == 0, up.stderr
    try:
        runs = {}
        for agent in ("replay", "random"):
            records = tmp_path / f"{agent}.jsonl"
            run = envscaler("run", "--farm", str(catalog), "--agent", agent, "--out", str(records), "--quiet", timeout=300)
            assert run.returncode == 0, run.stdout + run.stderr
            runs[agent] = [json.loads(line) for line in records.read_text().splitlines()]
    finally:
        envscaler("farm", "down", "--catalog", str(catalog))
    assert len(runs["replay"]) == 6 and all(r["reward"] == 1.0 for r in runs["replay"]), [r["checks"] for r in runs["replay"]]
    rewards = [r["reward"] for r in runs["random"]]
    assert len(rewards) == 6 and sum(rewards) / len(rewards) < 1.0


def test_the_v3_layout_imports_as_well(tmp_path):
    """BFCL v3 kept the data under berkeley-function-call-leaderboard/data and the package as bfcl/."""
    root = tmp_path / "gorilla" / "berkeley-function-call-leaderboard"
    shutil.copytree(LEADERBOARD / "bfcl_eval" / "data", root / "data",
                    ignore=shutil.ignore_patterns("BFCL_v4_*"))
    shutil.copytree(LEADERBOARD / "bfcl_eval" / "eval_checker", root / "bfcl" / "eval_checker")
    result = envscaler("import", "bfcl", str(tmp_path / "gorilla"), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "imported 1 environment(s) and 1 scenario(s)" in result.stdout
    assert load_bundle(tmp_path / "out" / "bfcl_wallet_api").scenarios[0].turns[0].reference_solution[0].name == "get_balance"


@pytest.mark.parametrize(("make", "message"), [
    (lambda root: root / "missing", "not a folder"),
    (lambda root: root, "no BFCL_v*_multi_turn_*.json data files"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, make, message):
    result = envscaler("import", "bfcl", str(make(tmp_path)), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_gold_calls_are_read_as_syntax_and_never_run():
    assert parse_call("transfer(to='Sam', amount=5.0)").arguments == {"to": "Sam", "amount": 5.0}
    assert parse_call("mv(paths=('a', 'b'))").arguments == {"paths": ["a", "b"]}
    assert parse_call("mv('a', dest='b')", {"mv": ["source", "dest"]}).arguments == {"source": "a", "dest": "b"}
    for text in ["__import__('os').system('true')", "cd(folder=open('x').read())", "deposit(5)", "mv('a', source='b')",
                 "mv(*paths)", "x = 1"]:
        with pytest.raises(ValueError):
            parse_call(text, {"mv": ["source", "dest"]})
    assert json_schema({"type": "dict", "properties": {"n": {"type": "float"}, "v": {"type": "any"}}, "required": ["n"]}) == {
        "type": "object", "properties": {"n": {"type": "number"}, "v": {}}, "required": ["n"]}
