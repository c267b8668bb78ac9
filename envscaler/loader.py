"""Environment class code -> a class, in a fresh module namespace, cached by content."""

from __future__ import annotations

import hashlib
import inspect
import linecache
import sys
import types

from envscaler.composite import compose
from envscaler.errors import EnvCodeError
from envscaler.guard import running_env_code
from envscaler.models import EnvSpec

_CLASSES: dict[str, type] = {}
# Code digest -> the code compiled: by ``precheck_class`` (a farm of replicas compiles each class once),
# ``compile_ahead`` (a process forked after it need not compile it at all) or ``load_class``.
_COMPILED: dict[str, types.CodeType] = {}


def code_filename(class_code: str) -> str:
    """The pseudo file name environment code runs under; tracebacks show it. Named for the code, not for
    an environment: environments of the same code (replicas) share it, compiled once."""
    return f"<env code {_digest(class_code)[:12]}>"


def _compile(class_code: str, env_id: str, filename: str) -> types.CodeType:
    try:
        return compile(class_code, filename, "exec")
    except SyntaxError as e:
        raise EnvCodeError(f"{env_id}: syntax error in class code, line {e.lineno}: {e.msg}") from None


def _digest(class_code: str) -> str:
    return hashlib.sha256(class_code.encode()).hexdigest()


def _compiled(class_code: str, env_id: str) -> types.CodeType:
    """``class_code`` compiled, once per process (EnvCodeError naming ``env_id`` for a syntax error)."""
    digest = _digest(class_code)
    code = _COMPILED.get(digest)
    if code is None:
        code = _COMPILED[digest] = _compile(class_code, env_id, code_filename(class_code))
    return code


def compile_ahead(class_code: str) -> types.CodeType | None:
    """Compile ``class_code`` now, running none of it, and keep it: a process forked after this loads a
    class of the same code without compiling it (the farm's zygote calls it before it forks a server).
    The code; None for code that does not compile, left to whoever loads it to report."""
    try:
        return _compiled(class_code, "")
    except EnvCodeError:
        return None


def precheck_class(spec: EnvSpec) -> None:
    """EnvCodeError when the code cannot compile or defines no top-level ``env_class_name``; runs none of it.

    Safe in any process, and cheap (one compile per distinct code): commands that start servers or
    build images (``farm up``, ``build``) call it first, so a broken class fails at once with its
    cause, not in a crash loop.
    """
    code = _compiled(spec.env_class_code, spec.env_id)  # a syntax error, named by its line
    # A class statement's body is compiled to a code object of its own, kept among the module's constants,
    # and named for the class; unlike a function's body, it is not optimized (its names live in a dict).
    names = tuple(constant.co_name for constant in code.co_consts
                  if isinstance(constant, types.CodeType) and not constant.co_flags & inspect.CO_OPTIMIZED)
    wanted = [part.class_name for part in spec.classes] if spec.classes else [spec.env_class_name]
    for class_name in wanted:
        if class_name not in names:
            raise EnvCodeError(
                f"{spec.env_id}: class code defines no class {class_name!r} at its top level "
                f"(it defines: {', '.join(names) or 'none'})"
            )


def load_class(spec: EnvSpec) -> type:
    """Compile ``spec.env_class_code`` and return ``spec.env_class_name`` from it, or with ``spec.classes`` a
    class composing those classes (``envscaler.composite``).

    Each distinct code gets its own module, so two environments never share globals; the same code
    is compiled once per process, and not at all where it was compiled ahead (:func:`compile_ahead`). Raises EnvCodeError naming the line of a syntax error, or the
    exception the module raised while loading.
    """
    part_key = "\0".join(part.model_dump_json() for part in spec.classes or [])
    digest = hashlib.sha256(f"{spec.env_class_name}\0{part_key}\0{spec.env_class_code}".encode()).hexdigest()[:16]
    cached = _CLASSES.get(digest)
    if cached is not None:
        return cached
    filename = code_filename(spec.env_class_code)
    # Compiled ahead in the process this one was forked from, shared with it and its other children; or here.
    code = _compiled(spec.env_class_code, spec.env_id)
    module_name = f"envscaler_env_{digest}"
    module = types.ModuleType(module_name)
    module.__file__ = filename
    # typing resolves TypedDict and string annotations through sys.modules.
    sys.modules[module_name] = module
    linecache.cache[filename] = (
        len(spec.env_class_code),
        None,
        spec.env_class_code.splitlines(keepends=True),
        filename,
    )
    try:
        with running_env_code():
            exec(code, module.__dict__)
    except BaseException as e:  # noqa: BLE001 - module-level code is untrusted; report anything
        del sys.modules[module_name]
        raise EnvCodeError(f"{spec.env_id}: class code failed to load: {type(e).__name__}: {e}") from None
    if spec.classes:
        parts = [(part, _defined_class(spec, module, part.class_name)) for part in spec.classes]
        cls = compose(spec.env_id, spec.env_class_name, parts, module_name)
    else:
        cls = _defined_class(spec, module, spec.env_class_name)
    _CLASSES[digest] = cls
    return cls


def _defined_class(spec: EnvSpec, module: types.ModuleType, name: str) -> type:
    cls = module.__dict__.get(name)
    if not isinstance(cls, type):
        found = sorted(k for k, v in module.__dict__.items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise EnvCodeError(f"{spec.env_id}: class code defines no class {name!r} (it defines: {', '.join(found) or 'none'})")
    return cls
