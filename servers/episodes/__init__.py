"""Live episodes of one environment, wherever their code runs.

- :mod:`.store`: :class:`EpisodeRegistry` (ids, limits, leases, records, validation) and
  :class:`EpisodeStore`, which runs environment code in this process (``serve --in-process``; a
  worker process runs it by default, ``servers.workers``);
- :mod:`.calls`: :class:`CallRunner`, environment code off the event loop when it is slow;
- :mod:`.gate`: :class:`EpisodeGate`, who may act on one episode now (one holder, or a pipeline of calls);
- :mod:`.ids`: unguessable episode ids that name their replica.
"""

from servers.episodes.gate import EpisodeGate
from servers.episodes.store import EpisodeRegistry, EpisodeStore, LiveEpisode

__all__ = ["EpisodeGate", "EpisodeRegistry", "EpisodeStore", "LiveEpisode"]
