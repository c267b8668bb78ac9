"""Many environment servers at once: docker and process backends, a gateway, and the catalog file.

``envscaler farm up`` plans a farm and hands it to a detached daemon (``servers.farm.daemon``) that
starts and supervises the servers and serves the gateway; ``status`` and ``down`` work from the
catalog file and the files next to it.
"""
