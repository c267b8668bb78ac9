"""SkelBuilder: seed task -> stateful? -> topic -> state -> skeleton -> operations -> methods ->
assembled class -> tool schemas -> dual-agent check -> bundle.

Every stage is an LLM request with a pydantic answer; code answers pass the policy check and then
run, only in the probe child, before anything downstream sees them. Failures go back to the stage
that made them (synth.repair), a bounded number of times.
"""

from __future__ import annotations

import ast
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from envscaler.models import EnvSpec, ToolCall, ToolSchema
from synth import policy
from synth.assemble import assemble_class, function_source
from synth.concurrency import task_group
from synth.errors import Rejected
from synth.llm import StageLlm
from synth.models import (
    CodeAnswer,
    JudgeAnswer,
    JudgeVerdict,
    Operation,
    OperationsAnswer,
    SeedTask,
    SkeletonAnswer,
    StateAnswer,
    StatefulAnswer,
    SynthConfig,
    TesterAnswer,
    TopicAnswer,
)
from synth.probe import ProbeCase, ProbeRequest, ProbeResult, probe
from synth.prompts import render
from synth.repair import ask_checked

log = logging.getLogger("synth.skeleton")


def env_id_for(name: str) -> str:
    """``ClinicAppointmentSystem`` or ``clinic appointment system`` -> ``clinic_appointment_system``."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name)
    return "_".join(re.findall(r"[a-z0-9]+", spaced.lower()))


def apis_text(seed: SeedTask) -> Any:
    """The seed's APIs as prompt material (they hint at the operations; many seeds have none)."""
    return seed.apis or "(none listed)"


@dataclass
class EnvDraft:
    """Everything decided so far about one environment."""

    seed: SeedTask
    topic: TopicAnswer
    env_id: str
    state: StateAnswer | None = None
    skeleton: SkeletonAnswer | None = None
    operations: list[Operation] = field(default_factory=list)
    methods: dict[str, str] = field(default_factory=dict)
    code: str = ""
    tools: list[ToolSchema] = field(default_factory=list)
    judge_score: float | None = None

    def spec(self) -> EnvSpec:
        """The finished draft as an EnvScaler env metadata item, with its provenance under ``synth``."""
        assert self.state is not None and self.skeleton is not None
        return EnvSpec(
            env_id=self.env_id,
            env_class_name=self.skeleton.class_name,
            env_class_code=self.code,
            environment_summary=self.topic.summary,
            environment_introduction=self.topic.introduction or self.topic.summary,
            constraints_rules=self.state.rules,
            state_space_definition={
                "entities": [e.model_dump() for e in self.state.entities],
                "state_attributes": self.state.state_attributes,
            },
            tools=[t.openai() for t in self.tools] if self.tools else None,
            synth={
                "seed_task": self.seed.task_id,
                "seed_source": self.seed.source,
                "usefulness": self.topic.usefulness,
                "modelability": self.topic.modelability,
                "judge_score": self.judge_score,
            },
        )


