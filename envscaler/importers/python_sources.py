"""Several Python modules of a benchmark merged into one ``env_class_code``, read as syntax only.

A bundle holds its code as one module, but a benchmark spreads its classes over files that import
each other and reuse module-level names (every BFCL API file has its own ``DEFAULT_STATE``; one does
``import datetime``, another ``from datetime import datetime``). :func:`merge_modules` writes the
modules one after the other, each after those it imports from the benchmark itself (whose import
statements are dropped: their names are then module-level names of the merged code), and renames a
module-level name that an earlier module binds to something else, everywhere that module refers to
it, local names that shadow it excepted. Nothing here runs the code.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterator

from pydantic import BaseModel, Field

_FUTURE = "__future__"


class MergeProblem(Exception):
    """The modules cannot be merged (a syntax error, an import of the benchmark's own code that is not there)."""


class MergedCode(BaseModel):
    """The merged module, and what it imports from outside the standard library (top-level module names)."""

    code: str
    third_party: list[str] = Field(default_factory=list)
    renamed: dict[str, dict[str, str]] = Field(default_factory=dict)
    """Per module, the names it binds under another name in the merged code."""


LocalImport = Callable[[ast.Import | ast.ImportFrom], str | None]
"""The benchmark's own module an import statement imports from (its key in the sources), or None for another's."""


def merge_modules(sources: dict[str, str], roots: list[str], local_module: LocalImport, keep: set[str], *,
                  drop_return_annotations: bool = False) -> MergedCode:
    """``roots`` (keys of ``sources``) and the benchmark modules they import, merged; ``keep``: names that must
    not be renamed (the classes the environment names), whose methods lose their return annotations with
    ``drop_return_annotations``. Raises MergeProblem."""
    trees = {}
    order: list[str] = []

    def visit(key: str, path: tuple[str, ...]) -> None:
        if key in order:
            return
        if key in path:
            raise MergeProblem(f"the modules import each other in a cycle: {' -> '.join((*path, key))}")
        if key not in sources:
            raise MergeProblem(f"{path[-1]} imports the benchmark module {key!r}, which is not in the checkout")
        if key not in trees:
            try:
                trees[key] = ast.parse(sources[key], filename=key)
            except SyntaxError as e:
                raise MergeProblem(f"{key}: syntax error, line {e.lineno}: {e.msg}") from None
        for node in trees[key].body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and (dependency := local_module(node)) is not None:
                visit(dependency, (*path, key))
        order.append(key)

    for root in roots:
        visit(root, ())
    bound: dict[str, tuple[str, ...]] = {}  # name -> what binds it first
    final: dict[str, dict[str, str]] = {}  # module -> its module-level names as the merged code calls them
    pieces: list[str] = []
    future: set[str] = set()
    third_party: set[str] = set()
    renamed: dict[str, dict[str, str]] = {}
    for key in order:
        tree = trees[key]
        renames: dict[str, str] = {}
        body: list[ast.stmt] = []
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == _FUTURE:
                future.update(alias.name for alias in node.names)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)) and (dependency := local_module(node)) is not None:
                renames.update(_local_names(node, dependency, final[dependency]))
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                third_party.update(_outside_stdlib(node))
            body.append(node)
        own: dict[str, str] = {}
        for name, binding in _bindings(key, body):
            if name in bound and bound[name] != binding and name not in renames:
                if name in keep:
                    raise MergeProblem(f"{key} defines {name!r}, which an earlier module binds too")
                renames[name] = f"_{key}__{name}"
            bound.setdefault(name, binding)
            own[name] = renames.get(name, name)
        final[key] = own
        tree.body = body
        _Renamer(renames).visit(tree)
        if drop_return_annotations:
            for node in body:
                if isinstance(node, ast.ClassDef) and node.name in keep:
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            item.returns = None
        if changed := {old: new for old, new in renames.items() if old != new}:
            renamed[key] = changed
        pieces.append(f"# ---- {key} ----\n{ast.unparse(tree)}\n")
    header = f"from __future__ import {', '.join(sorted(future))}\n\n" if future else ""
    return MergedCode(code=header + "\n\n".join(pieces), third_party=sorted(third_party), renamed=renamed)


