"""Starting process-backend servers: forked from the zygote vs each its own interpreter, in one run.

Starts N servers (copies of the bundled catalog, cycling) with no farm daemon around them, so the
numbers are the spawner's alone: the time until every server has said it listens (its ready pipe),
and USS (Private_Clean + Private_Dirty), PSS and RSS per server from /proc/PID/smaps_rollup, one
second after the last one listens. The "popen" side is what the process backend did before the
zygote: ``python -m servers.cli`` per server, with the same limits.

    python benchmarks/spawn.py [--envs 200]

Targets (the zygote): every server listening within 30 s for 200 on a 2-core machine, USS <= 12 MB
per server. Exits 1 when one is missed.
"""

from __future__ import annotations

import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from common import Memory, Verdict, argument_parser, describe_memory, memory, report

from envscaler import default_catalog
from envscaler.sandbox import FARM_ID_VARIABLE, clean_environment
from servers.farm.models import EnvPlan
from servers.farm.backends.process import server_preexec
from servers.farm.backends.spawning import server_command
from servers.farm.backends.zygote import ZygoteSpawner
from servers.serve import READY_FD_VARIABLE

LISTEN_TARGET_S = 30.0
USS_TARGET_MB = 12.0
FARM_ID = "spawn-benchmark"


def plans(count: int) -> list[EnvPlan]:
    bundles = sorted(p for p in default_catalog().iterdir() if (p / "env.json").exists())
    return [
        EnvPlan(env_id=f"{bundles[n % len(bundles)].name}_{n:03d}", bundle_dir=str(bundles[n % len(bundles)]),
                token=f"token-{n}", port=20000 + n, spec_hash="benchmark")
        for n in range(count)
    ]


def environment(env: EnvPlan) -> dict[str, str]:
    return clean_environment({"ENVSCALER_TOKEN": env.token, FARM_ID_VARIABLE: FARM_ID, "MALLOC_ARENA_MAX": "2"})


async def start_zygote(envs: list[EnvPlan], logs: Path) -> tuple[float, list[Memory]]:
    spawner = ZygoteSpawner(clean_environment({FARM_ID_VARIABLE: FARM_ID, "MALLOC_ARENA_MAX": "2"}), ["--no-sandbox"])
    servers = []
    started = time.perf_counter()

    async def one(env: EnvPlan) -> None:
        server = await spawner.spawn(env, environment(env), logs / f"{env.env_id}.log", 256)
        servers.append(server)
        if not await server.wait_ready():
            raise SystemExit(f"{env.env_id} exited before it listened; see {logs}")

    try:
        async with anyio.create_task_group() as tasks:
            for env in envs:
                tasks.start_soon(one, env)
        seconds = time.perf_counter() - started
        await anyio.sleep(1.0)
        used = [memory(server.pid) for server in servers]
    finally:
        for server in servers:
            server.send_signal(signal.SIGKILL)
        for server in servers:
            await server.wait_exit()
        await spawner.aclose()
    return seconds, used


def start_popen(envs: list[EnvPlan], logs: Path) -> tuple[float, list[Memory]]:
    children, ready = [], []
    started = time.perf_counter()
    try:
        for env in envs:
            read_fd, write_fd = os.pipe()
            with open(logs / f"{env.env_id}.log", "ab") as log:
                children.append(subprocess.Popen(
                    server_command(env, ["--no-sandbox"]), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env={**environment(env), READY_FD_VARIABLE: str(write_fd)}, pass_fds=(write_fd,), start_new_session=True,
                    preexec_fn=functools.partial(server_preexec, 256),
                ))
            os.close(write_fd)
            ready.append(read_fd)
        for env, fd in zip(envs, ready):
            with os.fdopen(fd, "rb") as pipe:
                if b"listening" not in pipe.readline():
                    raise SystemExit(f"{env.env_id} exited before it listened; see {logs}")
        seconds = time.perf_counter() - started
        time.sleep(1.0)
        used = [memory(child.pid) for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait()
    return seconds, used


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--envs", type=int, default=200, help="servers to start each way (default: 200)")
    args = parser.parse_args()
    envs = plans(args.envs)
    with tempfile.TemporaryDirectory(prefix="envscaler-spawn-bench-") as scratch:
        logs = Path(scratch)
        zygote_s, zygote_memory = anyio.run(start_zygote, envs, logs)
        popen_s, popen_memory = start_popen(envs, logs)
    uss = max(m.uss for m in zygote_memory)
    print(f"zygote: {args.envs} servers listening in {zygote_s:.1f} s; {describe_memory(zygote_memory)}")
    print(f"popen:  {args.envs} servers listening in {popen_s:.1f} s; {describe_memory(popen_memory)}")
    print(f"zygote vs popen: {popen_s / zygote_s:.1f}x faster to listen; USS {statistics.median(m.uss for m in popen_memory) / statistics.median(m.uss for m in zygote_memory):.1f}x "
          f"smaller; total PSS {sum(m.pss for m in zygote_memory):.0f} MB vs {sum(m.pss for m in popen_memory):.0f} MB")
    return report([
        Verdict(f"zygote: {args.envs} servers listening", f"{zygote_s:.1f} s", f"<= {LISTEN_TARGET_S:g} s", zygote_s <= LISTEN_TARGET_S),
        Verdict("zygote: USS per server, max", f"{uss:.1f} MB", f"<= {USS_TARGET_MB:g} MB", uss <= USS_TARGET_MB),
    ])


if __name__ == "__main__":
    sys.exit(main())
