"""LLM synthesis of environments and scenarios: SkelBuilder and ScenGenerator with quality gates.

``envscaler synth skeleton | scenarios | all`` drive it (synth.cli). Stage prompts live in
``synth/prompts/``, the seed-task corpus in ``synth/seeds/``. Generated code is policy-checked
(synth.policy) and runs only through envscaler's runtime guards in a limited child (synth.probe);
scenarios pass the same gates as ``envscaler catalog check`` before they are kept.
"""

from typing import TYPE_CHECKING

from synth.corpus import load_seeds
from synth.models import RunReport, SeedTask, SynthConfig
from synth.policy import check_code

if TYPE_CHECKING:
    from synth.pipeline import Synthesis, synthesis

__all__ = ["RunReport", "SeedTask", "SynthConfig", "Synthesis", "check_code", "load_seeds", "synthesis"]


def __getattr__(name: str) -> object:
    # The pipeline brings the OpenAI client, most of a second to import: it loads when first asked for,
    # so that every envscaler command (their parsers import this package) does not wait for it.
    if name in ("Synthesis", "synthesis"):
        from synth import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'synth' has no attribute {name!r}")
