"""Quality gates: proof that every scenario is solvable and every checklist meaningful.

For each bundle: the class loads, its declared Python requirements are installed, and every listed
tool exists with a matching signature. For each scored scenario: the init_config instantiates; the
reference solution runs with no tool error (a read-only lookup may fail with an exception the
environment declares the caller's fault, if it changed nothing); every check passes on the
reference's final state; at least one check cleanly fails (returns False, no error) on the untouched
initial state; checks give the same answers twice (a check that only sometimes outruns its time
limit is named as such); a do-nothing agent scores below 1.0. The report also keeps what each tool's
reference calls did to the state (``envscaler.observed_hints``).

A scenario with scripted turns is played turn by turn, as the server scores it (``envscaler.turns``):
each turn's reference, then that turn's checks on the state and calls of the turn, then the final
checks; the do-nothing agent makes no call and ends every turn in order.

:func:`envscaler.gate_workers.check_isolated` runs them in limited child processes, with a time
limit per scenario, so that untrusted code never runs in the process that drives the check;
``envscaler catalog check`` and synthesis use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from envscaler.annotations import derive_annotations
from envscaler.checks import timed_out
from envscaler.errors import EnvScalerError
from envscaler.models import Bundle, CheckContext, CheckResult, Scenario, ToolCall, ToolOutcome, Turn, ValidationResult
from envscaler.requirements import require_installed
from envscaler.runtime import EnvRuntime, Episode
from envscaler.tools import signature_problems
from envscaler.turns import of_turn, validation

# The gates' limits for one tool call and one check: looser than a server's, which serves agents.
DEFAULT_CALL_TIMEOUT_S = 5.0
DEFAULT_CHECK_TIMEOUT_S = 2.0

GATES = (
    "class_loads",
    "instantiates",
    "reference_runs",
    "read_only_tools",
    "checks_pass_on_reference",
    "check_fails_on_initial",
    "deterministic",
    "do_nothing_below_one",
)


class GateResult(BaseModel):
    """One gate on one scenario (or on the environment as a whole)."""

    gate: str
    passed: bool
    detail: str = ""


class ScenarioReport(BaseModel):
    task_id: str
    gates: list[GateResult] = Field(default_factory=list)
    skipped: str | None = None

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)


class ToolObservation(BaseModel):
    """What the reference solutions' calls of one tool were seen to do (calls that ran without error)."""

    calls: int = 0
    changed: int = 0
    """Of those, the calls that changed the state."""


def merge_observations(into: dict[str, ToolObservation], more: dict[str, ToolObservation]) -> None:
    """Add ``more``'s counts to ``into``'s, tool by tool."""
    for name, seen in more.items():
        total = into.setdefault(name, ToolObservation())
        total.calls += seen.calls
        total.changed += seen.changed


class EnvReport(BaseModel):
    """Every gate's verdict for one environment."""

    env_id: str
    tools: int = 0
    state_changing_tools: int | None = None
    env_gates: list[GateResult] = Field(default_factory=list)
    scenarios: list[ScenarioReport] = Field(default_factory=list)
    observed: dict[str, ToolObservation] = Field(default_factory=dict)
    """Per tool, what the reference solutions' calls did (``envscaler.observed_hints`` writes it back as hints)."""
    code_read_only: dict[str, bool] = Field(default_factory=dict)
    """Per tool, whether its code reads as read-only (``envscaler.annotations``, before env.json's own hints)."""

    def observe(self, observed: dict[str, ToolObservation]) -> None:
        """Take the observations of some scenarios, and count the tools seen to change the state."""
        merge_observations(self.observed, observed)
        self.state_changing_tools = sum(1 for seen in self.observed.values() if seen.changed)

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.env_gates) and all(s.passed for s in self.scenarios)

    def failures(self) -> list[str]:
        """``task_id: gate: detail`` for every failed gate."""
        lines = [f"(env): {g.gate}: {g.detail}" for g in self.env_gates if not g.passed]
        for scenario in self.scenarios:
            lines += [f"{scenario.task_id}: {g.gate}: {g.detail}" for g in scenario.gates if not g.passed]
        return lines


