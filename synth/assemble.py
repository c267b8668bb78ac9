"""Assemble an environment class from its skeleton and its separately written methods."""

from __future__ import annotations

import ast
import textwrap

from synth.errors import Rejected


def method_source(code: str) -> str:
    """A method's source as written at module level (dedented, no trailing blank lines)."""
    return textwrap.dedent(code).strip("\n")


def assemble_class(skeleton: str, class_name: str, methods: list[str]) -> str:
    """The skeleton with ``methods`` appended to the body of ``class_name``.

    Methods go right after the class's last line, so anything the skeleton defines after the class
    stays where it was. Raises Rejected when the skeleton has no such class or already defines a
    method of the same name.
    """
    tree = ast.parse(skeleton)
    target = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if target is None:
        raise Rejected("skeleton", f"the skeleton defines no class {class_name!r}")
    existing = {n.name for n in target.body if isinstance(n, ast.FunctionDef)}
    lines = skeleton.rstrip("\n").splitlines()
    end = target.end_lineno or len(lines)
    added: list[str] = []
    for code in methods:
        source = method_source(code)
        name = next(n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
        if name in existing:
            raise Rejected("skeleton", f"the skeleton already defines {name!r}; leave operations to the method stage")
        added.append("")
        added.extend(textwrap.indent(source, "    ").splitlines())
    return "\n".join(lines[:end] + added + lines[end:]) + "\n"


def function_source(code: str, name: str) -> str | None:
    """The source of the top-level or method function ``name`` inside ``code``, or None."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            segment = ast.get_source_segment(code, node, padded=True)
            return textwrap.dedent(segment) if segment else None
    return None
