"""The seed-task corpus: where the bundled one is, and how a corpus is read."""

from __future__ import annotations

from pathlib import Path

from envscaler.bundle import parse_model, read_jsonl
from synth.errors import SynthError
from synth.models import SeedTask


def bundled_seeds() -> Path:
    """The seed-task corpus shipped with the package."""
    return Path(__file__).parent / "seeds"


def load_seeds(path: str | Path) -> list[SeedTask]:
    """Seed tasks from a JSONL file, or from every ``*.jsonl`` in a folder (in name order)."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise SynthError(f"{path}: no seed tasks (give a JSONL file or a folder of them)")
    seeds = [parse_model(SeedTask, item, f"{f}:{n}") for f in files for n, item in read_jsonl(f)]
    ids = [s.task_id for s in seeds]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise SynthError(f"{path}: task_id must be unique; repeated: {', '.join(duplicated)}")
    return seeds
