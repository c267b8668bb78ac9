"""Import BFCL's multi-turn categories (the Berkeley Function-Calling Leaderboard) from the user's checkout.

What is read (v3 and v4 layouts alike; BFCL's code and data stay the user's):

- ``BFCL_v*_multi_turn_<category>.json``: JSON Lines of tasks, each ``{"id", "question": [[messages of
  turn 1], ...], "initial_config": {class: config}, "involved_classes": [...]}``; where a category has
  several versions, the newest is read.
- ``possible_answer/<same name>``: ``{"id", "ground_truth": [[call strings of turn 1], ...]}``, parsed
  with ``ast`` (never evaluated): arguments of literal values only.
- ``multi_turn_func_doc/<module>.json``: JSON Lines of function docs (the tools), named after the module
  of ``eval_checker/multi_turn_eval/func_source_code/`` that defines the class.

One bundle per combination of involved classes: every class a part (``EnvSpec.classes``) built with
``cls()`` then ``_load_scenario(config)`` where the class has it, as BFCL does; the modules merged
into one ``env_class_code`` (``python_sources``), the classes' return annotations dropped (BFCL's do
not match what its tools return, and the runtime would hold the tools to them); a tool whose gold
calls changed the state marked so (``tool_annotations``), which reading its code cannot always tell. One scenario per task, one turn per BFCL turn. Each
turn's checks reproduce BFCL's multi-turn checker: every involved class's state after the turn equals
the gold run's, and the results of the turn's gold calls are among the results of the turn's calls
(as a multiset, in any order); a turn whose gold is empty (the model must ask, not act) passes when
it makes no call. The expected states and results are those of the gold calls, played at import in
a limited child process (``envscaler.importers.gold``), never in this one.

The ``long_context`` category gets bundles of its own, whose loaders are called with
``long_context=True`` (``ClassPart.loader_arguments``) as BFCL does. Left out, with the reason in the
report: tasks whose functions are withheld until a later turn (``miss_func``, and ``composite`` of v3:
a bundle's tool list is fixed), and any task whose gold calls cannot be parsed, name an unknown tool, break their function
doc's schema, or fail in BFCL's own code (an undeclared exception, a change to a module global every
episode shares) or cannot be played at all.

Differences from BFCL worth knowing: the response check reads the turn's own calls, where BFCL also
accepts results an earlier turn produced; a state is compared as JSON (public attributes, objects as
their public attributes) where BFCL compares attributes with ``==``.
"""

from __future__ import annotations

import ast
import json
import re
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from envscaler.bundle import read_jsonl, save_bundle
from envscaler.errors import BundleError, InfraError
from envscaler.importers.envscaler_release import ImportReport, LeftOut
from envscaler.importers.gold import GoldRun, run_gold
from envscaler.importers.python_sources import MergeProblem, merge_modules
from envscaler.models import Bundle, CheckItem, ClassPart, EnvSpec, Scenario, ToolAnnotations, ToolCall, ToolErrorPolicy, Turn
from envscaler.schema import validate

_DATA_FILE = re.compile(r"BFCL_v(\d+)_multi_turn_(\w+)\.json")
_LOADER = "_load_scenario"
# BFCL loads the classes of these categories with long_context=True (its checker's test on the category name).
_LONG_CONTEXT = ("long_context", "composite")
_BROAD = {"Exception", "BaseException"}
# What Python raises when a tool is given a value of the wrong shape (a list where BFCL's code calls .lower(),
# a date it cannot parse, an id it indexes by). BFCL answers the model with every exception, as its error.
_BAD_INPUT = {"ValueError", "KeyError", "IndexError", "TypeError", "AttributeError"}
# BFCL's parameter types in JSON Schema's words ("any": no constraint).
_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "str": "string", "int": "integer",
          "bool": "boolean", "any": None}
_SCHEMA_KEYS = {"type", "description", "enum", "required", "default", "items", "properties", "additionalProperties"}
GOLD_TIMEOUT_S = 300.0


