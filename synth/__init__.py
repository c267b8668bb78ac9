"""LLM synthesis of environments and scenarios: SkelBuilder and ScenGenerator with quality gates.

``envscaler synth skeleton | scenarios | all`` drive it (synth.cli). Stage prompts live in
``synth/prompts/``, the seed-task corpus in ``synth/seeds/``. Generated code is policy-checked
(synth.policy) and runs only through envscaler's runtime guards in a limited child (synth.probe);
scenarios pass the same gates as ``envscaler catalog check`` before they are kept.
"""

from synth.models import RunReport, SeedTask, SynthConfig
from synth.pipeline import Synthesis, load_seeds, synthesis
from synth.policy import check_code

__all__ = ["RunReport", "SeedTask", "SynthConfig", "Synthesis", "check_code", "load_seeds", "synthesis"]
