"""Memory against the size of a bundle's data file: the server, its environment worker and its check worker.

Benchmark bundles keep their databases in data files of 100 MB and more (``envscaler.data_files``). For
each size, a bundle of the same directory environment (``tests/support/data_bundle.py``) whose two
scenarios name one data file of that size is served by ``envscaler serve`` (sandboxed workers where
bubblewrap works); a client creates an episode of each scenario, changes one user in each, validates
both (the checks read ``initial_state``) and reads one state back (``GET /episodes/{id}/state``). Then
each process's memory is read from /proc: the server's RSS, USS and peak RSS before the state read
(``peak work``) and after it (``peak+read``: the server checks the state's text, then sends it on), the
environment worker's USS and the check worker's PSS, against a baseline with no data file (the same users
inline) measured in the same run.

    python benchmarks/data_memory.py [--sizes 25,50,100] [--no-state-read]

Targets: the server's USS grows by at most 10% of the file's size (it never opens the file), and so
does its peak before the state read; the state read answers (a worker serialises the whole state within the call limit); the
environment worker's growth is at most 8x the file's size (one parsed copy, shared by both scenarios);
the check worker's at most 8x. Exits 1 when one is missed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import Verdict, argument_parser, memory, process_tree, report, start, stop, tree_memory

import httpx

from servers.workers.spawner import worker_name
from tests.support.data_bundle import directory_bundle, users

TOKEN = "bench-token"
NOTE_CHARS = 40
_MB = 1024 * 1024


def _roles(server_pid: int) -> dict[str, int]:
    """The pids of the server's workers, by role (each worker's own process, not a child the check worker
    forked for one validation)."""
    found: dict[str, int] = {}
    for pid in process_tree(server_pid)[1:]:
        for role in ("env worker", "check worker"):
            name = worker_name(role.replace(" ", "_"))
            if _name(pid) == name and _name(_parent(pid)) != name:
                found[role] = pid
    return found


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def measure(root: Path, size_mb: float, read_state: bool) -> dict[str, float]:
    """Serve a bundle whose data file is ``size_mb`` (0: the scenarios hold a few users inline, no file) and
    measure its processes after the episodes' work."""
    # Many small records, as a benchmark's database holds: Python's objects cost several times their text.
    count = int(size_mb * _MB / len(json.dumps(users(1, NOTE_CHARS)))) if size_mb else 5
    bundle = directory_bundle(root / f"size_{size_mb:g}", count=count, padding=NOTE_CHARS, env_id="directory")
    if not size_mb:
        inline = json.loads((bundle / "data" / "users.json").read_text())
        lines = [json.loads(line) for line in (bundle / "scenarios.jsonl").read_text().splitlines()]
        for scenario in lines:
            scenario["init_config"]["users"] = inline
        (bundle / "scenarios.jsonl").write_text("".join(json.dumps(s) + "\n" for s in lines))
        (bundle / "data" / "users.json").unlink()
        (bundle / "data").rmdir()
    file_mb = (bundle / "data" / "users.json").stat().st_size / _MB if size_mb else 0.0
    env = {**os.environ, "ENVSCALER_TOKEN": TOKEN}
    command = [sys.executable, "-m", "servers.cli", str(bundle), "--port", "0", "--log-level", "warning", "--worker-memory-mb", "16384"]
    process, ready = start(command, env)
    try:
        with httpx.Client(base_url=ready["url"], headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as http:
            started = time.perf_counter()
            episodes = [http.post("/episodes", json={"scenario_id": s}).json() for s in ("directory_email", "directory_other")]
            created_s = time.perf_counter() - started
            for number, episode in enumerate(episodes):
                body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                        "params": {"name": "set_email", "arguments": {"user_id": f"user_{number}", "email": "new@example.com"}}}
                reply = http.post(episode["mcp_path"], json=body, headers={"MCP-Protocol-Version": "2026-07-28"})
                assert reply.status_code == 200 and not reply.json()["result"]["isError"], reply.text[:500]
            started = time.perf_counter()
            for episode in episodes:
                validated = http.post(f"/episodes/{episode['episode_id']}/validate")
                assert validated.status_code == 200, validated.text[:500]
            validated_s = time.perf_counter() - started
            work_peak = _peak_rss_mb(process.pid)
            read_problem = ""
            if read_state:
                state = http.get(f"/episodes/{episodes[0]['episode_id']}/state")
                read_problem = "" if state.status_code == 200 else f"{state.status_code}: {state.text[:300]}"
                del state
        roles = _roles(process.pid)
        server = memory(process.pid)
        return {"file_mb": file_mb, "server_rss": server.rss, "server_uss": server.uss, "work_peak": work_peak, "server_peak": _peak_rss_mb(process.pid),
                "env_uss": memory(roles["env worker"]).uss, "check_pss": tree_memory(roles["check worker"]).pss,
                "create_s": created_s, "validate_s": validated_s, "read_problem": read_problem}
    finally:
        stop(process)


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--sizes", default="25,50,100", help="data file sizes in MB, comma-separated")
    parser.add_argument("--no-state-read", dest="read_state", action="store_false", help="skip GET /episodes/{id}/state")
    args = parser.parse_args()
    sizes = [float(size) for size in args.sizes.split(",")]
    verdicts: list[Verdict] = []
    with tempfile.TemporaryDirectory(prefix="envscaler-data-memory-") as folder:
        root = Path(folder)
        base = measure(root, 0, args.read_state)
        print(f"{'file MB':>8} {'server RSS':>10} {'server USS':>10} {'peak work':>9} {'peak+read':>9} {'env USS':>9} {'check PSS':>9} "
              f"{'create s':>8} {'validate s':>10}  (MB)")
        print(f"{'none':>8} {base['server_rss']:>10.1f} {base['server_uss']:>10.1f} {base['work_peak']:>9.1f} {base['server_peak']:>9.1f} "
              f"{base['env_uss']:>9.1f} "
              f"{base['check_pss']:>9.1f} {base['create_s']:>8.2f} {base['validate_s']:>10.2f}")
        for size in sizes:
            row = measure(root, size, args.read_state)
            growth = {name: row[name] - base[name] for name in ("server_rss", "server_uss", "work_peak", "server_peak", "env_uss", "check_pss")}
            print(f"{row['file_mb']:>8.1f} {row['server_rss']:>10.1f} {row['server_uss']:>10.1f} {row['work_peak']:>9.1f} "
                  f"{row['server_peak']:>9.1f} {row['env_uss']:>9.1f} "
                  f"{row['check_pss']:>9.1f} {row['create_s']:>8.2f} {row['validate_s']:>10.2f}   growth: "
                  + ", ".join(f"{name} {value:+.1f}" for name, value in growth.items()))
            file_mb = row["file_mb"]
            if args.read_state:
                verdicts.append(Verdict(f"{file_mb:.0f} MB: state read answered", row["read_problem"][:12] or "200", "200",
                                        not row["read_problem"]))
                if row["read_problem"]:
                    print(f"         the state read failed: {row['read_problem']}")
            verdicts += [
                Verdict(f"{file_mb:.0f} MB: server peak RSS growth before the state read", f"{growth['work_peak']:.1f} MB",
                        f"<= {0.1 * file_mb:.1f} MB", growth["work_peak"] <= 0.1 * file_mb),
                Verdict(f"{file_mb:.0f} MB: server USS growth", f"{growth['server_uss']:.1f} MB", f"<= {0.1 * file_mb:.1f} MB",
                        growth["server_uss"] <= 0.1 * file_mb),
                Verdict(f"{file_mb:.0f} MB: env worker USS growth / file", f"{growth['env_uss'] / file_mb:.2f}x", "<= 8x",
                        growth["env_uss"] <= 8 * file_mb),
                Verdict(f"{file_mb:.0f} MB: check worker PSS growth / file", f"{growth['check_pss'] / file_mb:.2f}x", "<= 8x",
                        growth["check_pss"] <= 8 * file_mb),
            ]
    return report(verdicts)


if __name__ == "__main__":
    sys.exit(main())