class SkelBuilder:
    """Builds environments from seed tasks with one StageLlm."""

    def __init__(self, llm: StageLlm, config: SynthConfig) -> None:
        self.llm = llm
        self.config = config

    # ---- stages 1 and 2 --------------------------------------------------------------------

    async def is_stateful(self, seed: SeedTask) -> StatefulAnswer:
        """Stage 1: does the task need a state?"""
        messages = render("stateful", source=seed.source, task=seed.task, apis=apis_text(seed))
        answer = await self.llm.ask("stateful", StatefulAnswer, messages, seed.task_id)
        self._count("stateful", answer.stateful)
        return answer

    async def topic(self, seed: SeedTask) -> TopicAnswer:
        """Stage 2: the environment's topic and its scores (filtering and dedup are the caller's)."""
        messages = render("topic", task=seed.task, apis=apis_text(seed))
        return await self.llm.ask("topic", TopicAnswer, messages, seed.task_id)

    def keeps(self, topic: TopicAnswer) -> bool:
        """Whether both scores reach the configured minimum."""
        return min(topic.usefulness, topic.modelability) >= self.config.min_score

    def _count(self, stage: str, accepted: bool) -> None:
        stats = self.llm.stats(stage)
        stats.attempts += 1
        stats.accepted += int(accepted)

    # ---- stages 3 to 9 ---------------------------------------------------------------------

    async def build(self, seed: SeedTask, topic: TopicAnswer, env_id: str) -> EnvSpec:
        """Stages 3-9 for one kept topic. Raises Rejected or InvalidAnswer when the env is dropped."""
        draft = EnvDraft(seed=seed, topic=topic, env_id=env_id)
        draft.state = await self.llm.ask(
            "state", StateAnswer,
            render("state", env_name=topic.env_name, summary=topic.summary, task=seed.task), env_id,
        )
        self._count("state", True)
        draft.skeleton = await self._skeleton(draft)
        draft.operations = (await self._operations(draft)).operations
        async with task_group() as group:
            for operation in draft.operations:
                group.start_soon(self._write_method, draft, operation, [], None)
        await self._assemble(draft)
        await self._dual_agent_check(draft)
        log.info("environment accepted", extra={"env_id": env_id, "stage": "judge", "score": draft.judge_score})
        return draft.spec()

    async def _probe(self, draft: EnvDraft, code: str, **request: Any) -> ProbeResult:
        assert draft.skeleton is not None
        spec = EnvSpec(env_id=draft.env_id, env_class_name=draft.skeleton.class_name, env_class_code=code)
        return await probe(ProbeRequest(spec=spec, **request), self.config.probe_timeout_s)

    async def _skeleton(self, draft: EnvDraft) -> SkeletonAnswer:
        assert draft.state is not None

        async def check(answer: SkeletonAnswer) -> list[str]:
            problems = policy.check_class(answer.code, answer.class_name)
            if problems:
                return problems
            spec = EnvSpec(env_id=draft.env_id, env_class_name=answer.class_name, env_class_code=answer.code)
            result = await probe(ProbeRequest(spec=spec, init_configs=[{}]), self.config.probe_timeout_s)
            if result.class_error:
                return [result.class_error]
            made = result.instances[0]
            if made.error:
                return [f"__init__ with an empty init_config fails: {made.error}"]
            missing = sorted(set(draft.state.state_attributes) - set(made.state or {}))
            problems = [f"__init__ does not create state attribute {name!r}" for name in missing]
            problems += [f"the state is not plain JSON ({c}): use dicts, lists, str, int, float, bool, None"
                         for c in made.conversions]
            return problems

        return await ask_checked(
            self.llm, "skeleton", SkeletonAnswer, check, subject=draft.env_id, max_repairs=self.config.max_repairs,
            env_name=draft.topic.env_name, summary=draft.topic.summary,
            entities=[e.model_dump() for e in draft.state.entities], state_attributes=draft.state.state_attributes,
            rules=draft.state.rules, allowed_imports=policy.allowed_imports_text(),
        )

    async def _operations(self, draft: EnvDraft) -> OperationsAnswer:
        assert draft.state is not None and draft.skeleton is not None
        taken = set(draft.state.state_attributes)

        def check(answer: OperationsAnswer) -> list[str]:
            return [f"operation {op.name!r} clashes with the state attribute of the same name"
                    for op in answer.operations if op.name in taken]

        return await ask_checked(
            self.llm, "operations", OperationsAnswer, check, subject=draft.env_id,
            max_repairs=self.config.max_repairs, env_name=draft.topic.env_name, summary=draft.topic.summary,
            skeleton=draft.skeleton.code, rules=draft.state.rules, task=draft.seed.task,
        )

    async def _write_method(self, draft: EnvDraft, operation: Operation, feedback: list[str], previous: Any) -> None:
        assert draft.state is not None and draft.skeleton is not None
        planned = [p.name for p in operation.parameters]

        def check(answer: CodeAnswer) -> list[str]:
            problems = policy.check_method(answer.code, operation.name)
            if problems:
                return problems
            source = function_source(answer.code, operation.name) or ""
            written = _parameter_names(source)
            if sorted(written) != sorted(planned):
                problems.append(f"{operation.name} must take exactly the planned parameters {planned}, not {written}")
            return problems

        answer = await ask_checked(
            self.llm, "method", CodeAnswer, check, subject=f"{draft.env_id}.{operation.name}",
            max_repairs=self.config.max_repairs, feedback=feedback, previous=previous,
            class_name=draft.skeleton.class_name, skeleton=draft.skeleton.code, rules=draft.state.rules,
            operation=operation.model_dump(), name=operation.name, allowed_imports=policy.allowed_imports_text(),
        )
        draft.methods[operation.name] = answer.code

    async def _assemble(self, draft: EnvDraft) -> None:
        assert draft.skeleton is not None
        stats = self.llm.stats("assemble")
        stats.attempts += 1
        code = assemble_class(draft.skeleton.code, draft.skeleton.class_name,
                              [draft.methods[op.name] for op in draft.operations])
        problems = policy.check_class(code, draft.skeleton.class_name)
        if problems:
            raise Rejected("assemble", "; ".join(problems))
        result = await self._probe(draft, code)
        if result.class_error:
            raise Rejected("assemble", result.class_error)
        names = {t.name for t in result.tools}
        missing = [op.name for op in draft.operations if op.name not in names]
        if missing:
            raise Rejected("assemble", f"the assembled class lacks tools {missing}")
        planned = {op.name for op in draft.operations}
        draft.code = code
        # Only planned operations become tools: helpers the methods share stay out of the agent's reach.
        draft.tools = [t for t in result.tools if t.name in planned]
        stats.accepted += 1

    # ---- stage 9: dual-agent check ---------------------------------------------------------

    async def _tester(self, draft: EnvDraft, feedback: list[str], previous: Any) -> TesterAnswer:
        assert draft.skeleton is not None
        names = {t.name for t in draft.tools}

        def check(answer: TesterAnswer) -> list[str]:
            used = {c.tool for c in answer.cases}
            problems = [f"case uses unknown tool {name!r}" for name in sorted(used - names)]
            problems += [f"no case covers tool {name!r}" for name in sorted(names - used)]
            return problems

        return await ask_checked(
            self.llm, "tester", TesterAnswer, check, subject=draft.env_id, max_repairs=self.config.max_repairs,
            feedback=feedback, previous=previous, class_name=draft.skeleton.class_name,
            skeleton=draft.skeleton.code, tools=[t.openai() for t in draft.tools],
        )

    async def _dual_agent_check(self, draft: EnvDraft) -> None:
        """Tester calls tools, the judge grades each call; failing methods are repaired, bounded."""
        assert draft.skeleton is not None and draft.state is not None
        tester = await self._tester(draft, [], None)
        judge_stats = self.llm.stats("judge")
        for round_number in range(self.config.max_repairs + 1):
            cases = [
                ProbeCase(init_config=tester.initial_states[c.state], calls=[ToolCall(name=c.tool, arguments=c.arguments)])
                for c in tester.cases
            ]
            result = await self._probe(draft, draft.code, cases=cases)
            if result.class_error:
                raise Rejected("judge", f"the class stopped loading: {result.class_error}")
            shown, forced = self._judge_cases(draft, tester, result)
            judged = await self._judge(draft, shown)
            verdicts = {v.case: v for v in judged.verdicts}
            verdicts.update(forced)
            good = sum(v.verdict in ("pass", "warning") for v in verdicts.values())
            draft.judge_score = round(good / len(tester.cases), 4)
            judge_stats.attempts += 1
            if draft.judge_score >= self.config.judge_threshold:
                judge_stats.accepted += 1
                return
            failing = [i for i, v in sorted(verdicts.items()) if v.verdict == "fail"]
            failed = [(tester.cases[i], verdicts[i]) for i in failing]
            failed_runs = [result.runs[i] for i in failing]
            log.info("dual-agent check below threshold", extra={
                "env_id": draft.env_id, "stage": "judge", "score": draft.judge_score, "round": round_number})
            if round_number == self.config.max_repairs:
                reasons = "; ".join(f"{c.tool}: {v.reason}" for c, v in failed[:5])
                raise Rejected("judge", f"dual-agent score {draft.judge_score:.2f} < {self.config.judge_threshold} "
                                        f"after {self.config.max_repairs} repair(s): {reasons}")
            # Calls on a state that did not instantiate say nothing about the method: the tester redoes them.
            await self._repair_after_judge(draft, [(c, v) for (c, v), run in zip(failed, failed_runs) if not run.error])
            problems = sorted({run.error for run in failed_runs if run.error})
            if problems:
                tester = await self._tester(draft, [f"an initial state does not instantiate: {p}" for p in problems],
                                            tester.model_dump(mode="json"))

    def _judge_cases(
        self, draft: EnvDraft, tester: TesterAnswer, result: ProbeResult
    ) -> tuple[list[dict[str, Any]], dict[int, JudgeVerdict]]:
        """What the judge sees per case, and the verdicts no judge may overrule (crashes)."""
        shown: list[dict[str, Any]] = []
        forced: dict[int, JudgeVerdict] = {}
        for number, (case, run) in enumerate(zip(tester.cases, result.runs)):
            item: dict[str, Any] = {
                "case": number, "tool": case.tool, "kind": case.kind, "intent": case.intent,
                "arguments": case.arguments, "method_source": function_source(draft.code, case.tool) or "",
            }
            if run.error:
                item["error"] = run.error
                forced[number] = JudgeVerdict(case=number, verdict="fail", reason=run.error)
            else:
                outcome = run.outcomes[0]
                item["returned"] = outcome.result
                item["error"] = outcome.error
                item["state_diff"] = [c.model_dump(mode="json") for c in outcome.diff or []]
                if outcome.error_kind in ("env", "timeout"):
                    forced[number] = JudgeVerdict(case=number, verdict="fail", reason=outcome.error or "")
                for note in run.conversions:
                    forced[number] = JudgeVerdict(case=number, verdict="fail", reason=f"state is not plain JSON: {note}")
            shown.append(item)
        return shown, forced

    async def _judge(self, draft: EnvDraft, shown: list[dict[str, Any]]) -> JudgeAnswer:
        assert draft.skeleton is not None and draft.state is not None
        expected = set(range(len(shown)))

        def check(answer: JudgeAnswer) -> list[str]:
            given = {v.case for v in answer.verdicts}
            return [f"give exactly one verdict per case; missing {sorted(expected - given)}, "
                    f"unknown {sorted(given - expected)}"] if given != expected else []

        # The judge's own repair rounds only fix the shape of its answer; they are not acceptance.
        stats = self.llm.stats("judge")
        before = stats.attempts, stats.accepted
        answer = await ask_checked(
            self.llm, "judge", JudgeAnswer, check, subject=draft.env_id, max_repairs=self.config.max_repairs,
            class_name=draft.skeleton.class_name, rules=draft.state.rules, cases=shown,
        )
        stats.attempts, stats.accepted = before
        return answer

    async def _repair_after_judge(self, draft: EnvDraft, failed: list[tuple[Any, JudgeVerdict]]) -> None:
        """Rewrite each method with failing cases, given the judge's reasons, then reassemble."""
        feedback: dict[str, list[str]] = {}
        for case, verdict in failed:
            if case.tool in draft.methods:
                feedback.setdefault(case.tool, []).append(
                    f"{case.kind} case {case.intent or ''} with arguments {case.arguments}: {verdict.reason}")
        if not feedback:
            return
        by_name = {op.name: op for op in draft.operations}
        async with task_group() as group:
            for name, problems in feedback.items():
                group.start_soon(self._write_method, draft, by_name[name], problems, {"code": draft.methods[name]})
        await self._assemble(draft)


def _parameter_names(source: str) -> list[str]:
    function = ast.parse(source).body[0]
    assert isinstance(function, ast.FunctionDef)
    arguments = function.args
    return [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]][1:]