class BfclTask(BaseModel):
    """One multi-turn task as BFCL stores it, with its gold calls (still as text)."""

    id: str
    category: str
    turns: list[str]
    initial_config: dict[str, Any] = Field(default_factory=dict)
    involved_classes: list[str]
    ground_truth: list[list[str]]
    withheld: dict[str, list[str]] = Field(default_factory=dict)
    """Functions kept from the model until a turn (``missed_function``: turn index -> names)."""

    @property
    def long_context(self) -> bool:
        return any(word in self.category for word in _LONG_CONTEXT)


class BfclCheckout(BaseModel):
    """Where the parts of a checkout are, and what its modules define."""

    data_files: dict[str, Path]
    """Category -> the newest data file of it."""
    superseded: list[Path] = Field(default_factory=list)
    source_dir: Path
    doc_dir: Path
    modules: dict[str, str] = Field(default_factory=dict)
    """Module name -> its source text."""
    classes: dict[str, str] = Field(default_factory=dict)
    """Class name -> the module defining it at top level."""


def import_bfcl(path: Path, out: Path, *, gold_timeout_s: float = GOLD_TIMEOUT_S) -> ImportReport:
    """Write one bundle per combination of involved classes under ``out``. Raises BundleError on bad input."""
    checkout = find_checkout(path)
    report = ImportReport()
    report.left_out += [LeftOut(item=str(p), reason="an older version of a category that a newer file holds too")
                        for p in checkout.superseded]
    by_classes: dict[tuple[tuple[str, ...], bool], list[BfclTask]] = defaultdict(list)
    for category, data_file in sorted(checkout.data_files.items()):
        for task in read_tasks(data_file, category):
            reason = _inexpressible(task, checkout)
            if reason is not None:
                report.left_out.append(LeftOut(item=task.id, reason=reason))
                continue
            by_classes[(tuple(sorted(task.involved_classes)), task.long_context)].append(task)
    for (classes, long_context), tasks in sorted(by_classes.items()):
        bundle = _bundle(checkout, classes, long_context, tasks, report, gold_timeout_s)
        if bundle is None:
            continue
        report.written.append(str(save_bundle(bundle, out)))
        report.environments += 1
        report.scenarios += len(bundle.scenarios)
    return report


def find_checkout(path: Path) -> BfclCheckout:
    """The data files, function docs and API sources under ``path`` (a gorilla checkout or any folder within it)."""
    if not path.is_dir():
        raise BundleError(f"{path}: not a folder; give the BFCL checkout (gorilla, or its berkeley-function-call-leaderboard)")
    newest: dict[str, tuple[int, Path]] = {}
    superseded: list[Path] = []
    for file in sorted(path.rglob("BFCL_v*_multi_turn_*.json")):
        match = _DATA_FILE.fullmatch(file.name)
        if match is None or "possible_answer" in file.parts or "unused_datasets" in file.parts:
            continue
        version, category = int(match.group(1)), match.group(2)
        if category in newest:
            older = min(newest[category], (version, file))
            superseded.append(older[1])
            if older[1] == file:
                continue
        newest[category] = (version, file)
    if not newest:
        raise BundleError(f"{path}: no BFCL_v*_multi_turn_*.json data files under it: is it a BFCL checkout?")
    data_dir = next(iter(newest.values()))[1].parent
    doc_dir = data_dir / "multi_turn_func_doc"
    sources = [d for d in path.rglob("func_source_code") if d.is_dir() and any(d.glob("*.py"))]
    if not doc_dir.is_dir():
        raise BundleError(f"{data_dir}: no multi_turn_func_doc/ beside the data files")
    if not sources:
        raise BundleError(f"{path}: no eval_checker/multi_turn_eval/func_source_code/ with the API classes under it")
    # The API sources of the package the data belongs to: the folder sharing the longest path with the data.
    source_dir = max(sources, key=lambda d: (len(_common(d, data_dir)), str(d)))
    checkout = BfclCheckout(data_files={c: f for c, (_, f) in newest.items()}, superseded=superseded,
                            source_dir=source_dir, doc_dir=doc_dir)
    for file in sorted(source_dir.glob("*.py")):
        if file.stem == "__init__":
            continue
        text = file.read_text(encoding="utf-8")
        checkout.modules[file.stem] = text
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue  # reported when a bundle needs it
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                checkout.classes.setdefault(node.name, file.stem)
    return checkout


