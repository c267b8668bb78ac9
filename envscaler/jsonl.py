"""JSON Lines that hold any text: one value per line, written escaped, read on ``"\\n"`` only.

Tool results, model replies and scenarios can hold any character. Three of them, U+2028, U+2029
and U+0085, are line breaks to ``str.splitlines`` (and to some editors and JavaScript readers), so
they are written as ``\\u`` escapes, and every reader here splits on ``"\\n"`` alone. A lone
surrogate (``"\\udfff"``, which a JSON decoder produces from an escape and a model can emit) cannot
be encoded as UTF-8 at all: it is written as its escape too, so it reads back as the same string.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

# Inside JSON text these can only occur within strings, where an escape means the same character.
_UNSAFE = re.compile("[\u0085\u2028\u2029\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")

M = TypeVar("M", bound=BaseModel)


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def escape_unsafe(json_text: str) -> str:
    """``json_text`` with line-break characters and lone surrogates written as ``\\u`` escapes."""
    if json_text.isascii():  # every one of them is outside ASCII, and Python knows a text is ASCII without reading it
        return json_text
    return _UNSAFE.sub(_escape, json_text)


def dumps(value: Any) -> str:
    """One line of JSON Lines (without its ``"\\n"``) for plain data or a pydantic model.

    Raises what serialisation raises (TypeError, ValueError, RecursionError) for values JSON cannot
    hold; lone surrogates are not among them.
    """
    if isinstance(value, BaseModel):
        try:
            text = value.model_dump_json()
        except PydanticSerializationError:
            # pydantic's encoder refuses lone surrogates; the standard one keeps them for escaping.
            text = json.dumps(value.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":"))
    else:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return escape_unsafe(text)


def validate_json(model: type[M], data: bytes | str) -> M:
    """``model.model_validate_json(data)``, also for JSON that escapes lone surrogates.

    pydantic's parser refuses ``"\\udfff"``, which ``json`` (and every writer here) accepts: such
    text is parsed by ``json`` and then validated. Raises ValidationError as pydantic does.
    """
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        if not any(item["type"] == "json_invalid" for item in e.errors()):
            raise
        try:
            value = json.loads(data)
        except ValueError:
            raise e from None
    return model.model_validate(value)


def replace_surrogates(text: str) -> tuple[str, int]:
    """``text`` with each lone surrogate replaced by U+FFFD, and how many were replaced."""
    return _SURROGATE.subn("\ufffd", text)


def iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line_number, raw_line)`` for each line of ``path``, split on ``b"\\n"`` only.

    A line keeps its ``b"\\n"``: a last line without one is what a killed writer leaves (torn).
    Read as bytes, so a huge file is never held whole and no newline translation happens.
    """
    with path.open("rb") as handle:
        yield from enumerate(handle, start=1)


def read_values(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line_number, value)`` for each non-blank line. Raises ValueError naming the line when one is not JSON."""
    for number, raw in iter_lines(path):
        if not raw.strip():
            continue
        try:
            yield number, json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}:{e.colno}: malformed JSON: {e.msg}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{number}: not UTF-8 text (byte {e.start + 1})") from None


def drop_lines(path: Path, numbers: set[int]) -> None:
    """Rewrite ``path`` without the lines ``numbers`` (1-based), atomically.

    The kept lines go to a temporary file next to it, which then replaces it (``os.replace``): a
    process killed at any point leaves either the old file or the new one, whole. Temporary files
    of a repair that was killed are removed first.
    """
    for leftover in path.parent.glob(f".{glob.escape(path.name)}.*.repair"):
        leftover.unlink(missing_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.repair")
    try:
        with temporary.open("wb") as sink:
            for number, raw in iter_lines(path):
                if number not in numbers:
                    sink.write(raw)
            sink.flush()
            os.fsync(sink.fileno())
        shutil.copymode(path, temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a power cut after it must not bring the old name back)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename itself is still atomic
    finally:
        os.close(fd)
