"""Bundles and EnvScaler imports: round trips, unknown fields kept, bad input named precisely."""

import json

import pytest

from envscaler import BundleError, EnvSpec, load_bundle, save_bundle
from envscaler.importers import import_envscaler
from tests.support.bundles import counter_bundle, counter_scenario, counter_spec, write_bundle


def test_round_trip_keeps_unknown_fields(tmp_path):
    spec = counter_spec(extra_field={"kept": True}, tools=None)
    scenario = counter_scenario(difficulty="hard")
    directory = write_bundle(tmp_path / "in", spec, [scenario])
    bundle = load_bundle(directory)
    assert bundle.spec.model_extra == {"extra_field": {"kept": True}}
    out = save_bundle(bundle, tmp_path / "out")
    again = load_bundle(out)
    assert again.spec.model_extra == {"extra_field": {"kept": True}}
    assert again.scenarios[0].model_extra == {"difficulty": "hard"}
    assert again.spec.content_hash() == bundle.spec.content_hash()


def test_content_hash_changes_with_content():
    a = EnvSpec.model_validate(counter_spec())
    b = EnvSpec.model_validate(counter_spec(environment_summary="Other."))
    assert a.content_hash() != b.content_hash()
    assert len(a.content_hash()) == 16


def test_malformed_json_names_file_and_line(tmp_path):
    directory = counter_bundle(tmp_path)
    (directory / "scenarios.jsonl").write_text(json.dumps(counter_scenario()) + "\n{not json\n")
    with pytest.raises(BundleError, match=r"scenarios.jsonl:2:\d+: malformed JSON"):
        load_bundle(directory)


def test_missing_field_names_file_and_field(tmp_path):
    spec = counter_spec()
    del spec["env_class_code"]
    directory = write_bundle(tmp_path, spec, [])
    with pytest.raises(BundleError, match=r"env.json: env_class_code: Field required"):
        load_bundle(directory)


def test_scenario_field_error_names_line(tmp_path):
    bad = counter_scenario()
    bad["checklist_with_func"] = [{"check_item": "no function"}]
    directory = write_bundle(tmp_path, counter_spec(), [counter_scenario(), bad])
    with pytest.raises(BundleError, match=r"scenarios.jsonl:2: checklist_with_func.0.check_func: Field required"):
        load_bundle(directory)


def test_scenario_of_another_env_is_rejected(tmp_path):
    directory = write_bundle(tmp_path, counter_spec(), [counter_scenario(env_id="other")])
    with pytest.raises(BundleError, match="does not match"):
        load_bundle(directory)


def test_import_envscaler_release(tmp_path):
    spec = counter_spec()
    env_id = spec.pop("env_id")
    (tmp_path / "meta.json").write_text(json.dumps({env_id: spec}))
    scored = counter_scenario()
    sft = {k: v for k, v in counter_scenario(task_id="counter_sft").items() if k not in ("checklist_with_func", "reference_solution")}
    orphan = counter_scenario(task_id="x", env_id="missing_env")
    (tmp_path / "tasks.json").write_text(json.dumps([scored, sft, orphan]))
    report = import_envscaler(tmp_path / "meta.json", [tmp_path / "tasks.json"], tmp_path / "out")
    assert (report.environments, report.scenarios, report.unscored) == (1, 2, 1)
    assert report.orphans == {"missing_env": 1}
    bundle = load_bundle(tmp_path / "out" / "counter")
    assert [s.task_id for s in bundle.scenarios] == ["counter_001", "counter_sft"]
    assert bundle.scenarios[1].checklist_with_func is None


def test_import_rejects_wrong_shapes(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps([1, 2]))
    (tmp_path / "tasks.json").write_text("[]")
    with pytest.raises(BundleError, match="meta.json: expected a JSON object keyed by env_id"):
        import_envscaler(tmp_path / "meta.json", [tmp_path / "tasks.json"], tmp_path / "out")
    (tmp_path / "meta.json").write_text(json.dumps({"counter": counter_spec()}))
    (tmp_path / "tasks.json").write_text(json.dumps([{"env_id": "counter"}]))
    with pytest.raises(BundleError, match=r"tasks.json: item 0: task_id: Field required"):
        import_envscaler(tmp_path / "meta.json", [tmp_path / "tasks.json"], tmp_path / "out")


def test_duplicate_task_ids_are_refused_by_load_and_import(tmp_path):
    directory = write_bundle(tmp_path / "in", counter_spec(), [counter_scenario(), counter_scenario(task="Other task.")])
    with pytest.raises(BundleError, match=r"duplicate task_id 'counter_001' \(2 times\)"):
        load_bundle(directory)
    spec = counter_spec()
    env_id = spec.pop("env_id")
    (tmp_path / "meta.json").write_text(json.dumps({env_id: spec}))
    (tmp_path / "tasks.json").write_text(json.dumps([counter_scenario(), counter_scenario()]))
    with pytest.raises(BundleError, match="counter: duplicate task_id 'counter_001'"):
        import_envscaler(tmp_path / "meta.json", [tmp_path / "tasks.json"], tmp_path / "out")
    assert not (tmp_path / "out" / "counter").exists()


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (["ValueError", "not a name"], "tool_errors.agent_errors: Value error, 'not a name' is not an exception class name"),
        (["KeyError", "Exception"], "'Exception' would make every bug in the environment's code the agent's fault"),
        ("ValueError", "tool_errors.agent_errors: Input should be a valid list"),
    ],
)
def test_declared_agent_errors_are_exception_class_names(tmp_path, names, expected):
    write_bundle(tmp_path, counter_spec(tool_errors={"agent_errors": names}), [counter_scenario()])
    with pytest.raises(BundleError) as caught:
        load_bundle(tmp_path / "counter")
    assert "env.json" in str(caught.value) and expected in str(caught.value)
    write_bundle(tmp_path, counter_spec(tool_errors={"agent_errors": ["LookupError", "json.JSONDecodeError", "NotFound"]}), [counter_scenario()])
    assert load_bundle(tmp_path / "counter").spec.tool_errors.agent_errors == ["LookupError", "json.JSONDecodeError", "NotFound"]


def test_declared_python_requirements_are_pep_508(tmp_path):
    write_bundle(tmp_path, counter_spec(requires=["mpmath>=1.3", "numpy; python_version >= '3.11'", "not a requirement!"]), [counter_scenario()])
    with pytest.raises(BundleError) as caught:
        load_bundle(tmp_path / "counter")
    message = str(caught.value)
    assert "env.json: requires: Value error, 'not a requirement!' is not a PEP 508 requirement (such as 'mpmath>=1.3')" in message
    assert "\n" not in message
