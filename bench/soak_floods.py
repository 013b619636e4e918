"""Soak: our server under HTTP/2 floods, one connection after another, for minutes.

One rlmesh-trio server (``rlmesh-trio serve --env CartPole-v1 --num-envs 2``, a
subprocess started by ``tests/support/refserver.py``) takes, for ``--minutes``, a cycle
of floods (issue 28, rows 1-3), each on a fresh connection, each written from a
background thread (``tests/support/h2raw.py``) with every write bounded:

* ``rapid-reset`` -- 20,000 HEADERS + RST_STREAM pairs on the health path, 100 a write;
* ``empty-data`` -- 200,000 empty DATA frames on a Join stream;
* ``ping`` / ``settings`` / ``window-update`` -- 100,000 control frames;
* ``continuation-hold`` -- a header block that never ends (HEADERS and 62 CONTINUATION
  frames of 16,000 bytes, issue 43);
* ``closed-stream-data`` -- 300,000 DATA(END_STREAM) frames on a health check's stream
  once it is answered (issue 43);
* ``distributed`` -- every ``--distributed-every`` rounds, ``--distributed-connections``
  (100) connections at once, each writing PINGs at 90 % of our per-connection rate for
  ``--distributed-seconds`` (5): each under its own limits, together past the server's
  budget (issue 43, row 3; ``bench/soak_distributed.py``); every one must be closed, and
  the bystander's Handshakes in its window are reported apart;

alternately by a client that reads the server's answers and one that never does (a
16 KiB receive buffer). Each flood is expected to end with the server closing the
connection (GOAWAY ENHANCE_YOUR_CALM where it can be read) within 5 s. Meanwhile
another client does a Handshake every 0.1 s on a connection of its own.

Reported: floods run and how each ended (GOAWAY code, closed or not, seconds to the
close); the bystander's Handshakes: count, failures, p50 / p99 / worst latency; the
server's RSS (``/proc/PID/status`` VmRSS) before anything, at start (after one warm-up
round of every flood, a distributed one included: first-use allocations are not growth),
max, end. Exit status 1
when the worst Handshake took ``--latency-bound`` (1 s) or more, a Handshake failed, a
flood did not get the connection closed, or the RSS at the end is more than
``--rss-slack-mib`` (8) over the start; else 0.

Run: ``python bench/soak_floods.py [--minutes M] [--rss-slack-mib MIB]
[--latency-bound S] [--json PATH]`` (``nox -s soak -- --minutes 2``); Linux (/proc).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _support  # noqa: F401  (the test harness as ``support``: see bench/_support.py)
from _common import rss_mib
from soak_distributed import flood as distributed_flood
from support import h2raw
from support.refserver import ServerConfig, ServerProcess, start_server

from rlmesh_trio._transport._flood import CONTROL_FRAMES_PER_SECOND, SERVER_BUDGETS

ROOT = Path(__file__).resolve().parent.parent

JOIN = "/rlmesh.env.v1.EnvService/Join"

RAPID_RESET_PAIRS = 20_000
EMPTY_FRAMES = 200_000
CONTROL_FRAMES = 100_000

CLOSE_BOUND = 5.0
"""Seconds from a flood's first write until the server must have closed the connection."""

SMALL_RCVBUF = 16 << 10
"""The receive buffer of the client that never reads."""

