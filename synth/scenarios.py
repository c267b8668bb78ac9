"""ScenGenerator: environment -> initial state -> task -> checklist -> check functions -> reference
solution -> the catalog's quality gates.

Every scenario passes the same gates as ``envscaler catalog check``, run the same way (a limited child
per check, envscaler.gate_workers.check_isolated), before it is kept; one that fails goes back to the LLM with
the gate failures, a bounded number of times.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import anyio

from envscaler.bundle import save_bundle
from envscaler.gate_workers import check_isolated
from envscaler.gates import EnvReport
from envscaler.models import Bundle, CheckItem, EnvSpec, Scenario, ToolCall
from synth import policy
from synth.errors import Rejected
from synth.llm import StageLlm
from synth.models import (
    CheckFuncsAnswer,
    ChecklistAnswer,
    InitialStateAnswer,
    ReferenceAnswer,
    ScenarioRepairAnswer,
    SynthConfig,
    TaskAnswer,
)
from synth.probe import ProbeRequest, probe
from synth.prompts import render
from synth.repair import ask_checked

log = logging.getLogger("synth.scenarios")


async def run_gates(spec: EnvSpec, scenario: Scenario, timeout_s: float) -> EnvReport:
    """The catalog-check gates on a bundle holding just ``scenario``, in a limited child process."""
    with tempfile.TemporaryDirectory(prefix="synth-gates-") as root:
        directory = save_bundle(Bundle(spec=spec, scenarios=[scenario]), root)
        return await anyio.to_thread.run_sync(check_isolated, directory, timeout_s)


def _check_problems(check_funcs: list[str], checklist: list[str]) -> list[str]:
    problems = []
    if len(check_funcs) != len(checklist):
        problems.append(f"write exactly {len(checklist)} check functions, one per checklist item, in order")
    for number, source in enumerate(check_funcs, start=1):
        problems += [f"check {number}: {p}" for p in policy.check_check_function(source)]
    return problems


class ScenGenerator:
    """Generates gated scenarios for one environment with one StageLlm."""

    def __init__(self, llm: StageLlm, config: SynthConfig, spec: EnvSpec, tools: list[dict[str, Any]]) -> None:
        self.llm = llm
        self.config = config
        self.spec = spec
        self.tools = tools
        self.tool_names = {t.get("function", t)["name"] for t in tools}

    async def generate(self, number: int, count: int) -> Scenario:
        """Scenario ``number`` of ``count`` (numbers also name it). Raises Rejected or InvalidAnswer."""
        spec = self.spec
        subject = f"{spec.env_id}#{number}"
        init_config = (await self._initial_state(number, count, subject)).init_config
        task = (await self._plain("task", TaskAnswer, subject, class_name=spec.env_class_name,
                                  introduction=spec.environment_introduction,
                                  tools=self.tools, init_config=init_config)).task
        checklist = (await self._plain("checklist", ChecklistAnswer, subject, task=task,
                                       init_config=init_config)).checklist
        check_funcs = (await ask_checked(
            self.llm, "check_funcs", CheckFuncsAnswer, lambda a: _check_problems(a.check_funcs, checklist),
            subject=subject, max_repairs=self.config.max_repairs, task=task, checklist=checklist,
            init_config=init_config, state_space=spec.state_space_definition,
            allowed_imports=policy.allowed_imports_text(),
        )).check_funcs
        reference = (await ask_checked(
            self.llm, "reference", ReferenceAnswer, self._reference_problems, subject=subject,
            max_repairs=self.config.max_repairs, task=task, tools=self.tools, init_config=init_config,
        )).reference_solution
        scenario = Scenario(
            task_id=f"{spec.env_id}_synth_{number:03d}", env_id=spec.env_id, env_class_name=spec.env_class_name,
            init_config=init_config, task=task,
            checklist_with_func=[CheckItem(check_item=i, check_func=f) for i, f in zip(checklist, check_funcs)],
            reference_solution=reference,
        )
        return await self._gated(scenario, subject)

    async def _plain(self, stage: str, answer: Any, subject: str, **values: Any) -> Any:
        result = await self.llm.ask(stage, answer, render(stage, **values), subject)
        stats = self.llm.stats(stage)
        stats.attempts += 1
        stats.accepted += 1
        return result

    async def _initial_state(self, number: int, count: int, subject: str) -> InitialStateAnswer:
        async def check(answer: InitialStateAnswer) -> list[str]:
            request = ProbeRequest(spec=self.spec, init_configs=[{}, answer.init_config])
            result = await probe(request, self.config.probe_timeout_s)
            if result.class_error:
                raise Rejected("initial_state", f"the environment does not load: {result.class_error}")
            empty, made = result.instances
            if made.error:
                return [made.error]
            # The runtime sets every key as an attribute, so a misspelt key would silently add state.
            known = set(empty.state or {})
            problems = [f"init_config key {key!r} is not a state attribute (known: {', '.join(sorted(known))})"
                        for key in answer.init_config if known and key not in known]
            return problems + [f"the state is not plain JSON ({c})" for c in made.conversions]

        return await ask_checked(
            self.llm, "initial_state", InitialStateAnswer, check, subject=subject,
            max_repairs=self.config.max_repairs, index=number, count=count, class_name=self.spec.env_class_name,
            summary=self.spec.environment_summary, state_space=self.spec.state_space_definition,
            code=self.spec.env_class_code,
        )

    def _reference_problems(self, answer: ReferenceAnswer | ScenarioRepairAnswer) -> list[str]:
        unknown = sorted({c.name for c in answer.reference_solution} - self.tool_names)
        return [f"the reference solution calls unknown tool {n!r}; tools are {sorted(self.tool_names)}" for n in unknown]

    async def _gated(self, scenario: Scenario, subject: str) -> Scenario:
        """Run the gates; on failure repair check functions and reference, at most max_repairs times."""
        stats = self.llm.stats("gates")
        assert scenario.checklist_with_func is not None and scenario.reference_solution is not None
        for round_number in range(self.config.max_repairs + 1):
            report = await run_gates(self.spec, scenario, self.config.probe_timeout_s)
            stats.attempts += 1
            if report.passed:
                stats.accepted += 1
                log.info("scenario accepted", extra={"env_id": self.spec.env_id, "task_id": scenario.task_id,
                                                     "stage": "gates"})
                return scenario
            failures = report.failures()
            log.info("scenario failed gates", extra={"env_id": self.spec.env_id, "task_id": scenario.task_id,
                                                     "stage": "gates", "round": round_number, "failures": failures})
            if round_number == self.config.max_repairs:
                break
            repaired = await self._repair(scenario, failures, subject)
            checklist = [c.check_item for c in scenario.checklist_with_func]
            scenario = scenario.model_copy(update={
                "checklist_with_func": [CheckItem(check_item=i, check_func=f) for i, f in zip(checklist, repaired.check_funcs)],
                "reference_solution": [ToolCall.model_validate(c.model_dump()) for c in repaired.reference_solution],
            })
        raise Rejected("gates", f"{scenario.task_id} still fails after {self.config.max_repairs} repair(s): "
                                + "; ".join(failures[:5]))

    async def _repair(self, scenario: Scenario, failures: list[str], subject: str) -> ScenarioRepairAnswer:
        assert scenario.checklist_with_func is not None and scenario.reference_solution is not None
        checklist = [c.check_item for c in scenario.checklist_with_func]

        def check(answer: ScenarioRepairAnswer) -> list[str]:
            return _check_problems(answer.check_funcs, checklist) + self._reference_problems(answer)

        return await ask_checked(
            self.llm, "scenario_repair", ScenarioRepairAnswer, check, subject=subject,
            max_repairs=self.config.max_repairs, class_name=self.spec.env_class_name, task=scenario.task,
            init_config=scenario.init_config, tools=self.tools, checklist=checklist,
            check_funcs=[c.check_func for c in scenario.checklist_with_func],
            reference_solution=[c.model_dump() for c in scenario.reference_solution], failures=failures,
        )


def write_scenarios(directory: Path, bundle: Bundle) -> None:
    """Write ``bundle`` into ``directory`` itself, whatever the folder is called."""
    with tempfile.TemporaryDirectory(prefix="synth-save-", dir=directory.parent) as root:
        written = save_bundle(bundle, root)
        for child in written.iterdir():
            child.replace(directory / child.name)
