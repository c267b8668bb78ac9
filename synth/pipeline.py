"""Whole runs: seed tasks -> environment bundles, bundles -> gated scenarios, and the run report."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio

from envscaler.bundle import ENV_FILE, load_bundle, save_bundle
from envscaler.errors import EnvScalerError
from envscaler.gate_workers import check_isolated
from envscaler.models import Bundle, EnvSpec, Scenario
from synth.cache import DiskCache
from synth.concurrency import task_group
from synth.errors import InvalidAnswer, Rejected, SynthError
from synth.llm import StageLlm
from synth.models import Rejection, RunReport, SeedTask, StatefulAnswer, SynthConfig, TopicAnswer
from synth.probe import ProbeRequest, probe
from synth.prompts import ENV_STAGES, SCENARIO_STAGES
from synth.scenarios import ScenGenerator, write_scenarios
from synth.skeleton import SkelBuilder, env_id_for

log = logging.getLogger("synth.pipeline")
CATALOG_CHECK_TIMEOUT_S = 300.0


class Synthesis:
    """One run: its LLM client, cache and report."""

    def __init__(self, config: SynthConfig, cache_dir: Path) -> None:
        self.config = config
        self.report = RunReport()
        self.llm = StageLlm(config, DiskCache(cache_dir), self.report)

    def reject(self, subject: str, error: Rejected | InvalidAnswer) -> None:
        """Record a dropped draft in the report and the log."""
        reason = error.reason if isinstance(error, Rejected) else str(error)
        self.report.rejections.append(Rejection(subject=subject, stage=error.stage, reason=reason))
        log.info("dropped", extra={"subject": subject, "stage": error.stage, "reason": reason})

    # ---- environments ----------------------------------------------------------------------

    async def environments(self, seeds: list[SeedTask], out: Path) -> list[Path]:
        """SkelBuilder over ``seeds``; one bundle per accepted environment under ``out``."""
        builder = SkelBuilder(self.llm, self.config)
        triage: list[tuple[StatefulAnswer, TopicAnswer] | None] = [None] * len(seeds)

        async def first_stages(index: int, seed: SeedTask) -> None:
            try:
                stateful = await builder.is_stateful(seed)
                if stateful.stateful:
                    triage[index] = (stateful, await builder.topic(seed))
                else:
                    reason = stateful.reason or "not stateful"
                    self.report.rejections.append(Rejection(subject=seed.task_id, stage="stateful", reason=reason))
            except InvalidAnswer as e:
                self.reject(seed.task_id, e)

        async with task_group() as group:
            for index, seed in enumerate(seeds):
                group.start_soon(first_stages, index, seed)

        kept = self._keep_topics(builder, seeds, triage, out)
        written: list[Path | None] = [None] * len(kept)

        async def build(index: int, seed: SeedTask, topic: TopicAnswer, env_id: str) -> None:
            try:
                spec = await builder.build(seed, topic, env_id)
            except (Rejected, InvalidAnswer) as e:
                self.reject(env_id, e)
                return
            written[index] = save_bundle(Bundle(spec=spec, scenarios=_kept_scenarios(out / env_id, spec)), out)
            self.report.accepted_envs.append(env_id)

        async with task_group() as group:
            for index, (seed, topic, env_id) in enumerate(kept):
                group.start_soon(build, index, seed, topic, env_id)
        return [p for p in written if p is not None]

    def _keep_topics(
        self, builder: SkelBuilder, seeds: list[SeedTask],
        triage: list[tuple[StatefulAnswer, TopicAnswer] | None], out: Path,
    ) -> list[tuple[SeedTask, TopicAnswer, str]]:
        """Score filter and dedup, in seed order so that reruns keep the same environments."""
        stats = self.llm.stats("topic")
        kept: list[tuple[SeedTask, TopicAnswer, str]] = []
        seen: dict[frozenset[str], str] = {}
        for seed, found in zip(seeds, triage):
            if found is None:
                continue
            topic = found[1]
            stats.attempts += 1
            env_id = env_id_for(topic.env_name)
            words = frozenset(env_id.split("_"))
            reason = ""
            if not builder.keeps(topic):
                reason = (f"usefulness {topic.usefulness} / modelability {topic.modelability}: "
                          f"both must be at least {self.config.min_score}")
            elif words in seen:
                reason = f"duplicate of environment {seen[words]!r}"
            else:
                owner = _seed_of(out / env_id)
                if owner is not None and owner != seed.task_id:
                    reason = f"duplicate of existing environment {env_id!r} (from seed {owner})"
            if reason:
                self.report.rejections.append(Rejection(subject=seed.task_id, stage="topic", reason=reason))
                continue
            stats.accepted += 1
            seen[words] = env_id
            kept.append((seed, topic, env_id))
        return kept

    # ---- scenarios -------------------------------------------------------------------------

    async def scenarios(self, directory: Path, count: int, *, total: bool = False) -> bool:
        """ScenGenerator: ``count`` more gated scenarios appended to the bundle in ``directory``.

        With ``total``, only as many as the bundle lacks to hold ``count`` (so a rerun resumes).
        True when every scenario asked for was accepted and the bundle passes the catalog check.
        """
        bundle = load_bundle(directory)
        if total:
            count = max(0, count - len(bundle.scenarios))
        spec = bundle.spec
        tools = spec.tools
        if tools is None:
            result = await probe(ProbeRequest(spec=spec), self.config.probe_timeout_s)
            if result.class_error:
                raise SynthError(f"{directory}: the environment does not load: {result.class_error}")
            tools = [t.openai() for t in result.tools]
        generator = ScenGenerator(self.llm, self.config, spec, tools)
        offset = len(bundle.scenarios)
        made: list[Scenario | None] = [None] * count

        async def one(index: int) -> None:
            number = offset + index + 1
            try:
                made[index] = await generator.generate(number, offset + count)
            except (Rejected, InvalidAnswer) as e:
                self.reject(f"{spec.env_id}#{number}", e)

        async with task_group() as group:
            for index in range(count):
                group.start_soon(one, index)
        accepted = [s for s in made if s is not None]
        bundle.scenarios.extend(accepted)
        write_scenarios(directory, bundle)
        self.report.accepted_scenarios.extend(s.task_id for s in accepted)
        final = await anyio.to_thread.run_sync(check_isolated, directory, CATALOG_CHECK_TIMEOUT_S)
        self.report.catalog_check[spec.env_id] = final.passed
        return final.passed and len(accepted) == count

    # ---- report ----------------------------------------------------------------------------

    def finish(self, path: Path | None) -> RunReport:
        """Totals and ratios, written to ``path`` as JSON when given."""
        report = self.report
        report.env_requests = sum(report.stages[s].requests for s in ENV_STAGES if s in report.stages)
        report.scenario_requests = sum(report.stages[s].requests for s in SCENARIO_STAGES if s in report.stages)
        report.requests_per_env = (round(report.env_requests / len(report.accepted_envs), 2)
                                   if report.accepted_envs else None)
        report.requests_per_scenario = (round(report.scenario_requests / len(report.accepted_scenarios), 2)
                                        if report.accepted_scenarios else None)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")
        return report


def _seed_of(directory: Path) -> str | None:
    """The seed task an existing synthesized bundle came from (None when there is no such bundle)."""
    if not (directory / ENV_FILE).is_file():
        return None
    try:
        spec = load_bundle(directory).spec
    except EnvScalerError:
        return None
    synth = getattr(spec, "synth", None)
    return synth.get("seed_task") if isinstance(synth, dict) else ""


def _kept_scenarios(directory: Path, spec: EnvSpec) -> list[Scenario]:
    """Scenarios already on disk for this exact class code (a rerun keeps them); none otherwise."""
    if not (directory / ENV_FILE).is_file():
        return []
    existing = load_bundle(directory)
    return existing.scenarios if existing.spec.env_class_code == spec.env_class_code else []


@asynccontextmanager
async def synthesis(config: SynthConfig, cache_dir: Path, report_path: Path | None) -> AsyncIterator[Synthesis]:
    """A run whose report is written however it ends (finished, dropped drafts, or LLM outage)."""
    run = Synthesis(config, cache_dir)
    try:
        yield run
    finally:
        run.finish(report_path)
        await run.llm.aclose()
