"""Environment code that reaches for the host: root's kernel knobs, memory no limit counts, the log, threads."""

from __future__ import annotations

from pathlib import Path

from tests.support.bundles import COUNTER_CODE, counter_scenario, counter_spec, write_bundle

ROGUE_TOOLS = '''
    def whoami(self) -> dict:
        """Who this code runs as, and how its user namespace maps it."""
        import os
        with open("/proc/self/uid_map") as file:
            return {"success": True, "data": {"uid": os.getuid(), "uid_map": file.read().split()}}

    def rewrite_sysctl(self, name: str) -> dict:
        """Write a kernel knob's own value back to it (no change, were it ever allowed).

        Args:
            name (str): Its path under /proc/sys.
        """
        with open("/proc/sys/" + name) as file:
            value = file.read()
        with open("/proc/sys/" + name, "w") as file:
            file.write(value)
        return {"success": True, "data": value}

    def hold_memfd(self, mb: int) -> dict:
        """Fill a memory file that no address space maps, and keep it.

        Args:
            mb (int): How many MB.
        """
        import os
        fd = os.memfd_create("hog")
        chunk = b"x" * (1 << 20)
        for _ in range(mb):
            os.write(fd, chunk)
        self._held = fd
        return {"success": True, "data": mb}

    def fill_shm(self, mb: int) -> dict:
        """Fill a file in /dev/shm.

        Args:
            mb (int): How many MB.
        """
        chunk = b"x" * (1 << 20)
        with open("/dev/shm/hog", "wb") as file:
            for _ in range(mb):
                file.write(chunk)
        return {"success": True, "data": mb}

    def shout(self, mb: int) -> dict:
        """Write a line that looks like the server's, then MB of text, to stderr.

        Args:
            mb (int): How many MB.
        """
        import os
        os.write(2, b'{"ts": 0, "level": "error", "logger": "envscaler.server", "event": "episode lost", "env": "counter"}\\n')
        chunk = b"y" * (1 << 20)
        for _ in range(mb):
            os.write(2, chunk)
        return {"success": True, "data": mb}

    def spawn_threads(self, count: int) -> dict:
        """Switch off the worker's watch for threads left running, then start threads that never end (past the guard).

        Args:
            count (int): How many.
        """
        import _thread
        import sys
        import time
        sys.modules["servers.workers.env_worker"].foreign_threads = lambda store: set()  # forked by the spawner, which imported it
        start = [c.cell_contents for c in _thread.start_new_thread.__closure__ if callable(c.cell_contents)][0]
        started = 0
        try:
            for _ in range(count):
                start(time.sleep, (10**6,))
                started += 1
        except RuntimeError as e:
            return {"success": False, "error": f"{started} started, then: {e}"}
        return {"success": True, "data": started}

    def blob(self, kb: int) -> str:
        """Return KB of text.

        Args:
            kb (int): How many KB.
        """
        return "x" * (kb * 1024)

    def get_item('''

ROGUE_CODE = COUNTER_CODE.replace("\n    def get_item(", ROGUE_TOOLS, 1)


def rogue_bundle(root: Path, scenarios: list[dict] | None = None) -> Path:
    """The counter environment with the rogue tools, as env ``rogue``."""
    spec = counter_spec(env_id="rogue", env_class_code=ROGUE_CODE)
    return write_bundle(root, spec, scenarios or [counter_scenario(env_id="rogue", task_id="rogue_001")])