def _local_names(node: ast.Import | ast.ImportFrom, dependency: str, names: dict[str, str]) -> dict[str, str]:
    """What an import of a merged module binds, as names of the merged code (``from m import X as Y``: Y -> X)."""
    if isinstance(node, ast.Import):
        raise MergeProblem(f"'import' of the benchmark module {dependency!r} as a module is not supported "
                           "(only 'from ... import NAME')")
    result = {}
    for alias in node.names:
        if alias.name == "*":
            result.update({name: new for name, new in names.items() if not name.startswith("_")})
        elif alias.name not in names:
            raise MergeProblem(f"{dependency} has no module-level name {alias.name!r} to import")
        else:
            result[alias.asname or alias.name] = names[alias.name]
    return result


def _outside_stdlib(node: ast.Import | ast.ImportFrom) -> set[str]:
    modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    tops = {module.split(".")[0] for module in modules if module}
    if isinstance(node, ast.ImportFrom) and node.level:
        return set()
    return {top for top in tops if top not in sys.stdlib_module_names}


def _bindings(key: str, body: list[ast.stmt]) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(name, what binds it) for each module-level binding; two imports of the same thing bind the same."""
    for node in body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                # ``import a.b`` binds ``a``, the package.
                yield (alias.asname or alias.name.split(".")[0]), ("import", alias.name if alias.asname else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                yield (alias.asname or alias.name), ("from", str(node.level), node.module or "", alias.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, ("defined", key)
        else:
            for name in _stored_names(node):
                yield name, ("defined", key)


def _stored_names(node: ast.AST) -> Iterator[str]:
    """Names a statement binds in its own scope (not inside functions, classes or comprehensions it holds)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
        return
    if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        return
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        yield node.id
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        for alias in node.names:
            yield alias.asname or alias.name.split(".")[0]
    for child in ast.iter_child_nodes(node):
        yield from _stored_names(child)


def _function_locals(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    arguments = node.args
    names = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}
    names |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
    if isinstance(node, ast.Lambda):
        return names
    declared = {name for statement in ast.walk(node) if isinstance(statement, (ast.Global, ast.Nonlocal)) for name in statement.names}
    for statement in node.body:
        names |= set(_stored_names(statement))
    return names - declared


class _Renamer(ast.NodeTransformer):
    """Renames module-level names everywhere they are meant, leaving the local names that shadow them."""

    def __init__(self, renames: dict[str, str]) -> None:
        self.renames = renames
        self.scopes: list[set[str]] = []

    def _new(self, name: str) -> str:
        if name in self.renames and not any(name in scope for scope in self.scopes):
            return self.renames[name]
        return name

    def _scoped(self, node: ast.AST, names: set[str]) -> ast.AST:
        self.scopes.append(names)
        try:
            return self.generic_visit(node)
        finally:
            self.scopes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        if not self.scopes:
            node.name = self._new(node.name)
        return self._scoped(node, _function_locals(node))

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815 - ast's visitor naming

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        return self._scoped(node, _function_locals(node))

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        if not self.scopes:
            node.name = self._new(node.name)
        return self._scoped(node, {name for statement in node.body for name in _stored_names(statement)})

    def _comprehension(self, node: ast.AST) -> ast.AST:
        targets = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}  # type: ignore[attr-defined]
        return self._scoped(node, targets)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension  # noqa: N815

    def visit_Name(self, node: ast.Name) -> ast.AST:
        node.id = self._new(node.id)
        return node

    def visit_Global(self, node: ast.Global) -> ast.AST:
        node.names = [self.renames.get(name, name) for name in node.names]
        return node

    def visit_alias(self, node: ast.alias) -> ast.AST:
        if not self.scopes:
            bound = node.asname or node.name.split(".")[0]
            new = self._new(bound)
            if new != bound:
                if node.asname is None and "." in node.name:  # ``import a.b`` binds ``a``; ``as`` would bind ``a.b``
                    raise MergeProblem(f"cannot rename the package bound by 'import {node.name}' (another module binds {bound!r})")
                node.asname = new
        return node