def read_tasks(data_file: Path, category: str) -> list[BfclTask]:
    """The tasks of one data file with their gold calls from ``possible_answer/``. Raises BundleError."""
    answers_file = data_file.parent / "possible_answer" / data_file.name
    if not answers_file.is_file():
        raise BundleError(f"{data_file}: no ground truth at {answers_file}")
    answers: dict[str, Any] = {}
    for number, item in read_jsonl(answers_file):
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            raise BundleError(f"{answers_file}:{number}: not a BFCL answer (an object with an id and a ground_truth)")
        answers[item["id"]] = item.get("ground_truth")
    tasks = []
    for number, item in read_jsonl(data_file):
        where = f"{data_file}:{number}"
        try:
            turns = [_user_text(turn) for turn in item["question"]]
            tasks.append(BfclTask(id=item["id"], category=category, turns=turns, initial_config=item.get("initial_config") or {},
                                  involved_classes=item["involved_classes"], ground_truth=answers.get(item["id"]) or [],
                                  withheld=item.get("missed_function") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"{where}: not a BFCL multi-turn task ({type(e).__name__}: {e})") from None
    return tasks


def parse_call(text: str, parameters: dict[str, list[str]] | None = None) -> ToolCall:
    """One gold call string (``cd(folder='docs')``) as a ToolCall, read as syntax. Raises ValueError.

    ``parameters``: each function's parameter names in order, which positional arguments (``cd('docs')``,
    as some of BFCL's gold calls are written) are given to.
    """
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"{text!r} is not a call: {e.msg}") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"{text!r} is not a call of a function by its name")
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        raise ValueError(f"{text!r} unpacks its arguments (* or **)")
    names = (parameters or {}).get(node.func.id, [])
    if len(node.args) > len(names):
        raise ValueError(f"{text!r} passes {len(node.args)} argument(s) by position; {node.func.id} takes {len(names)}")
    given = [*zip(names, node.args, strict=False), *((k.arg, k.value) for k in node.keywords if k.arg is not None)]
    arguments: dict[str, Any] = {}
    for name, value in given:
        if name in arguments:
            raise ValueError(f"{text!r} gives {name!r} twice")
        try:
            arguments[name] = ast.literal_eval(value)
        except ValueError:
            raise ValueError(f"{text!r} has an argument that is not a literal value") from None
    return ToolCall(name=node.func.id, arguments=json.loads(json.dumps(arguments)))


def json_schema(doc: dict[str, Any]) -> dict[str, Any]:
    """A BFCL parameter schema in JSON Schema's words (``dict`` -> object, ``float`` -> number, ``tuple`` -> array)."""
    schema: dict[str, Any] = {}
    for key, value in doc.items():
        if key not in _SCHEMA_KEYS:
            continue
        if key == "type":
            kind = _TYPES.get(value, value)
            if kind is not None:
                schema["type"] = kind
        elif key == "properties":
            schema["properties"] = {name: json_schema(item) for name, item in value.items()}
        elif key == "items":
            schema["items"] = json_schema(value)
        else:
            schema[key] = value
    return schema


def _inexpressible(task: BfclTask, checkout: BfclCheckout) -> str | None:
    if any(task.withheld.values()):
        return (f"category {task.category}: functions are withheld until a later turn "
                f"({', '.join(sorted({n for names in task.withheld.values() for n in names}))}); a bundle's tools are fixed")
    unknown = [c for c in task.involved_classes if c not in checkout.classes]
    if unknown:
        return f"involves {', '.join(unknown)}, which no module of {checkout.source_dir} defines"
    if len(task.ground_truth) != len(task.turns):
        return f"{len(task.turns)} turns but {len(task.ground_truth)} turns of ground truth"
    if any(not text for text in task.turns):
        return "a turn has no user message"
    return None


