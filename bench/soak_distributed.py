"""A distributed flood: many connections, each under every limit of its own (issue 43).

For each server (ours, then rlmesh 0.1.0's; each a fresh subprocess serving CartPole-v1
on 2 lanes), ``--connections`` raw HTTP/2 connections (default 150) each write PING
frames at ``--share`` (default 0.9) of our per-connection control-frame rate for
``--seconds`` (default 20), from a few writer threads, while a bystander does a
Handshake every 0.1 s on a connection of its own. Reported per server: the bystander's
Handshakes (count, failures, p50 / p99 / worst), the server's RSS (before, max, end), and
how many flooding connections the server closed. Exit status 1 when our bystander's
worst Handshake took ``--latency-bound`` (1 s) or more or one failed.

Run: ``python bench/soak_distributed.py [--connections N] [--seconds S] [--json PATH]``;
Linux (/proc).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _support  # noqa: F401  (the test harness as ``support``: see bench/_support.py)
from _common import rss_mib
from support import h2raw
from support.refserver import ServerConfig, start_server

from rlmesh_trio._transport._flood import CONTROL_FRAMES_PER_SECOND

TICK = 0.1
"""Seconds between two writes of one connection."""

WRITERS = 6
"""Threads writing the connections' frames (each a slice of them)."""


def flood(address: str, connections: int, seconds: float, share: float) -> dict[str, Any]:
    conns: list[h2raw.Connection] = []
    for _ in range(connections):
        conn = h2raw.Connection(address, timeout=2.0)
        conn.start()
        conns.append(conn)
    per_tick = max(1, int(CONTROL_FRAMES_PER_SECOND * share * TICK))
    burst = h2raw.ping() * per_tick
    dead: set[int] = set()
    stop = time.monotonic() + seconds

    def write(mine: list[int]) -> None:
        next_at = time.monotonic()
        while time.monotonic() < stop:
            for index in mine:
                if index not in dead and conns[index].try_send(burst) is not None:
                    dead.add(index)
            next_at += TICK
            time.sleep(max(0.0, next_at - time.monotonic()))

    def drain() -> None:  # the flooders read (PING ACKs), so their output never backs up
        while time.monotonic() < stop:
            for index, conn in enumerate(conns):
                if index not in dead:
                    conn.pump(0.0, send_acks=False)
                    if conn.closed is not None:
                        dead.add(index)
            time.sleep(0.05)

    threads = [
        threading.Thread(target=write, args=(list(range(k, connections, WRITERS)),), daemon=True)
        for k in range(WRITERS)
    ]
    threads.append(threading.Thread(target=drain, daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 30)
    closed = sum(1 for i, c in enumerate(conns) if i in dead or c.closed is not None)
    calm = sum(1 for c in conns if c.goaway_code == h2raw.ENHANCE_YOUR_CALM)
    for conn in conns:
        conn.close()
    return {"connections": connections, "closed": closed, "goaway_calm": calm}


def one_server(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    server = start_server(kind, ServerConfig(env_id="CartPole-v1", num_envs=2))  # type: ignore[arg-type]
    try:
        rss_before = rss_mib(server.pid)
        peak = [rss_before]
        watching = threading.Event()

        def watch() -> None:
            while not watching.wait(0.5):
                peak.append(rss_mib(server.pid))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        with h2raw.Bystander(server.address, interval=0.1) as bystander:
            outcome = flood(server.address, args.connections, args.seconds, args.share)
            report = bystander.stop()
        watching.set()
        watcher.join()
        time.sleep(2.0)
        rss_end = rss_mib(server.pid)
    finally:
        server.stop()
    latencies = report.latencies
    return {
        "server": kind,
        **outcome,
        "handshakes": len(latencies),
        "failed": len(report.failures),
        "p50_ms": round(h2raw.percentile(latencies, 0.5) * 1000, 1),
        "p99_ms": round(h2raw.percentile(latencies, 0.99) * 1000, 1),
        "worst_ms": round(max(latencies, default=0.0) * 1000, 1),
        "rss_mib": [round(rss_before, 1), round(max(peak), 1), round(rss_end, 1)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=150)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--share", type=float, default=0.9)
    parser.add_argument("--latency-bound", type=float, default=1.0)
    parser.add_argument("--servers", default="ours,ref")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [one_server(kind, args) for kind in args.servers.split(",")]
    for row in rows:
        print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    ours = next((r for r in rows if r["server"] == "ours"), None)
    if ours and (ours["failed"] or ours["worst_ms"] >= args.latency_bound * 1000):
        print("FAILED: our bystander was not served within the bound")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
