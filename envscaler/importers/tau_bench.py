"""Import tau-bench from the user's own checkout: one bundle per domain.

A domain is ``tau_bench/envs/<domain>/``: ``tools/`` (one ``Tool`` class per file, listed in
``ALL_TOOLS``, each with ``invoke(data, ...)`` and ``get_info()``), ``data/`` (JSON files read by its
loader), ``tasks_<split>.py`` (``Task(user_id, instruction, actions, outputs)``), ``wiki.md`` and
``rules.py``. The checkout is read as text and parsed with ``ast``: none of its code runs in this
process. The bundle holds:

- an environment class generated around the domain's tool classes (their code as written): one
  method per tool, handing the data to ``invoke`` as tau-bench does. The data's top-level keys are
  the state; each is loaded from a data file copied once into the bundle (``{"$file": ...}``).
- the wiki as the environment's introduction, the rules as its constraints;
- each task as a conversational scenario: the instruction is the simulated user's task and profile,
  the gold actions are the reference solution, the expected outputs (joined) the reference reply;
- tau-bench's reward as checks: the final data equals the data after the gold actions (the digest
  of what they change, computed by running them in a sandboxed child: ``envscaler.importers.gold``), and each
  expected output appears in what the agent said to the user.

What the format cannot hold goes into the report's ``left_out`` with the reason.
"""

from __future__ import annotations

import ast
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from envscaler.annotations import state_function_annotations
from envscaler.bundle import save_bundle
from envscaler.errors import BundleError
from envscaler.importers.envscaler_release import ImportReport, LeftOut
from envscaler.importers.gold import CHANGES_CODE, NO_CHANGE, GoldRun, run_gold
from envscaler.models import Bundle, CheckItem, EnvSpec, Scenario, ToolAnnotations, ToolCall, ToolErrorPolicy

# tau-bench's tools answer "Error: ..." for what the caller got wrong; its environment also turns any
# exception into such an answer. Of the exceptions, the ones its tools raise on bad ids and values are
# the agent's; any other is reported as the environment's error.
TAU_TOOL_ERRORS = ToolErrorPolicy(success_false=False, text_prefixes=["Error:"], agent_errors=["KeyError", "ValueError"])
RESPOND_ACTION = "respond"
DEFAULT_SPLITS = ("test",)


class TauTool(BaseModel):
    """One tool of a domain: its class, its OpenAI function (``get_info()``), the method that serves it."""

    class_name: str
    name: str
    function: dict[str, Any]
    method: str
    hints: ToolAnnotations


class TauTask(BaseModel):
    """One task of a split, as written in ``tasks_<split>.py``."""

    task_id: str
    user_id: str | None = None
    instruction: str
    actions: list[ToolCall]
    outputs: list[str] = Field(default_factory=list)


class TauDomain(BaseModel):
    """Everything read from one domain's folder."""

    name: str
    wiki: str
    rules: list[str] = Field(default_factory=list)
    data_files: dict[str, Path]
    code: str
    tools: list[TauTool]
    tasks: list[TauTask]
    left_out: list[LeftOut] = Field(default_factory=list)

    @property
    def env_id(self) -> str:
        return f"tau_{self.name}"

    @property
    def class_name(self) -> str:
        return "Tau" + "".join(part.capitalize() for part in self.name.split("_")) + "Env"


def find_domains(checkout: Path) -> dict[str, Path]:
    """Domain name -> folder, for a checkout's root, its ``tau_bench/`` or its ``tau_bench/envs/``."""
    for envs in (checkout / "tau_bench" / "envs", checkout / "envs", checkout):
        if envs.is_dir():
            found = {d.name: d for d in sorted(envs.iterdir()) if (d / "tools" / "__init__.py").is_file() and (d / "data").is_dir()}
            if found:
                return found
    raise BundleError(f"{checkout}: no tau-bench domain found (expected tau_bench/envs/<domain>/ with tools/__init__.py "
                      "and data/: give the root of a tau-bench checkout)")


def import_tau_bench(checkout: Path, out: Path, *, domains: list[str] | None = None,
                     splits: tuple[str, ...] | list[str] = DEFAULT_SPLITS, timeout_s: float = 600.0) -> ImportReport:
    """Write one bundle per domain of the checkout under ``out``; what cannot be expressed goes to ``left_out``.

    ``timeout_s`` bounds the sandboxed run of each domain's gold actions.
    """
    found = find_domains(checkout)
    unknown = sorted(set(domains or []) - set(found))
    if unknown:
        raise BundleError(f"{checkout}: no domain {', '.join(map(repr, unknown))} (domains: {', '.join(found)})")
    report = ImportReport()
    for name in domains or list(found):
        domain = read_domain(found[name], splits)
        report.left_out += domain.left_out
        if not domain.tasks:
            report.left_out.append(LeftOut(item=name, reason=f"no task could be read for split(s) {', '.join(splits)}"))
            continue
        directory = write_domain(domain, out, timeout_s, report)
        report.environments += 1
        report.written.append(str(directory))
    return report


