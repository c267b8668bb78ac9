"""Hostile agent traffic against a real farm on loopback: what it holds, and what a bystander pays.

``envscaler farm up`` brings up a process farm of two environments (the bundled library_circulation
and it_helpdesk), once with the Python gateway alone and once with haproxy in front of it. The
attacker connects from 127.0.0.2; a bystander agent calls a read-only tool through the gateway from
127.0.0.1 throughout. Each attack:

- slow heads: ``--connections`` connections each send half a request head and wait;
- unfinished chunked bodies (haproxy farm): 12 connections each send 10 MB of a chunked body that never ends.

(Answers that are never read are tested, with their bound, in tests/test_hostile_traffic.py.)

It prints the connections held, the daemon's (or server's) descriptors and resident memory before,
during and after, and the bystander's p50 before and during. The bounds checked are the stated ones
(servers.transport.http_server.Bounds): the attacker holds at most --per-client connections, the memory held
stays under the bound for what is being read, and every bystander call answers correctly. Exits 1
when one is missed.

    python benchmarks/traffic.py [--connections 3000] [--per-client 1024]
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from common import Verdict, argument_parser, envscaler, report, rss_mb

from envscaler import default_catalog
from servers.farm.gateway.front import GATEWAY_VARIABLE

ATTACKER = "127.0.0.2"
MB = 1024 * 1024


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split("/")[0].rsplit(":", 1)
    return host, int(port)


class Bystander:
    """Calls a read-only tool through the gateway in a loop; latencies by phase, and every answer checked."""

    def __init__(self, gateway: str, env_id: str, token: str) -> None:
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {token}"}) as http:
            scenario = http.get(f"{gateway}/envs/{env_id}/scenarios").json()["scenarios"][0]["task_id"]
            created = http.post(f"{gateway}/envs/{env_id}/episodes", json={"scenario_id": scenario}).json()
        self.url = created["mcp_url"]
        self.phase = "before"
        self.latencies: dict[str, list[float]] = {}
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    reply = http.post(self.url, json=body)
                    ok = reply.status_code == 200 and reply.json()["result"]["tools"]
                except (httpx.HTTPError, ValueError, KeyError):
                    ok = False
                self.latencies.setdefault(self.phase, []).append(time.perf_counter() - started)
                self.failures += not ok
                time.sleep(0.01)

    def p50_ms(self, phase: str) -> float:
        values = self.latencies.get(phase) or [float("nan")]
        return statistics.median(values) * 1000


def slow_heads(gateway: str, count: int) -> tuple[list[socket.socket], int]:
    """Open ``count`` slow connections from the attacker; (those held open, how many were refused at once)."""
    sockets = []
    for _ in range(count):
        try:
            sock = socket.create_connection(address(gateway), timeout=10, source_address=(ATTACKER, 0))
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            continue
        sockets.append(sock)
    time.sleep(1.0)
    poller = select.poll()  # not select(): these descriptors run past FD_SETSIZE
    for sock in sockets:
        poller.register(sock, select.POLLIN)
    answered = {fd for fd, _ in poller.poll(0)}
    refused = [sock for sock in sockets if sock.fileno() in answered]
    for sock in refused:
        sock.close()
    return [sock for sock in sockets if sock not in refused], count - len(sockets) + len(refused)


def farm(root: Path, name: str, env: dict[str, str], per_client: int) -> tuple[Path, dict]:
    catalog = root / name / "farm.json"
    catalog.parent.mkdir(parents=True)
    envscaler("farm", "up", str(default_catalog() / "library_circulation"), str(default_catalog() / "it_helpdesk"),
              "--backend", "process", "--catalog", str(catalog), "--connections-per-client", str(per_client), env=env)
    state = json.loads((catalog.parent / "farm.json.farm" / "state.json").read_text())
    return catalog, {**json.loads(catalog.read_text()), "state": state}


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--connections", type=int, default=3000, help="slow connections the attacker opens (default: 3000)")
    parser.add_argument("--per-client", type=int, default=1024, help="the farm's --connections-per-client (default: 1024)")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    verdicts: list[Verdict] = []
    rows: list[tuple[str, ...]] = []
    with tempfile.TemporaryDirectory(prefix="envscaler-traffic-") as tmp:
        for name, env in (("python", {**os.environ, GATEWAY_VARIABLE: "python"}), ("haproxy", dict(os.environ))):
            catalog, data = farm(Path(tmp), name, env, args.per_client)
            gateway, daemon = data["gateway"], data["state"]["daemon_pid"]
            try:
                endpoint = data["envs"]["library_circulation"]
                with Bystander(gateway, "library_circulation", endpoint["token"]) as bystander:
                    time.sleep(2)
                    before = (fds(daemon), rss_mb(daemon))
                    bystander.phase = "slow heads"
                    held, refused = slow_heads(gateway, args.connections)
                    time.sleep(2)
                    during = (fds(daemon), rss_mb(daemon))
                    for sock in held:
                        sock.close()
                    time.sleep(1)
                    after = (fds(daemon), rss_mb(daemon))
                    rows.append((f"{name}: slow heads", f"{len(held)} held, {refused} refused", f"{before[0]}/{during[0]}/{after[0]}",
                                 f"{before[1]:.0f}/{during[1]:.0f}/{after[1]:.0f}", f"{bystander.p50_ms('before'):.2f}",
                                 f"{bystander.p50_ms('slow heads'):.2f}"))
                    verdicts.append(Verdict(f"{name}: connections the attacker held", f"{len(held)}", f"<= {args.per_client} + 2",
                                            len(held) <= args.per_client + 2))
                    if name == "haproxy":
                        bystander.phase = "chunked bodies"
                        rows.append(chunked(gateway, daemon, bystander))
                        grown = float(rows[-1][3].split("/")[1]) - before[1]
                        verdicts.append(Verdict(f"{name}: daemon's growth, unfinished bodies", f"{grown:.0f} MB", "<= 64 + 30 MB", grown <= 64 + 30))
                    verdicts.append(Verdict(f"{name}: bystander calls failed", f"{bystander.failures}", "0", not bystander.failures))
            finally:
                envscaler("farm", "down", "--catalog", str(catalog))
    print(f"{'attack':<26} {'connections':<22} {'fds before/during/after':<24} {'RSS MB b/d/a':<14} {'bystander p50 ms':>8} {'during':>7}")
    for row in rows:
        print(f"{row[0]:<26} {row[1]:<22} {row[2]:<24} {row[3]:<14} {row[4]:>16} {row[5]:>7}")
    return report(verdicts)


def chunked(gateway: str, daemon: int, bystander: Bystander) -> tuple[str, ...]:
    """12 connections x 10 MB of chunked bodies that never end, through haproxy to the Python gateway."""
    before = (fds(daemon), rss_mb(daemon))
    chunk = b"%x\r\n%s\r\n" % (MB, b"y" * MB)
    attackers, refused = [], 0
    for _ in range(12):
        sock = socket.create_connection(address(gateway), timeout=10, source_address=(ATTACKER, 0))
        sock.sendall(b"POST /envs/library_circulation/episodes HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(10):
                sock.sendall(chunk)
        except OSError:
            refused += 1
        attackers.append(sock)
    time.sleep(1)
    during = (fds(daemon), rss_mb(daemon))
    for sock in attackers:
        with contextlib.suppress(OSError):
            sock.close()
    time.sleep(4)  # the gateway's refusals linger 2 s; its sweep, a second later, gives the memory back
    after = (fds(daemon), rss_mb(daemon))
    return ("haproxy: chunked bodies", f"12 opened, {refused} cut", f"{before[0]}/{during[0]}/{after[0]}",
            f"{before[1]:.0f}/{during[1]:.0f}/{after[1]:.0f}", f"{bystander.p50_ms('slow heads'):.2f}", f"{bystander.p50_ms('chunked bodies'):.2f}")


if __name__ == "__main__":
    sys.exit(main())