DISTRIBUTED_SURVIVORS = int(SERVER_BUDGETS["control"][1] // (0.9 * CONTROL_FRAMES_PER_SECOND))
"""Distributed flooders the server may keep serving: as many as its control-frame rate
takes at 90 % of each one's own."""

PAUSE = 0.2
"""Seconds between two floods (the next connection)."""


@dataclass(frozen=True)
class FloodKind:
    name: str
    setup: bytes
    """Sent right after the preface, before the flood."""
    chunks: Callable[[], list[bytes]]
    settled: bool = False
    """The server's SETTINGS read and acknowledged before the flood, and no frame sent
    in it but the flood's (a header block allows nothing in between: an ACK there would
    be the client's protocol error)."""


FLOODS = [
    FloodKind(
        "rapid-reset",
        b"",
        lambda: h2raw.rapid_reset_pairs(RAPID_RESET_PAIRS, h2raw.HEALTH_CHECK),
    ),
    FloodKind(
        "empty-data",
        h2raw.headers(1, JOIN),
        lambda: h2raw.empty_data_frames(1, EMPTY_FRAMES),
    ),
    FloodKind(
        # HEADERS then CONTINUATION frames that never end the block (issue 43, row 1)
        "continuation-hold",
        b"",
        lambda: (
            [h2raw.frame(h2raw.HEADERS, 1, b"\x00" * 16_000)]
            + [h2raw.frame(h2raw.CONTINUATION, 1, b"\x00" * 16_000)] * 62
        ),
        settled=True,
    ),
    FloodKind(
        # DATA(END_STREAM) on a stream the server answered and closed (issue 43, row 5)
        "closed-stream-data",
        h2raw.headers(1, h2raw.HEALTH_CHECK)
        + h2raw.data(1, h2raw.grpc_message(b""), end_stream=True),
        lambda: [h2raw.data(1, b"x", end_stream=True) * 1000] * 300,
    ),
    FloodKind("ping", b"", lambda: h2raw.control_frames("ping", CONTROL_FRAMES)),
    FloodKind("settings", b"", lambda: h2raw.control_frames("settings", CONTROL_FRAMES)),
    FloodKind("window-update", b"", lambda: h2raw.control_frames("window_update", CONTROL_FRAMES)),
]


@dataclass
class FloodResult:
    kind: str
    reads: bool
    outcome: str | None
    """The writer's: sent (all of it), reset (the server closed it midway), stalled."""
    closed_after: float | None
    """Seconds from the first write to the server's close (None: not within the bound)."""
    goaway: int | None
    """The GOAWAY's error code, if one could be read."""
    how: str | None
    """How the connection ended as the client saw it: eof (FIN) or reset (RST)."""

    @property
    def ok(self) -> bool:
        """Closed within the bound, with GOAWAY(ENHANCE_YOUR_CALM) -- or, for a client
        that never read, no GOAWAY left to read."""
        if self.closed_after is None:
            return False
        if self.reads:
            return self.goaway == h2raw.ENHANCE_YOUR_CALM
        return self.goaway in (None, h2raw.ENHANCE_YOUR_CALM)


def one_flood(
    server: ServerProcess, kind: FloodKind, chunks: list[bytes], reads: bool
) -> FloodResult:
    """One flood on a fresh connection; wait (bounded) for the server to close it."""
    with h2raw.Connection(server.address, rcvbuf=None if reads else SMALL_RCVBUF) as conn:
        conn.start(then=kind.setup)
        if kind.settled:
            conn.read_until(lambda: conn.reader.settings_received > 0, 2.0)
            conn.send(conn.owed_acks())
            conn.ack_settings = False
        started = time.monotonic()
        with h2raw.Flood(conn, chunks, read=reads) as writer:
            writer.wait(CLOSE_BOUND)
        remaining = max(0.0, started + CLOSE_BOUND - time.monotonic())
        if reads:
            conn.read_until_closed(remaining)
        else:
            conn.wait_peer_closed(remaining)
        closes = [
            at
            for at in (
                writer.ended_at if writer.outcome == "reset" else None,
                conn.closed_at,
                conn.hung_up_at,
            )
            if at is not None
        ]
        if closes:
            conn.read_until_closed(2.0)  # what is left: the GOAWAY, if it is there to read
        return FloodResult(
            kind.name,
            reads,
            writer.outcome,
            min(closes) - started if closes else None,
            conn.goaway_code,
            conn.closed or conn.hung_up or (writer.outcome if writer.outcome == "reset" else None),
        )


def run_round(
    server: ServerProcess,
    chunks: dict[str, list[bytes]],
    results: list[FloodResult],
    reads: bool,
    rss: list[float],
    deadline: float | None = None,
) -> None:
    """Every flood once (each by a client that reads, or one that never does)."""
    for kind in FLOODS:
        if deadline is not None and time.monotonic() >= deadline:
            return
        result = one_flood(server, kind, chunks[kind.name], reads)
        results.append(result)
        rss.append(rss_mib(server.pid))
        if not result.ok:
            print(f"  flood not answered as expected: {asdict(result)}", file=sys.stderr)
        time.sleep(PAUSE)


@dataclass
class DistributedResult:
    connections: int
    closed: int
    latencies: list[float]
    """The bystander's Handshakes that ended within the flood's window."""

    @property
    def ok(self) -> bool:
        """Every connection closed but those that fit in the server's rate together
        (a few at 90 % of their own rate are served, as one alone always is)."""
        return self.connections - self.closed <= DISTRIBUTED_SURVIVORS


def run_distributed(
    server: ServerProcess, bystander: h2raw.Bystander, args: argparse.Namespace
) -> DistributedResult:
    """The distributed flood once; the bystander's Handshakes of its window apart."""
    first = len(bystander.latencies)
    outcome = distributed_flood(
        server.address, args.distributed_connections, args.distributed_seconds, 0.9
    )
    result = DistributedResult(
        outcome["connections"], outcome["closed"], list(bystander.latencies[first:])
    )
    if not result.ok:
        print(
            f"  distributed flood: {result.closed} of {result.connections} closed", file=sys.stderr
        )
    time.sleep(PAUSE)
    return result


def summary(values: list[float]) -> dict[str, float]:
    return {
        "count": len(values),
        "p50": h2raw.percentile(values, 0.50),
        "p99": h2raw.percentile(values, 0.99),
        "worst": max(values, default=0.0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    parser.add_argument(
        "--rss-slack-mib",
        type=float,
        default=8.0,
        help="RSS growth (end - start, MiB) that fails the soak (default 8)",
    )
    parser.add_argument(
        "--latency-bound",
        type=float,
        default=1.0,
        help="a bystander Handshake this slow (seconds) fails the soak (default 1)",
    )
    parser.add_argument("--num-envs", type=int, default=2)
    parser.add_argument(
        "--distributed-every",
        type=int,
        default=5,
        help="rounds between two distributed floods (default 5; 0: none)",
    )
    parser.add_argument("--distributed-connections", type=int, default=100)
    parser.add_argument("--distributed-seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if not Path("/proc/self/status").exists():
        parser.error("needs /proc (Linux)")

    chunks = {kind.name: kind.chunks() for kind in FLOODS}
    server = start_server("ours", ServerConfig(env_id="CartPole-v1", num_envs=args.num_envs))
    results: list[FloodResult] = []
    distributed: list[DistributedResult] = []
    rss: list[float] = []
    began = time.monotonic()
    try:
        rss_before = rss_mib(server.pid)
        print(f"serving on {server.address} (pid {server.pid}), RSS {rss_before:.1f} MiB")
        with h2raw.Bystander(server.address, interval=0.1) as bystander:
            warmup: list[FloodResult] = []
            run_round(server, chunks, warmup, True, [])
            run_round(server, chunks, warmup, False, [])
            results += warmup
            if args.distributed_every:  # its first-use allocations (100 connections) too
                distributed.append(run_distributed(server, bystander, args))
            rss_start = rss_mib(server.pid)
            rss.append(rss_start)
            deadline = began + args.minutes * 60
            rounds = 0
            while time.monotonic() < deadline:
                run_round(server, chunks, results, rounds % 2 == 0, rss, deadline)
                rounds += 1
                every = args.distributed_every
                if every and rounds % every == 0 and time.monotonic() < deadline:
                    distributed.append(run_distributed(server, bystander, args))
                    rss.append(rss_mib(server.pid))
                if rounds % 10 == 0:
                    elapsed = (time.monotonic() - began) / 60
                    report = bystander.report()
                    print(
                        f"  {elapsed:5.1f} min: {len(results)} floods, RSS {rss[-1]:.1f} MiB, "
                        f"Handshakes {report.count} (worst {report.worst * 1000:.0f} ms, "
                        f"{len(report.failures)} failed)",
                        flush=True,
                    )
            report = bystander.stop()
        time.sleep(1.0)
        rss_end = rss_mib(server.pid)
        rss.append(rss_end)
    finally:
        code = server.stop()
    log = server.log()

    latencies = summary(report.latencies)
    floods = Counter((r.kind, r.reads) for r in results)
    not_closed = [r for r in results if not r.ok] + [d for d in distributed if not d.ok]
    growth = rss_end - rss_start
    failed = {
        "latency": latencies["worst"] >= args.latency_bound,
        "handshake failures": bool(report.failures),
        "floods not answered GOAWAY(ENHANCE_YOUR_CALM) and close": bool(not_closed),
        "rss growth": growth > args.rss_slack_mib,
    }
    print(f"\nsoak: {(time.monotonic() - began) / 60:.1f} min, {len(results)} floods")
    for kind in FLOODS:
        for reads in (True, False):
            done = [r for r in results if r.kind == kind.name and r.reads == reads]
            closes = [r.closed_after for r in done if r.closed_after is not None]
            codes = Counter((r.goaway, r.how) for r in done)
            print(
                f"  {kind.name:14} {'reads' if reads else 'never reads':12} "
                f"{floods[(kind.name, reads)]:5} floods, closed {len(closes):5}, "
                f"worst close {max(closes, default=0.0):.3f} s, (GOAWAY code, end) {dict(codes)}"
            )
    window = summary([x for d in distributed for x in d.latencies])
    print(
        f"  {'distributed':14} {'reads':12} {len(distributed):5} floods of "
        f"{args.distributed_connections} connections, closed "
        f"{sum(d.closed for d in distributed)} of "
        f"{sum(d.connections for d in distributed)}; bystander in their windows: "
        f"{window['count']} Handshakes, p50 {window['p50'] * 1000:.1f} ms, "
        f"p99 {window['p99'] * 1000:.1f} ms, worst {window['worst'] * 1000:.1f} ms"
    )
    print(
        f"bystander Handshakes: {latencies['count']}, failed {len(report.failures)}, "
        f"p50 {latencies['p50'] * 1000:.1f} ms, p99 {latencies['p99'] * 1000:.1f} ms, "
        f"worst {latencies['worst'] * 1000:.1f} ms"
    )
    for failure in report.failures[:5]:
        print(f"  failed: {failure}")
    print(
        f"RSS: before {rss_before:.1f} MiB, start {rss_start:.1f}, max {max(rss):.1f}, "
        f"end {rss_end:.1f} (growth {growth:+.1f}, slack {args.rss_slack_mib})"
    )
    print(f"server exit code {code}")
    if "Traceback" in log or "Fatal error" in log:
        print("the server logged a traceback:\n" + log[-3000:])
    verdict = [name for name, bad in failed.items() if bad]
    print("FAILED: " + ", ".join(verdict) if verdict else "OK")
    if args.json is not None:
        payload: dict[str, Any] = {
            "minutes": args.minutes,
            "floods": [asdict(r) for r in results],
            "distributed": [
                {"connections": d.connections, "closed": d.closed} for d in distributed
            ],
            "distributed_bystander": window,
            "bystander": {**latencies, "failures": report.failures},
            "rss_mib": {
                "before": rss_before,
                "start": rss_start,
                "max": max(rss),
                "end": rss_end,
                "samples": rss,
            },
            "failed": verdict,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 1 if verdict else 0


if __name__ == "__main__":
    sys.exit(main())