def read_domain(directory: Path, splits: tuple[str, ...] | list[str] = DEFAULT_SPLITS) -> TauDomain:
    """Read one domain folder (as text: nothing of it runs)."""
    name = directory.name
    left_out: list[LeftOut] = []
    code, tools = _read_tools(directory, left_out)
    known = {tool.name for tool in tools}
    tasks: list[TauTask] = []
    for split in splits:
        path = directory / f"tasks_{split}.py"
        if not path.is_file():
            left_out.append(LeftOut(item=f"{name}/{split}", reason=f"the domain has no {path.name}"))
            continue
        tasks += _read_tasks(path, split, known, f"{name}/", left_out)
    wiki_path = directory / "wiki.md"
    wiki = wiki_path.read_text(encoding="utf-8") if wiki_path.is_file() else _module_string(directory / "wiki.py", "WIKI")
    if not wiki:
        left_out.append(LeftOut(item=f"{name}/wiki", reason="no wiki.md, and wiki.py defines no WIKI string literal"))
    rules = _module_literal(directory / "rules.py", "RULES")
    return TauDomain(name=name, wiki=wiki or "", rules=rules if isinstance(rules, list) else [], data_files=_data_files(directory),
                     code=code, tools=tools, tasks=tasks, left_out=left_out)


def write_domain(domain: TauDomain, out: Path, timeout_s: float, report: ImportReport) -> Path:
    """Write the domain's bundle: its data files once, the gold actions run for their final data, the scenarios with checks.

    The gold actions run on a staging copy of the bundle, so that a failed run leaves nothing half-written under ``out``.
    """
    spec = domain_spec(domain)
    init_config = {key: {"$file": f"data/{key}.json"} for key in domain.data_files}
    gold_only = [Scenario(task_id=t.task_id, env_id=spec.env_id, init_config=init_config, reference_solution=t.actions)
                 for t in domain.tasks]
    with tempfile.TemporaryDirectory(prefix="envscaler-tau-") as staging:
        runs = run_gold(_with_data(save_bundle(Bundle(spec=spec, scenarios=gold_only), staging), domain), timeout_s)
    scenarios = []
    for task in domain.tasks:
        run = runs.get(task.task_id) or GoldRun(task_id=task.task_id, error="the gold run reported nothing for it")
        problem = _gold_problem(task, run)
        if problem is not None:
            report.left_out.append(LeftOut(item=f"{domain.name}/{task.task_id}", reason=problem))
            continue
        assert run.digest is not None
        report.left_out += _dropped(domain.name, task, run)
        scenarios.append(_scenario(spec.env_id, init_config, task.model_copy(update={"actions": _replayed(task, run)}), run.digest))
    directory = _with_data(save_bundle(Bundle(spec=spec, scenarios=scenarios), out), domain)
    report.scenarios += len(scenarios)
    return directory


def _with_data(directory: Path, domain: TauDomain) -> Path:
    """Copy the domain's data files into the bundle at ``directory`` (once: every scenario names them)."""
    (directory / "data").mkdir(exist_ok=True)
    for key, source in domain.data_files.items():
        shutil.copyfile(source, directory / "data" / f"{key}.json")
    return directory


def domain_spec(domain: TauDomain) -> EnvSpec:
    """The environment: the generated class, the tools' own schemas, the wiki and the rules."""
    return EnvSpec(
        env_id=domain.env_id,
        env_class_name=domain.class_name,
        env_class_code=_class_code(domain),
        environment_summary=f"tau-bench's {domain.name} domain (a customer-service agent with a simulated user)",
        environment_introduction=domain.wiki,
        constraints_rules=domain.rules or None,
        tools=[{"type": "function", "function": tool.function} for tool in domain.tools],
        tool_errors=TAU_TOOL_ERRORS,
        tool_annotations={tool.name: tool.hints for tool in domain.tools},
    )


# -- reading the checkout ---------------------------------------------------------------------------


def _parse(path: Path) -> ast.Module:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, ValueError) as e:
        raise BundleError(f"{path}: cannot read it as Python: {e}") from None


