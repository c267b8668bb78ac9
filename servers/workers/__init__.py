"""The processes that run an environment's code and its checks for a server, never in it.

- :mod:`.store`: :class:`WorkerEpisodeStore`, episodes whose state lives in an environment worker:
  rebuilt by replay when it is replaced, checked in a check worker;
- :mod:`.process`: :class:`WorkerProcess`, one child asked requests with deadlines, killed and
  replaced when it must be, and who is to blame;
- :mod:`.wire`: what the server and its workers say to each other;
- :mod:`.env_worker`, :mod:`.check_worker`: the two children (``python -m ...``).
"""

from servers.workers.process import WorkerGone, WorkerProcess
from servers.workers.store import WorkerEpisodeStore

__all__ = ["WorkerEpisodeStore", "WorkerGone", "WorkerProcess"]
