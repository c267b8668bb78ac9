"""ROLL: its trajectory env manager, in a module that registers the farm's GEM env first.

ROLL makes each environment in its env manager's worker, ``gem.make(custom_envs.<tag>.env_type,
**env_config)``, and imports the manager by the dotted name in ``custom_envs.<tag>.env_manager_cls``.
Naming this module's ``TrajEnvManager`` there (it is ROLL's own, unchanged) imports
``agent_client.training.gem`` in that worker, so ``envscaler:farm`` is registered without editing
ROLL's env registry. See ``examples/roll_envscaler_farm.yaml``.
"""

from __future__ import annotations

import agent_client.training.gem  # noqa: F401  (registers envscaler:farm in the worker that makes it)
from roll.pipeline.agentic.env_manager.traj_env_manager import TrajEnvManager

__all__ = ["TrajEnvManager"]
