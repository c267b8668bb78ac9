"""Where a farm's servers run, one module per engine; the daemon (``servers.farm.daemon``) supervises
the first two, Docker Swarm supervises its own.

- :mod:`.process`: local processes (the embedded default), forked from :mod:`.zygote`;
- :mod:`.docker`: one hardened container per environment, from the images of :mod:`.images`;
- :mod:`.swarm`: Docker Swarm services, the images pushed by :mod:`.publish`.

Nothing is imported here: each engine's module loads its own dependencies (the Docker SDK) when it is used.
"""