def _bundle(checkout: BfclCheckout, classes: tuple[str, ...], long_context: bool, tasks: list[BfclTask],
            report: ImportReport, gold_timeout_s: float) -> Bundle | None:
    """The bundle of one combination of classes, tasks that cannot be played going to ``report.left_out``."""
    label = " + ".join(classes)
    try:
        spec = _spec(checkout, classes, long_context)
    except (MergeProblem, BundleError, ValueError) as e:
        report.left_out += [LeftOut(item=task.id, reason=f"{label}: {e}") for task in tasks]
        return None
    tools = {tool.name: tool.parameters for tool in spec.listed_tools() or []}
    parameters = _parameters(checkout, classes)
    scripted: list[Scenario] = []
    for task in tasks:
        try:
            turns = [[parse_call(text, parameters) for text in turn] for turn in task.ground_truth]
        except ValueError as e:
            report.left_out.append(LeftOut(item=task.id, reason=f"gold call: {e}"))
            continue
        missing = sorted({call.name for turn in turns for call in turn} - set(tools))
        if missing:
            report.left_out.append(LeftOut(item=task.id, reason=f"gold calls of {', '.join(missing)}, not a function of {label}"))
            continue
        # A gold call its own function doc refuses would be refused to an agent too: the benchmark disagrees with itself.
        broken = [f"{call.name}: {problems[0]}" for turn in turns for call in turn
                  if (problems := validate(call.arguments, tools[call.name]))]
        if broken:
            report.left_out.append(LeftOut(item=task.id, reason=f"a gold call breaks its function doc ({broken[0]})"))
            continue
        scripted.append(Scenario(
            task_id=task.id, env_id=spec.env_id, env_class_name=spec.env_class_name,
            init_config={c: task.initial_config.get(c, {}) for c in classes}, task=task.turns[0],
            turns=[Turn(message=message, reference_solution=calls) for message, calls in zip(task.turns, turns, strict=True)],
            bfcl_category=task.category))
    if not scripted:
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="envscaler-bfcl-") as staging:
            runs = run_gold(save_bundle(Bundle(spec=spec, scenarios=scripted), staging), gold_timeout_s, states=True)
    except InfraError as e:
        report.left_out += [LeftOut(item=s.task_id, reason=f"the gold calls could not be played: {e}") for s in scripted]
        return None
    scenarios = []
    for scenario in scripted:
        run = runs.get(scenario.task_id) or GoldRun(task_id=scenario.task_id, error="the gold run reported nothing for it")
        if run.error is not None:
            report.left_out.append(LeftOut(item=run.task_id, reason=f"the gold calls could not be played: {run.error}"))
            continue
        failed = next(((number, call.error) for number, turn in enumerate(run.turns, start=1)
                       for call in turn.calls if call.env_fault), None)
        if failed is not None:
            report.left_out.append(LeftOut(item=run.task_id, reason=f"a gold call of turn {failed[0]} fails in BFCL's own code: {failed[1]}"))
            continue
        scenarios.append(_checked(scenario, run))
    if not scenarios:
        return None
    # The code analysis cannot see a write through another object's method (a file system's tree): what the
    # gold calls did decides for the tools they called.
    writers = sorted({call.name for scenario in scenarios for call in runs[scenario.task_id].calls if call.changed})
    spec.tool_annotations = {name: ToolAnnotations(readOnlyHint=False) for name in writers} or None
    return Bundle(spec=spec, scenarios=scenarios)


def _spec(checkout: BfclCheckout, classes: tuple[str, ...], long_context: bool) -> EnvSpec:
    modules = sorted({checkout.classes[c] for c in classes})
    # BFCL's return annotations are documentation (send_message promises strings and answers an object): published
    # as MCP output schemas they would make the runtime refuse the tools' real results.
    merged = merge_modules(checkout.modules, modules, _benchmark_module, keep=set(classes), drop_return_annotations=True)
    trees = {name: ast.parse(checkout.modules[name]) for name in modules}
    tools: list[dict[str, Any]] = []
    owner: dict[str, str] = {}
    for class_name in classes:
        doc_file = checkout.doc_dir / f"{checkout.classes[class_name]}.json"
        if not doc_file.is_file():
            raise BundleError(f"{class_name} has no function docs at {doc_file}")
        for number, doc in read_jsonl(doc_file):
            name = doc.get("name") if isinstance(doc, dict) else None
            if not isinstance(name, str):
                raise BundleError(f"{doc_file}:{number}: a function doc without a name")
            if name in owner:
                raise BundleError(f"the function {name!r} is in the docs of both {owner[name]} and {class_name}")
            owner[name] = class_name
            tools.append({"type": "function", "function": {"name": name, "description": doc.get("description", ""),
                                                           "parameters": json_schema(doc.get("parameters") or {"type": "dict"})}})
    loaded = [c for c in classes if _defines(trees[checkout.classes[c]], c, _LOADER)]
    parts = [ClassPart(name=c, class_name=c, loader=_LOADER if c in loaded else None,
                       loader_arguments={"long_context": True} if long_context and c in loaded else None) for c in classes]
    raised = sorted(({name for tree in trees.values() for name in _raised(tree)} | _BAD_INPUT) - _BROAD)
    return EnvSpec(
        env_id="bfcl_" + "_".join(_snake(c) for c in classes) + ("_long_context" if long_context else ""),
        env_class_name="".join(classes),
        env_class_code=merged.code,
        environment_summary=f"BFCL multi-turn: {', '.join(classes)}" + (" (long context)" if long_context else ""),
        environment_introduction=f"The BFCL API classes {', '.join(classes)}.",
        tools=tools,
        classes=parts,
        tool_errors=ToolErrorPolicy(agent_errors=raised),
        requires=merged.third_party or None,
    )


