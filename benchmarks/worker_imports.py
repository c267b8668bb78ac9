"""What a worker's memory is made of: the USS each module's import adds, in a fresh interpreter per worker.

For each worker module (``servers.workers.env_worker``, ``servers.workers.check_worker``), a child
interpreter is started with the environment a server gives its workers
(``servers.workers.process.CHILD_ENVIRONMENT`` over ``envscaler.sandbox.clean_environment``), and an
import hook reads the child's USS (/proc/self/smaps_rollup) before and after each module's body runs
(and each extension module's load): a module's own cost is what it added less what the modules it
imported added. This script prints the total, the biggest modules and the cost by top-level package,
against two baselines measured in the same run: an interpreter that imports nothing, and the same
import with the bare clean environment (no CHILD_ENVIRONMENT). Then the malloc arenas of call
threads: 16 threads that build and parse JSON at once, with and without CHILD_ENVIRONMENT.

Costs are of this checkout as it is: with no bytecode caches (``PYTHONDONTWRITEBYTECODE``, a read-only
checkout), each module is compiled from source, and what the compiler took stays with the process.

    python benchmarks/worker_imports.py [--top 25] [--module servers.workers.env_worker ...]

Target (issue 34): an environment worker's imports add at most 12 MB of USS to a bare interpreter.
Exits 1 when missed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

from common import Verdict, argument_parser, report

from envscaler.sandbox import clean_environment
from servers.workers.process import CHILD_ENVIRONMENT

WORKERS = ["servers.workers.env_worker", "servers.workers.check_worker"]
IMPORTS_TARGET_MB = 12.0

# Run in the child: every module's body timed in USS, its importers' costs less its own.
_PROBE = r'''
import importlib.abc, json, sys

def uss_kb():
    with open("/proc/self/smaps_rollup", "rb") as f:
        total = 0
        for line in f:
            if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
                total += int(line.split()[1])
        return total

costs = {}
stack = []

class Measured(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader
    def create_module(self, spec):
        # An extension module's library is loaded here: its pages count against it.
        before = uss_kb()
        module = self.loader.create_module(spec)
        costs[spec.name] = costs.get(spec.name, 0) + uss_kb() - before
        if stack:
            stack[-1] += uss_kb() - before
        return module
    def exec_module(self, module):
        stack.append(0)
        before = uss_kb()
        try:
            self.loader.exec_module(module)
        finally:
            total = uss_kb() - before
            inner = stack.pop()
            costs[module.__name__] = costs.get(module.__name__, 0) + total - inner
            if stack:
                stack[-1] += total

class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = Measured(spec.loader)
                return spec
        return None

bare = uss_kb()
sys.meta_path.insert(0, Finder())
target = sys.argv[1]
if target:
    __import__(target)
print(json.dumps({"bare_kb": bare, "after_kb": uss_kb(), "costs": costs}))
'''


# Run in the child: USS before and after call threads build and parse JSON at once.
_THREADS = r'''
import json, threading
def uss_kb():
    with open("/proc/self/smaps_rollup", "rb") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith((b"Private_Clean:", b"Private_Dirty:")))
start = threading.Barrier(16)
def work():
    start.wait()
    for _ in range(200):  # a tool's result and its JSON, both held at once, as a call holds them
        text = json.dumps({"items": [{"name": "x" * 50, "count": n} for n in range(300)]})
        value = json.loads(text)
threads = [threading.Thread(target=work) for _ in range(16)]
before = uss_kb()
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps({"added_kb": uss_kb() - before}))
'''


def child_env(as_server_gives: bool) -> dict[str, str]:
    """A worker's environment (``as_server_gives``), else the bare clean one; this checkout first on its path."""
    base = {**CHILD_ENVIRONMENT, **clean_environment()} if as_server_gives else clean_environment()
    return {**base, "PYTHONPATH": ":".join(sys.path)}


def probe(module: str, as_server_gives: bool = True, script: str = _PROBE) -> dict:
    """The child's report for ``module`` ("" for the bare interpreter)."""
    done = subprocess.run([sys.executable, "-c", script, module], capture_output=True, text=True, env=child_env(as_server_gives),
                          check=True)
    return json.loads(done.stdout)


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--top", type=int, default=25, help="modules to list, biggest first (default: 25)")
    parser.add_argument("--module", action="append", help=f"worker module to measure (repeatable; default: {', '.join(WORKERS)})")
    args = parser.parse_args()
    bare = probe("")
    print(f"bare interpreter: USS {bare['after_kb'] / 1024:.1f} MB")
    verdicts = []
    for module in args.module or WORKERS:
        found = probe(module)
        plain = probe(module, as_server_gives=False)
        added = (found["after_kb"] - bare["after_kb"]) / 1024
        costs = found["costs"]
        print(f"\n{module}: USS {found['after_kb'] / 1024:.1f} MB, its imports {added:+.1f} MB over the bare interpreter, "
              f"{len(costs)} modules; without CHILD_ENVIRONMENT: USS {plain['after_kb'] / 1024:.1f} MB")
        by_package: dict[str, int] = defaultdict(int)
        for name, kb in costs.items():
            by_package[name.split(".")[0]] += kb
        print("  by top-level package (MB): " + ", ".join(f"{name} {kb / 1024:.1f}"
                                                          for name, kb in sorted(by_package.items(), key=lambda item: -item[1])[:15]))
        for name, kb in sorted(costs.items(), key=lambda item: -item[1])[:args.top]:
            print(f"  {kb / 1024:6.2f} MB  {name}")
        if module == "servers.workers.env_worker":
            verdicts.append(Verdict(f"{module}: imports' USS", f"{added:.1f} MB", f"<= {IMPORTS_TARGET_MB:g} MB", added <= IMPORTS_TARGET_MB))
    arenas = {given: probe("", given, _THREADS)["added_kb"] / 1024 for given in (False, True)}
    print(f"\n16 call threads' malloc arenas: USS {arenas[True]:+.1f} MB with CHILD_ENVIRONMENT, {arenas[False]:+.1f} MB without")
    return report(verdicts)


if __name__ == "__main__":
    sys.exit(main())