def check_bundle(
    bundle: Bundle, *, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, check_timeout_s: float = DEFAULT_CHECK_TIMEOUT_S
) -> EnvReport:
    """Run every gate on every scenario of ``bundle``, in this process (see ``envscaler.gate_workers``)."""
    report, runtime = check_environment(bundle, call_timeout_s=call_timeout_s, check_timeout_s=check_timeout_s)
    if runtime is None:
        return report
    observed: dict[str, ToolObservation] = {}
    for scenario in bundle.scenarios:
        report.scenarios.append(check_scenario(runtime, scenario, observed))
    report.observe(observed)
    return report


def check_environment(
    bundle: Bundle, *, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, check_timeout_s: float = DEFAULT_CHECK_TIMEOUT_S
) -> tuple[EnvReport, EnvRuntime | None]:
    """The environment-wide gate (``class_loads``), and the runtime to check scenarios with (None if it cannot load)."""
    report = EnvReport(env_id=bundle.env_id)
    try:
        require_installed(bundle.env_id, bundle.spec.requires)
        runtime = EnvRuntime(bundle.spec, call_timeout_s=call_timeout_s, check_timeout_s=check_timeout_s, bundle_dir=bundle.directory)
    except EnvScalerError as e:
        report.env_gates.append(GateResult(gate="class_loads", passed=False, detail=str(e)))
        return report, None
    listed = bundle.spec.listed_tools()
    problems = signature_problems(runtime.env_class, listed) if listed is not None else []
    if not runtime.tools:
        problems.append("the class has no tools")
    for name in sorted(set(bundle.spec.tool_annotations or {}) - set(runtime.tools)):
        problems.append(f"tool_annotations names {name!r}, which is not a tool")
    report.tools = len(runtime.tools)
    report.env_gates.append(GateResult(gate="class_loads", passed=not problems, detail="; ".join(problems)))
    derived = derive_annotations(bundle.spec.env_class_code, runtime.env_class, list(runtime.tools))
    report.code_read_only = {name: hints.readOnlyHint for name, hints in derived.items() if hints.readOnlyHint is not None}
    return report, runtime


