"""Trainers on a farm: one adapter per framework, each holding one farm episode per trajectory.

- ``trl``: TRL's ``environment_factory`` classes and dataset (:class:`TrainingFarm`);
- ``verl``: an agent loop registered as ``envscaler_farm`` (``agent_client.training.verl``);
- ``skyrl``: a ``BaseTextEnv`` registered in skyrl-gym as ``envscaler_farm`` (``agent_client.training.skyrl``);
- ``gem``: a ``gem.Env`` registered as ``envscaler:farm``, which ROLL and OpenRLHF make (``agent_client.training.gem``);
- ``roll``: ROLL's trajectory env manager, named in ROLL's config so its workers register ``envscaler:farm``;
- ``session``: the core they share (the farm, an episode, the validator's score); ``toolcalls``: tool
  calls read from model text.

Framework modules import their framework, so they load only when named: ``from agent_client.training
import TrainingFarm`` needs nothing beyond the ``[trl]`` extra's datasets, and only for ``dataset()``.
"""

from agent_client.training.session import EpisodeScore, FarmConnection, FarmEpisode
from agent_client.training.trl import FarmEnvironment, TrainingFarm

__all__ = ["EpisodeScore", "FarmConnection", "FarmEnvironment", "FarmEpisode", "TrainingFarm"]
