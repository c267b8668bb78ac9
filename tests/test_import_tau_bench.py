"""``envscaler import tau-bench`` over a small checkout written here in tau-bench's layout (tests/fixtures/tau_bench)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from envscaler import load_bundle
from envscaler.bundle import save_bundle
from envscaler.errors import InfraError
from envscaler.importers.gold import NO_CHANGE, changes_digest, run_gold
from envscaler.importers.tau_bench import domain_spec, find_domains, read_domain
from envscaler.models import Bundle, Scenario
from envscaler.runtime import EnvRuntime
from tests.support.cli import envscaler
from tests.support.farm import process_farm
from tests.support.openai_replay import ReplayServer

CHECKOUT = Path(__file__).parent / "fixtures" / "tau_bench"
LIBRARY = CHECKOUT / "tau_bench" / "envs" / "library"


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_domain_is_read_as_text_tools_tasks_data_wiki_and_rules():
    assert find_domains(CHECKOUT) == {"library": LIBRARY}
    assert find_domains(CHECKOUT / "tau_bench" / "envs") == {"library": LIBRARY}
    domain = read_domain(LIBRARY, ["test", "dev"])
    assert [t.name for t in domain.tools] == ["find_member_id_by_email", "get_book_details", "borrow_book", "return_book",
                                              "transfer_to_human_agents"]
    # Read-only from the tool's own code: writes through invoke's data parameter, a tuple-unpacked alias included.
    assert {t.name: t.hints.readOnlyHint for t in domain.tools} == {
        "find_member_id_by_email": True, "get_book_details": True, "borrow_book": False, "return_book": False,
        "transfer_to_human_agents": True}
    assert [t.task_id for t in domain.tasks] == ["test_0", "test_1", "test_2", "test_3", "test_4"]
    first = domain.tasks[0]
    assert first.user_id == "omar_chen_2048" and first.instruction.startswith("You are Omar Chen.")
    assert [a.name for a in first.actions][-1] == "borrow_book" and first.actions[-1].arguments == {
        "member_id": "omar_chen_2048", "book_id": "B100"}
    assert domain.tasks[1].outputs == ["2"]
    assert set(domain.data_files) == {"books", "members"}
    assert domain.wiki.startswith("# Library agent policy") and len(domain.rules) == 2
    assert [(o.item, o.reason) for o in domain.left_out] == [("library/dev", "the domain has no tasks_dev.py")]


OTHER_TASK_SHAPES = '''
tasks = [
    {"user_id": "u1", "instruction": "Look up B100.", "actions": [{"name": "get_book_details", "kwargs": {"book_id": "B100"}}], "outputs": []},
    Task(user_id="u2", instruction=f"You are {NAME}.", actions=[], outputs=[]),
    Task(user_id="u3", instruction="Borrow B100.", actions=[Action(name="reserve_book", kwargs={"book_id": "B100"})], outputs=[]),
]
'''


def test_tasks_written_as_dicts_are_read_and_computed_or_unknown_ones_are_left_out_with_the_reason(tmp_path):
    domain = tmp_path / "library"
    shutil.copytree(LIBRARY, domain)
    (domain / "tasks_dev.py").write_text(OTHER_TASK_SHAPES)
    read = read_domain(domain, ["dev"])
    assert [(t.task_id, t.user_id, [a.name for a in t.actions]) for t in read.tasks] == [("dev_0", "u1", ["get_book_details"])]
    assert [(o.item, o.reason) for o in read.left_out] == [
        ("library/dev_1", "cannot be read without running the file: line 4: Task(user_id='u2', instruction=f'You are {NAME}.', "
                          "actions=[], outputs=[]) is computed, not written as literals"),
        ("library/dev_2", "its gold actions call reserve_book, which no imported tool serves"),
    ]


def test_the_generated_class_serves_the_tools_with_their_own_schemas_and_error_policy():
    domain = read_domain(LIBRARY)
    spec = domain_spec(domain)
    assert spec.env_id == "tau_library" and spec.env_class_name == "TauLibraryEnv"
    assert "from tau_bench" not in spec.env_class_code and "class BorrowBook(Tool):" in spec.env_class_code
    assert spec.tool_errors.text_prefixes == ["Error:"]
    runtime = EnvRuntime(spec)
    assert list(runtime.tools) == [t.name for t in domain.tools]
    assert runtime.tools["borrow_book"].parameters["required"] == ["member_id", "book_id"]
    members = json.loads((LIBRARY / "data" / "members.json").read_text())
    books = json.loads((LIBRARY / "data" / "books.json").read_text())
    episode = runtime.new_episode({"members": members, "books": books})
    missing = episode.call("find_member_id_by_email", {"email": "nobody@example.com"})
    assert missing.error_kind == "tool" and missing.agent_text == "Error: member not found"
    borrowed = episode.call("borrow_book", {"member_id": "omar_chen_2048", "book_id": "B100"})
    assert borrowed.error is None and json.loads(borrowed.agent_text)["loans"] == ["B100"]
    assert episode.state()["books"]["B100"]["copies_available"] == 0


def test_the_gold_actions_run_in_a_sandboxed_child_that_reports_each_call_and_the_final_digest(tmp_path):
    domain = read_domain(LIBRARY)
    spec = domain_spec(domain)
    data = {key: json.loads(path.read_text()) for key, path in domain.data_files.items()}
    scenarios = [Scenario(task_id=t.task_id, env_id=spec.env_id, init_config=data, reference_solution=t.actions) for t in domain.tasks]
    runs = run_gold(save_bundle(Bundle(spec=spec, scenarios=scenarios), tmp_path), timeout_s=120)
    assert sorted(runs) == ["test_0", "test_1", "test_2", "test_3", "test_4"]
    lookup = runs["test_0"].calls[0]  # an unknown email: a lookup that finds nothing
    assert (lookup.error_kind, lookup.read_only, lookup.changed) == ("tool", True, False)
    assert runs["test_0"].calls[-1].changed
    changed = json.loads(json.dumps(data))
    changed["books"]["B100"]["copies_available"] = 0
    changed["members"]["omar_chen_2048"]["loans"] = ["B100"]
    assert runs["test_0"].digest == changes_digest(data, changed) != NO_CHANGE
    assert runs["test_2"].digest == NO_CHANGE  # lookups only
    write = runs["test_4"].calls[1]  # no copy left: a gold write that fails
    assert (write.name, write.error_kind, write.read_only, write.changed) == ("borrow_book", "tool", False, False)


def test_a_gold_run_whose_environment_does_not_load_is_an_infra_error(tmp_path):
    spec = domain_spec(read_domain(LIBRARY)).model_copy(update={"env_class_code": "class TauLibraryEnv(:\n    pass\n"})
    with pytest.raises(InfraError, match="^tau_library: the gold run failed \\(exit 1\\): error: tau_library: syntax error in class code, line 1"):
        run_gold(save_bundle(Bundle(spec=spec), tmp_path), timeout_s=120)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["/nonexistent/tau"], "no tau-bench domain found"),
        ([str(CHECKOUT), "--domain", "airline"], "no domain 'airline' (domains: library)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, expected):
    result = envscaler("import", "tau-bench", *args, "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and expected in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tau") / "bundles"
    result = envscaler("import", "tau-bench", str(CHECKOUT), "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "imported 1 environment(s) and 4 scenario(s)" in result.stdout
    # The transfer-only task (doing nothing solves it) is left out, and why; so is a gold write that fails and changes nothing.
    assert "left out library/test_3: its gold actions change no data and it expects no output" in result.stderr
    assert ("left out library/test_4 action 2: the gold write borrow_book fails (the tool's answer starts with 'Error:') "
            "and changes nothing, in tau-bench too: left out of the reference solution") in result.stderr
    return out / "tau_library"


def test_the_bundle_holds_the_data_once_and_the_tasks_as_conversational_scenarios(imported):
    bundle = load_bundle(imported)
    assert sorted(p.name for p in (imported / "data").iterdir()) == ["books.json", "members.json"]
    assert [s.task_id for s in bundle.scenarios] == ["test_0", "test_1", "test_2", "test_4"]
    assert [c.arguments.get("book_id") for c in bundle.scenarios[3].reference_solution] == [None, "B300"]
    for scenario in bundle.scenarios:
        assert scenario.init_config == {"books": {"$file": "data/books.json"}, "members": {"$file": "data/members.json"}}
        assert scenario.conversational and scenario.user_profile == scenario.task
    returned = bundle.scenarios[1]
    assert returned.reference_reply == "2"
    assert [c.check_item for c in returned.checklist_with_func] == [
        "the data equals the data after the gold actions", "the agent told the user '2'"]
    assert bundle.spec.environment_introduction.startswith("# Library agent policy")


def test_catalog_check_passes_every_gate_on_the_import(imported):
    result = envscaler("catalog", "check", str(imported), "--jobs", "1", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all gates pass" in result.stdout


@pytest.fixture(scope="module")
def tau_farm(imported, tmp_path_factory):
    with process_farm(tmp_path_factory.mktemp("tau_farm"), [imported]) as catalog:
        yield catalog


def test_replay_scores_one_and_random_scores_less(tau_farm, tmp_path):
    replay = envscaler("run", "--farm", str(tau_farm), "--agent", "replay", "--out", str(tmp_path / "replay.jsonl"), timeout=300)
    assert replay.returncode == 0, replay.stderr
    replayed = records(tmp_path / "replay.jsonl")
    assert len(replayed) == 4 and all(r["reward"] == 1.0 for r in replayed), [(r["task_id"], r["checks"]) for r in replayed]
    randomly = envscaler("run", "--farm", str(tau_farm), "--agent", "random", "--out", str(tmp_path / "random.jsonl"), timeout=300)
    assert randomly.returncode == 0, randomly.stderr
    rewards = [r["reward"] for r in records(tmp_path / "random.jsonl")]
    assert len(rewards) == 4 and sum(rewards) / len(rewards) < 1.0


def test_a_conversation_with_the_simulated_user_is_scored_on_data_and_replies(tau_farm, tmp_path):
    scripts = {
        "user": [{"content": "Hi, I am Lena Ward, lena.ward@example.com. I want to return B200."},
                 {"content": "Yes, please. And how many copies of B300 are there?"},
                 {"content": "Thanks! ###STOP###"}],
        "agent": [{"tool_calls": [{"name": "find_member_id_by_email", "arguments": {"email": "lena.ward@example.com"}}]},
                  {"content": "Found you. Shall I take back Salt and Signal (B200)?"},
                  {"tool_calls": [{"name": "return_book", "arguments": {"member_id": "lena_ward_1024", "book_id": "B200"}},
                                  {"name": "get_book_details", "arguments": {"book_id": "B300"}}]},
                  {"content": "Returned. Northbound Lanterns has 2 copies available."}],
    }
    with ReplayServer(scripts) as server:
        result = envscaler("run", "--farm", str(tau_farm), "--agent", "openai", "--base-url", server.base_url, "--model", "agent",
                           "--user-model", "user", "--scenario", "tau_library/test_1", "--out", str(tmp_path / "out.jsonl"),
                           timeout=300)
        user_requests = server.requests_for("user")
    assert result.returncode == 0, result.stderr
    [record] = records(tmp_path / "out.jsonl")
    assert record["termination"] == "user_stop"
    assert record["reward"] == 1.0, record["checks"]
    assert "You are Lena Ward" in user_requests[0]["messages"][0]["content"]
