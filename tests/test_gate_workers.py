"""The gates in worker processes: a time limit per scenario, failures kept apart, the work split over processes."""

from envscaler.gate_workers import check_isolated
from tests.support.bundles import COUNTER_CODE, counter_bundle, counter_scenario, counter_spec, second_scenario, write_bundle
from tests.support.cli import envscaler

# Tools that defeat the in-process guard: one loops in C code (no signal handler runs until it
# returns), one kills its process.
SABOTAGE_CODE = COUNTER_CODE.replace(
    "    def get_item(",
    "    def hang(self) -> dict:\n"
    "        \"\"\"Hang where no guard reaches.\"\"\"\n"
    "        import itertools\n"
    "        return sum(itertools.repeat(1, 10 ** 15))\n"
    "\n"
    "    def crash(self) -> dict:\n"
    "        \"\"\"End the process.\"\"\"\n"
    "        import os\n"
    "        os._exit(3)\n"
    "\n"
    "    def get_item(",
)


def sabotage_bundle(tmp_path):
    hang = counter_scenario(task_id="counter_hang", reference_solution=[{"name": "hang", "arguments": {}}])
    crash = counter_scenario(task_id="counter_crash", reference_solution=[{"name": "crash", "arguments": {}}])
    return write_bundle(tmp_path, counter_spec(env_class_code=SABOTAGE_CODE), [counter_scenario(), hang, second_scenario(), crash])


def test_a_hung_or_dead_worker_fails_only_its_scenario_under_the_gate_it_was_in(tmp_path):
    seen = []
    report = check_isolated(sabotage_bundle(tmp_path), 3.0, on_scenario=lambda env_id, r: seen.append((env_id, r.task_id)))
    by_id = {s.task_id: s for s in report.scenarios}
    assert [s.task_id for s in report.scenarios] == ["counter_001", "counter_hang", "counter_002", "counter_crash"]
    assert by_id["counter_001"].passed and by_id["counter_002"].passed
    [hung] = by_id["counter_hang"].gates
    assert hung.gate == "reference_runs" and not hung.passed and "did not finish within 3 s" in hung.detail
    [died] = by_id["counter_crash"].gates
    assert died.gate == "reference_runs" and "killed its checker process (exit 3)" in died.detail
    assert report.env_gates[0].passed and report.state_changing_tools >= 1
    assert sorted(seen) == sorted(("counter", t) for t in by_id)


def test_workers_split_a_bundle_and_agree_with_one(tmp_path):
    bundle = counter_bundle(tmp_path)
    one, two = check_isolated(bundle, 60.0), check_isolated(bundle, 60.0, workers=2)
    assert one.model_dump() == two.model_dump() and one.passed


def test_a_class_that_does_not_load_fails_class_loads_once(tmp_path):
    broken = write_bundle(tmp_path, counter_spec(env_class_code="class Counter(:\n"), [counter_scenario(), second_scenario()])
    report = check_isolated(broken, 10.0, workers=2)
    assert [g.gate for g in report.env_gates] == ["class_loads"] and not report.env_gates[0].passed
    assert report.scenarios == []


def test_catalog_check_streams_scenarios_and_names_the_limit_per_scenario(tmp_path):
    help_text = envscaler("catalog", "check", "--help").stdout
    assert "per scenario" in help_text
    done = envscaler("catalog", "check", str(sabotage_bundle(tmp_path)), "--timeout", "3", "--jobs", "2", timeout=120)
    assert done.returncode == 1
    assert "counter/counter_hang: FAIL reference_runs" in done.stderr and "counter/counter_001: ok" in done.stderr
    assert "counter_hang: reference_runs: did not finish within 3 s" in done.stdout
