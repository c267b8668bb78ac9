"""The farm's one address: ``/envs/{env_id}/...`` routed to the server that holds the environment.

- :mod:`.app`: :class:`Gateway`, the ASGI application (the daemon's, and the swarm's gateway service's);
- :mod:`.routing`: which server instance holds an episode (replicas);
- :mod:`.upstream`: pooled keep-alive connections to the servers;
- :mod:`.front`: haproxy in front of it, on the hot path, where it is installed;
- :mod:`.swarm`: the gateway as a swarm service.

Nothing is imported here: the daemon needs the application, the swarm service its own entry point.
"""
