"""The gold runner both benchmark importers use: a bundle's reference solutions played turn by turn in a sandboxed child."""

from envscaler.importers.gold import NO_CHANGE, changes_digest, run_gold
from tests.support.bundles import shelf_scenario, shelf_spec, write_bundle


def scripted_scenario() -> dict:
    """Two turns: shelve a book, then raise the tally twice (the second raise is refused: a negative step)."""
    scenario = {key: value for key, value in shelf_scenario().items() if key not in ("task", "reference_solution")}
    scenario.update(task_id="shelf_002", turns=[
        {"message": "Shelve 'Ulysses'.", "reference_solution": [{"name": "add_book", "arguments": {"title": "Ulysses"}}]},
        {"message": "Raise the tally.", "reference_solution": [{"name": "bump", "arguments": {"by": 2}},
                                                               {"name": "bump", "arguments": {"by": -1}}]},
    ])
    return scenario


def test_each_turn_reports_its_calls_and_on_request_the_state_it_left(tmp_path):
    directory = write_bundle(tmp_path, shelf_spec(), [shelf_scenario(), scripted_scenario()])
    runs = run_gold(directory, timeout_s=120, states=True)
    single, scripted = runs["shelf_001"], runs["shelf_002"]
    assert len(single.turns) == 1 and [call.name for call in single.calls] == ["add_book", "bump"]
    first, second = scripted.turns
    assert [(c.name, c.result, c.changed, c.read_only) for c in first.calls] == [("add_book", {"count": 2}, True, False)]
    assert first.state == {"Shelf": {"items": ["Emma", "Ulysses"]}, "Tally": {"items": 5}}
    refused = second.calls[1]
    assert refused.error_kind == "agent" and "by must not be negative" in refused.error and not refused.env_fault
    assert second.state == {"Shelf": {"items": ["Emma", "Ulysses"]}, "Tally": {"items": 7}}
    initial = {"Shelf": {"items": ["Emma"]}, "Tally": {"items": 5}}
    assert scripted.digest == single.digest == changes_digest(initial, second.state) != NO_CHANGE


def test_states_are_left_out_unless_asked(tmp_path):
    directory = write_bundle(tmp_path, shelf_spec(), [scripted_scenario()])
    run = run_gold(directory, timeout_s=120)["shelf_002"]
    assert [turn.state for turn in run.turns] == [None, None]
    assert [call.name for call in run.calls] == ["add_book", "bump", "bump"]