def check_scenario(
    runtime: EnvRuntime,
    scenario: Scenario,
    observed: dict[str, ToolObservation] | None = None,
    *,
    on_gate: Callable[[str], None] | None = None,
) -> ScenarioReport:
    """Run the per-scenario gates, stopping at the first gate the later ones depend on.

    ``observed`` gains what each tool's calls in the reference solution did, once it runs. ``on_gate``
    hears each gate's name as it starts, so that a driver that stops a hung check can name the gate
    that hung.
    """
    started = on_gate or (lambda gate: None)
    report = ScenarioReport(task_id=scenario.task_id)
    gates = report.gates
    started("instantiates")
    try:
        runtime.new_episode(scenario.init_config, scenario_key=scenario.task_id)
    except EnvScalerError as e:
        gates.append(GateResult(gate="instantiates", passed=False, detail=str(e)))
        return report
    gates.append(GateResult(gate="instantiates", passed=True))
    if not scenario.check_count():
        report.skipped = "unscored scenario (no checklist): only instantiation is checked"
        return report

    started("reference_runs")
    calls: list[tuple[int, str, bool]] = []
    on_reference, problem = _play(runtime, scenario, act=True, calls=calls)
    gates.append(GateResult(gate="reference_runs", passed=problem is None, detail=problem or ""))
    if on_reference is None or problem is not None:
        return report
    if observed is not None:
        for _, name, changed in calls:
            seen = observed.setdefault(name, ToolObservation())
            seen.calls += 1
            seen.changed += changed
    # A client runs a read-only tool without asking: one that changes the state must not say so.
    lying = [f"call {number} ({name})" for number, name, changed in calls if changed and runtime.annotations[name].readOnlyHint]
    gates.append(GateResult(
        gate="read_only_tools",
        passed=not lying,
        detail=("marked readOnlyHint but changed the state: " + ", ".join(lying)
                + "; fix the method or set readOnlyHint false under tool_annotations in env.json") if lying else "",
    ))

    started("checks_pass_on_reference")
    failed = [_named(c) + (f" ({c.error})" if c.error else "") for c in on_reference.checks if not c.passed]
    gates.append(
        GateResult(
            gate="checks_pass_on_reference",
            passed=not failed,
            detail=("failing: " + "; ".join(failed)) if failed else "",
        )
    )

    started("check_fails_on_initial")
    on_initial, _ = _play(runtime, scenario, act=False)
    assert on_initial is not None
    # A check that crashes on the initial state proves nothing about the task: require a clean False.
    clean_failures = [c for c in on_initial.checks if not c.passed and not c.error]
    errored = [f"{_named(c)} ({c.error})" for c in on_initial.checks if c.error]
    detail = ""
    if not clean_failures:
        detail = "no check fails cleanly before any action"
        detail += ("; errored instead: " + "; ".join(errored)) if errored else ": every check already passes"
    gates.append(GateResult(gate="check_fails_on_initial", passed=bool(clean_failures), detail=detail))

    started("deterministic")
    on_second, _ = _play(runtime, scenario, act=True, fresh=True)
    on_reference_again, _ = _play(runtime, scenario, act=True)
    on_initial_again, _ = _play(runtime, scenario, act=False)
    answers = [_verdicts(on_reference_again), _verdicts(on_reference), _verdicts(on_second) if on_second else None]
    same_checks = answers[0] == answers[1] == answers[2] and _verdicts(on_initial_again) == _verdicts(on_initial)
    same_state = on_second is not None and on_second.state_hash == on_reference.state_hash
    detail = ""
    if not same_state:
        detail = "two runs of the reference solution ended in different states (randomness, clock or ids?)"
    elif not same_checks:
        runs = [on_reference, on_initial, on_reference_again, on_initial_again, on_second]
        slow = sorted({_named(c) for run in runs if run is not None for c in run.checks if timed_out(c)})
        # A check near its time limit answers in one run and is stopped in another: that is the limit, not the check.
        detail = (f"{', '.join(slow)} ran past the check time limit ({runtime.check_timeout_s:g} s) in some runs "
                  "and not in others (raise it with --check-timeout, or make the check faster)" if slow
                  else "checks gave different answers on identical states")
    gates.append(GateResult(gate="deterministic", passed=same_checks and same_state, detail=detail))
    gates.append(
        GateResult(
            gate="do_nothing_below_one",
            passed=on_initial.score < 1.0,
            detail=f"do-nothing score {on_initial.score:.2f}",
        )
    )
    return report


def _named(check: CheckResult) -> str:
    """A check as a gate's detail names it: its text, and its turn in a scenario with turns."""
    return f"{check.check_item!r}" if check.turn is None else f"turn {check.turn}: {check.check_item!r}"


def _verdicts(result: Any) -> list[tuple[bool, str | None]]:
    return [(c.passed, c.error) for c in result.checks]


