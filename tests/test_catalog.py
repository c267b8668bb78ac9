"""The bundled catalog meets the bar: enough environments, tools and scenarios, and every gate passes."""

import json

import pytest

from envscaler import EnvRuntime, default_catalog, load_bundles
from tests.support.cli import envscaler


@pytest.fixture(scope="module")
def bundles():
    return load_bundles(default_catalog())


def test_catalog_size(bundles):
    assert len(bundles) >= 6
    assert len({b.env_id for b in bundles}) == len(bundles)
    assert sum(len(b.scenarios) for b in bundles) >= 48
    assert sum(len(EnvRuntime(b.spec).tools) for b in bundles) >= 72


def test_each_environment_meets_the_bar(bundles):
    for bundle in bundles:
        assert len(EnvRuntime(bundle.spec).tools) >= 12, bundle.env_id
        assert len(bundle.scenarios) >= 8, bundle.env_id
        assert sum(s.conversational for s in bundle.scenarios) >= 2, bundle.env_id
        for scenario in bundle.scenarios:
            assert len(scenario.reference_solution or []) >= 3, scenario.task_id
            assert len(scenario.checklist_with_func or []) >= 3, scenario.task_id


def test_catalog_check_passes_with_enough_state_changing_tools(tmp_path):
    report_file = tmp_path / "report.json"
    result = envscaler("catalog", "check", "--json", str(report_file), timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all gates pass" in result.stdout
    reports = json.loads(report_file.read_text())
    for report in reports:
        # Counted from the state diffs of reference runs, not from names: these tools really change state.
        assert report["state_changing_tools"] >= 5, report["env_id"]