def _module_value(path: Path, name: str) -> ast.expr | None:
    """The expression a module assigns to ``name`` at its top level, or None."""
    if not path.is_file():
        return None
    for node in _parse(path).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            return node.value
    return None


def _module_literal(path: Path, name: str) -> Any:
    value = _module_value(path, name)
    try:
        return ast.literal_eval(value) if value is not None else None
    except ValueError:
        return None


def _module_string(path: Path, name: str) -> str | None:
    value = _module_literal(path, name)
    return value if isinstance(value, str) else None


def _data_files(directory: Path) -> dict[str, Path]:
    """The data's top-level key -> its JSON file: the files the loader names, keyed by their stem (as tau-bench's loaders do)."""
    data = directory / "data"
    loader = data / "__init__.py"
    named = {node.value for node in ast.walk(_parse(loader)) if isinstance(node, ast.Constant)
             and isinstance(node.value, str) and node.value.endswith(".json")} if loader.is_file() else set()
    files = [data / n for n in sorted(named)] if named else sorted(data.glob("*.json"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise BundleError(f"{loader}: names data files that are not there: {', '.join(missing)} (is the checkout complete? "
                          "tau-bench keeps its data in the repository)")
    if not files:
        raise BundleError(f"{data}: no JSON data files")
    return {f.stem: f for f in files}


def _read_tools(directory: Path, left_out: list[LeftOut]) -> tuple[str, list[TauTool]]:
    """The tool modules' code (tau-bench's own imports dropped) and each tool of ``ALL_TOOLS``."""
    tools_dir = directory / "tools"
    index = _parse(tools_dir / "__init__.py")
    modules = {alias.asname or alias.name: node.module.rsplit(".", 1)[-1] for node in index.body
               if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
    listed = _module_value(tools_dir / "__init__.py", "ALL_TOOLS")
    if not isinstance(listed, ast.List) or not all(isinstance(e, ast.Name) for e in listed.elts):
        raise BundleError(f"{tools_dir / '__init__.py'}: expected ALL_TOOLS = [ToolClass, ...]")
    imports: dict[str, None] = {}
    imported: list[ast.Import | ast.ImportFrom] = []
    bodies: list[str] = []
    tools: list[TauTool] = []
    for element in listed.elts:
        assert isinstance(element, ast.Name)
        class_name = element.id
        path = tools_dir / f"{modules.get(class_name, '')}.py"
        if class_name not in modules or not path.is_file():
            left_out.append(LeftOut(item=f"{directory.name}/tool {class_name}", reason="ALL_TOOLS names it, but no module of tools/ is imported for it"))
            continue
        source = path.read_text(encoding="utf-8")
        module = _parse(path)
        tool, problem = _tool(class_name, module, source)
        if tool is None:
            left_out.append(LeftOut(item=f"{directory.name}/tool {class_name}", reason=f"{path.name}: {problem}"))
            continue
        tools.append(tool)
        for node in module.body:
            segment = ast.get_source_segment(source, node) or ast.unparse(node)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if not _is_tau_import(node):
                    imports[segment] = None
                else:
                    imported.append(node)
            elif not _is_docstring(node):
                bodies.append(segment)
    missing = sorted(_tau_names(imported) - {"Tool"} - _defined(bodies))
    if missing:
        left_out.append(LeftOut(item=f"{directory.name}/tools", reason=f"the tools import {', '.join(missing)} from tau_bench, "
                                "which the generated code does not define: the environment will not load"))
    return "\n\n\n".join(["\n".join(imports), _TOOL_BASE, *bodies]), tools


_TOOL_BASE = '''class Tool:
    """Stands for tau-bench's ``Tool`` base: a tool is a class with ``invoke(data, ...)`` and ``get_info()``."""'''


def _tau_names(imports: list[ast.Import | ast.ImportFrom]) -> set[str]:
    return {alias.asname or alias.name.split(".")[0] for node in imports for alias in node.names}


def _defined(bodies: list[str]) -> set[str]:
    """The names the tool modules' code defines at its top level."""
    names: set[str] = set()
    for body in bodies:
        for node in ast.parse(body).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _is_tau_import(node: ast.Import | ast.ImportFrom) -> bool:
    """An import of tau-bench's own package (its ``Tool`` base) or a relative one: the generated code defines what they give."""
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "tau_bench"
    return any(alias.name.split(".")[0] == "tau_bench" for alias in node.names)


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _tool(class_name: str, module: ast.Module, source: str) -> tuple[TauTool | None, str]:
    """The tool of class ``class_name`` in its module, or None and why it cannot be served."""
    klass = next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if klass is None:
        return None, f"no class {class_name}"
    methods = {n.name: n for n in klass.body if isinstance(n, ast.FunctionDef)}
    invoke, get_info = methods.get("invoke"), methods.get("get_info")
    if invoke is None or get_info is None:
        return None, "the class has no invoke() or no get_info()"
    returned = [n.value for n in ast.walk(get_info) if isinstance(n, ast.Return) and n.value is not None]
    try:
        info = ast.literal_eval(returned[0]) if len(returned) == 1 else None
    except ValueError:
        info = None
    function = info.get("function") if isinstance(info, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None, "get_info() does not return one literal {'type': 'function', 'function': {'name': ...}}"
    arguments = invoke.args
    if arguments.vararg or arguments.kwarg or arguments.posonlyargs or not arguments.args:
        return None, "invoke() must take the data and then named parameters (no *args, **kwargs or positional-only ones)"
    name = function["name"]
    if not name.isidentifier() or name.startswith("_"):
        return None, f"the tool name {name!r} cannot be a public method name"
    parameters = [a.arg for a in arguments.args[1:] + arguments.kwonlyargs]
    signature = ast.arguments(posonlyargs=[], args=[ast.arg(arg="self"), *arguments.args[1:]], vararg=None,
                              kwonlyargs=arguments.kwonlyargs, kw_defaults=arguments.kw_defaults, kwarg=None,
                              defaults=arguments.defaults)
    returns = f" -> {ast.get_source_segment(source, invoke.returns)}" if invoke.returns is not None else ""
    handed = ", ".join(f"{p!r}: {p}" for p in parameters)
    description = str(function.get("description", "")).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    method = (f"    def {name}({ast.unparse(signature)}){returns}:\n"
              f'        """{description}"""\n'
              f"        return self._invoke({class_name}, {{{handed}}})\n")
    return TauTool(class_name=class_name, name=name, function=function, method=method,
                   hints=state_function_annotations(invoke, name)), ""


def _read_tasks(path: Path, split: str, tools: set[str], prefix: str, left_out: list[LeftOut]) -> list[TauTask]:
    """The tasks of one ``tasks_<split>.py``: its top-level list of ``Task(...)`` calls (or dicts), read as literals."""
    listed = next((node.value for node in _parse(path).body if isinstance(node, (ast.Assign, ast.AnnAssign))
                   and isinstance(node.value, ast.List)), None)
    if listed is None:
        left_out.append(LeftOut(item=f"{prefix}{split}", reason=f"{path.name} assigns no list of tasks"))
        return []
    tasks = []
    for index, node in enumerate(listed.elts):
        task_id = f"{split}_{index}"
        try:
            fields = _fields(node)
            # Task(...) keeps Action(...) calls as nodes; a dict literal's actions are dicts already.
            actions = [a if isinstance(a, dict) else _fields(a) for a in fields.get("actions", [])]
        except ValueError as e:
            left_out.append(LeftOut(item=f"{prefix}{task_id}", reason=f"cannot be read without running the file: {e}"))
            continue
        calls = []
        for number, action in enumerate(actions, start=1):
            name, arguments = action.get("name"), action.get("kwargs", action.get("arguments", {}))
            if name == RESPOND_ACTION:
                left_out.append(LeftOut(item=f"{prefix}{task_id} action {number}",
                                        reason="a gold reply to the user, not a tool call: the outputs check covers replies"))
                continue
            calls.append({"name": name, "arguments": arguments})
        unknown = sorted({str(c["name"]) for c in calls if c["name"] not in tools})
        outputs = fields.get("outputs") or []
        if unknown:
            left_out.append(LeftOut(item=f"{prefix}{task_id}", reason=f"its gold actions call {', '.join(unknown)}, which no imported tool serves"))
        elif not isinstance(fields.get("instruction"), str) or not all(isinstance(o, str) for o in outputs):
            left_out.append(LeftOut(item=f"{prefix}{task_id}", reason="no instruction text, or outputs that are not strings"))
        else:
            tasks.append(TauTask(task_id=task_id, user_id=fields.get("user_id"), instruction=fields["instruction"],
                                 actions=[ToolCall.model_validate(c) for c in calls], outputs=outputs))
    return tasks


def _fields(node: ast.expr) -> dict[str, Any]:
    """A ``Task(...)``/``Action(...)`` call's keywords, or a dict literal's items, as literal values (ValueError if not literal)."""
    try:
        if isinstance(node, ast.Call) and not node.args:
            return {kw.arg: _literal_or_list(kw.value) for kw in node.keywords if kw.arg is not None}
        if isinstance(node, ast.Dict):
            value = ast.literal_eval(node)
            if isinstance(value, dict):
                return value
    except ValueError:
        pass
    raise ValueError(f"line {getattr(node, 'lineno', '?')}: {ast.unparse(node)[:80]} is computed, not written as literals")


def _literal_or_list(node: ast.expr) -> Any:
    """A literal, or a list whose items are calls (``actions=[Action(...), ...]``), kept as nodes for ``_fields``."""
    if isinstance(node, ast.List) and any(isinstance(e, ast.Call) for e in node.elts):
        return node.elts
    return ast.literal_eval(node)


# -- writing the bundle -----------------------------------------------------------------------------


def _class_code(domain: TauDomain) -> str:
    keys = tuple(domain.data_files)
    methods = "\n".join(tool.method for tool in domain.tools)
    return f'''"""tau-bench's {domain.name} domain: its tool classes as the checkout has them, served as methods by {domain.class_name}.

Generated by `envscaler import tau-bench`; the tools' code is the benchmark's own.
"""

{domain.code}


_DATA_KEYS = {keys!r}


class {domain.class_name}:
    """The domain's data as attributes (one per top-level key); each tool hands them to its ``invoke`` as tau-bench does."""

    def _invoke(self, tool, arguments):
        data = {{key: getattr(self, key) for key in _DATA_KEYS}}
        try:
            return tool.invoke(data, **arguments)
        finally:
            # A tool that replaces a whole collection replaces the attribute.
            for key, value in data.items():
                if value is not getattr(self, key, None):
                    setattr(self, key, value)

{methods}'''


def _gold_problem(task: TauTask, run: GoldRun) -> str | None:
    """Why the task cannot become a scenario that passes the gates, given its gold run; None when it can."""
    if run.error is not None or run.digest is None:
        return f"its gold actions could not run: {run.error}"
    for number, call in enumerate(run.calls, start=1):
        if call.env_fault:
            return f"gold action {number} ({call.name}) fails in the tool's own code ({call.error})"
        if call.error is not None and call.changed:
            return (f"gold action {number} ({call.name}) changes the data, then fails ({call.error}): the reference "
                    "solution cannot be replayed")
    if run.digest == NO_CHANGE and not task.outputs:
        return ("its gold actions change no data and it expects no output: doing nothing scores 1.0, and a scenario that "
                "doing nothing solves cannot score an agent (the gates refuse it)")
    if not _replayed(task, run):
        return "it has no gold action that succeeds: the reference solution would be empty"
    return None


def _replayed(task: TauTask, run: GoldRun) -> list[ToolCall]:
    """The gold actions the reference solution keeps: all but the writes that fail and change nothing.

    Such a write does nothing in tau-bench either (the data check is the same without it), but a
    reference call of a tool that changes the state must succeed (the ``reference_runs`` gate).
    """
    return [action for action, call in zip(task.actions, run.calls, strict=True)
            if call.error is None or call.read_only]


def _dropped(domain: str, task: TauTask, run: GoldRun) -> list[LeftOut]:
    return [LeftOut(item=f"{domain}/{task.task_id} action {number}",
                    reason=f"the gold write {call.name} fails ({call.error}) and changes nothing, in tau-bench too: left out "
                           "of the reference solution (the data check is the same without it)")
            for number, call in enumerate(run.calls, start=1) if call.error is not None and not call.read_only]


def _scenario(env_id: str, init_config: dict[str, Any], task: TauTask, digest: str) -> Scenario:
    checks = [CheckItem(check_item="the data equals the data after the gold actions", check_func=_data_check(digest))]
    checks += [CheckItem(check_item=f"the agent told the user {output!r}", check_func=_output_check(output)) for output in task.outputs]
    return Scenario(
        task_id=task.task_id,
        env_id=env_id,
        init_config=init_config,
        task=task.instruction,
        user_profile=task.instruction,
        checklist_with_func=checks,
        reference_solution=task.actions,
        reference_reply="\n".join(task.outputs) if task.outputs else None,
        tau_user_id=task.user_id,
    )


def _data_check(digest: str) -> str:
    return f"{CHANGES_CODE}\n\ndef check_func(final_state):\n    return changes_digest(initial_state, final_state) == {digest!r}\n"


def _output_check(output: str) -> str:
    # tau-bench's own test: the output, lowercased, in a reply lowercased with its commas taken out.
    return ("def check_func(final_state):\n"
            f"    expected = {json.dumps(output.lower())}\n"
            "    return any(expected in str(reply).lower().replace(',', '') for reply in agent_replies)\n")