def _play(
    runtime: EnvRuntime, scenario: Scenario, *, act: bool, calls: list[tuple[int, str, bool]] | None = None, fresh: bool = False
) -> tuple[ValidationResult | None, str | None]:
    """The scenario played on a new episode and scored as the server scores it: (validation, first problem or None).

    ``act``: the agent runs the reference solution and answers with the reference replies (of each turn,
    in a scenario with turns); else it does nothing (no calls, no replies, every turn ended in order).
    ``calls`` collects (call number, tool name, whether it changed the state) of the reference calls that
    ran without error. The episode shares the scenario's constructed state, or with ``fresh`` is
    constructed anew, so that a constructor that is not deterministic shows up in the determinism gate.
    """
    script = scenario.turns or [Turn(message=scenario.task, reference_solution=scenario.reference_solution,
                                     reference_reply=scenario.reference_reply)]
    if act:
        problem = _script_problem(scenario, script)
        if problem is not None:
            return None, problem
    episode = runtime.new_episode(scenario.init_config, scenario_key=None if fresh else scenario.task_id)
    results: list[CheckResult] = []
    everything: list[ToolOutcome] = []
    replies: list[str] = []
    for number, turn in enumerate(script, start=1):
        outcomes: list[ToolOutcome] = []
        said = [turn.reference_reply] if act and turn.reference_reply is not None else []
        if act:
            problem = _run_calls(runtime, episode, turn.reference_solution or [], calls, outcomes, first=len(everything) + 1)
            if problem is not None:
                return None, f"turn {number}: {problem}" if scenario.turns else problem
        if scenario.turns and turn.checklist_with_func:
            checks = episode.validate(turn.checklist_with_func, CheckContext.of_calls(outcomes, said)).checks
            results += of_turn(checks, number)
        everything += outcomes
        replies += said
    final = scenario.checklist_with_func
    if final:
        results += episode.validate(final, CheckContext.of_calls(everything, replies)).checks
    return validation(results, episode.state_hash()), None


def _script_problem(scenario: Scenario, script: list[Turn]) -> str | None:
    """Why the scenario's reference cannot be played (no reference, or one that does nothing), or None."""
    if scenario.turns:
        missing = [str(number) for number, turn in enumerate(script, start=1) if turn.reference_solution is None]
        if missing:
            return f"turn(s) {', '.join(missing)} have no reference_solution (give [] for a turn that needs no call)"
        if not any(turn.reference_solution for turn in script):
            return "no turn's reference solution makes a call: a task that doing nothing solves cannot score an agent"
        return None
    if scenario.reference_solution is None:
        return "the scenario has no reference_solution"
    if not scenario.reference_solution:
        return "the reference solution is empty (do nothing): a task that doing nothing solves cannot score an agent"
    return None


def _run_calls(runtime: EnvRuntime, episode: Episode, reference: list[ToolCall], calls: list[tuple[int, str, bool]] | None,
               outcomes: list[ToolOutcome], *, first: int) -> str | None:
    """Run ``reference``'s calls (numbered from ``first``) on ``episode``, their outcomes into ``outcomes``: the
    first problem, or None."""
    for number, call in enumerate(reference, start=first):
        outcome = episode.call(call.name, call.arguments)
        outcomes.append(outcome)
        if outcome.error_kind == "agent" and outcome.exception is not None:
            problem = _declared_failure(runtime, number, outcome)
            if problem is not None:
                return problem
            continue  # a lookup that found nothing, and said so as the environment declares
        if outcome.error_kind == "tool":
            return f"call {number} ({call.name}) failed, {outcome.error}: {outcome.agent_text[:300]}"
        if outcome.error:
            return f"call {number} ({call.name}): {outcome.error}"
        if calls is not None:
            calls.append((number, call.name, bool(outcome.diff)))
    return None


def _declared_failure(runtime: EnvRuntime, number: int, outcome: ToolOutcome) -> str | None:
    """Why a reference call that raised a declared agent error (``agent_errors``) fails ``reference_runs``, or None.

    A gold lookup may find nothing (tau-bench's tools raise on an unknown id), so such a call passes when
    its tool is read-only and it changed nothing. A tool that changes the state is in the reference to
    change it: its failure stays a failure, as does a call that changed the state before it raised,
    whatever the tool's hints say.
    """
    call = f"call {number} ({outcome.name})"
    if outcome.diff:
        return f"{call} changed the state, then raised {outcome.exception} (a declared agent error): {outcome.error}"
    if not runtime.annotations[outcome.name].readOnlyHint:
        return (f"{call} failed, {outcome.error} (a declared agent error): a reference call of a tool that changes "
                "the state must succeed; only a read-only lookup may find nothing")
    return None