def _checked(scenario: Scenario, run: GoldRun) -> Scenario:
    """``scenario`` with each turn's checks: the state and the results its gold calls left in ``run``."""
    turns = []
    for number, (turn, gold) in enumerate(zip(scenario.turns or [], run.turns, strict=True), start=1):
        if not turn.reference_solution:
            checks = [CheckItem(check_item=f"turn {number}: no function is called (the request cannot be done as asked)",
                                check_func="def check_func(final_state):\n    return not turn_results\n")]
        else:
            checks = [CheckItem(check_item=f"turn {number}: {part}'s state is the gold run's (BFCL state check)",
                                check_func=f"def check_func(final_state):\n    return final_state.get({part!r}) == {state!r}\n")
                      for part, state in (gold.state or {}).items() if state]
            expected = [(call.result, call.error) for call in gold.calls]
            checks.append(CheckItem(
                check_item=f"turn {number}: the gold calls' results are among the turn's results (BFCL response check)",
                check_func=("def check_func(final_state):\n"
                            "    answered = [(call['result'], call['error']) for call in turn_results]\n"
                            f"    for result in {expected!r}:\n"
                            "        if result not in answered:\n"
                            "            return False\n"
                            "        answered.remove(result)\n"
                            "    return True\n")))
        turns.append(turn.model_copy(update={"checklist_with_func": checks}))
    return scenario.model_copy(update={"turns": turns})


def _benchmark_module(node: ast.Import | ast.ImportFrom) -> str | None:
    """The API module an import takes from BFCL's own package (relative, or through ``func_source_code``)."""
    if isinstance(node, ast.ImportFrom):
        if node.level:
            return (node.module or "").rsplit(".", 1)[-1] or None
        module = node.module or ""
    else:
        module = next((alias.name for alias in node.names if "func_source_code." in alias.name), "")
    return module.rsplit(".", 1)[-1] if "func_source_code." in module else None


def _parameters(checkout: BfclCheckout, classes: tuple[str, ...]) -> dict[str, list[str]]:
    """Each method's parameter names in order (``self`` left out), read from the classes' code."""
    found: dict[str, list[str]] = {}
    for class_name in classes:
        tree = ast.parse(checkout.modules[checkout.classes[class_name]])
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found[item.name] = [a.arg for a in [*item.args.posonlyargs, *item.args.args][1:]]
    return found


def _defines(tree: ast.Module, class_name: str, method: str) -> bool:
    return any(isinstance(node, ast.ClassDef) and node.name == class_name
               and any(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == method for item in node.body)
               for node in tree.body)


def _raised(tree: ast.Module) -> set[str]:
    """Names of the exception classes the code raises by name (``raise ValueError(...)``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id[:1].isupper():
                names.add(target.id)
    return names


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _user_text(turn: Any) -> str:
    if not isinstance(turn, list):
        raise TypeError(f"a turn is a list of messages, got {type(turn).__name__}")
    return "\n".join(m["content"] for m in turn if isinstance(m, dict) and m.get("role") == "user")


def _common(a: Path, b: Path) -> tuple[str, ...]:
    shared = []
    for x, y in zip(a.resolve().parts, b.resolve().parts, strict=False):
        if x != y:
            break
        shared.append(x)
    return tuple(shared)
