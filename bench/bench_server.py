"""Benchmark: rlmesh-trio's server against the reference (rlmesh 0.1.0) under the same clients.

Both servers run as subprocesses started the same way (``tests/support/refserver.py``)
and are driven by the same client code in this process, alternating which one goes
first from round to round; every number is the median over the rounds.

Workloads:

* ``rlmesh.run`` with CartPole-v1 at N = 1, 3 and 8 lanes: env steps/s and episodes/s
  (N = 1 is serial request/reply; N > 1 keeps one lane-scoped request per lane in
  flight, as the 0.1.0 runtime does);
* a raw wire client (``tests/support/wire.py``) stepping CartPole at N = 1, one request
  at a time: round-trip latency of a step, p50 and p99;
* ``rlmesh.run`` on 8 lanes of an env whose step sleeps 2 ms (GIL released): steps/s
  against the ideal N / 2 ms = 4000 steps/s, i.e. how well the lanes overlap.

Run: ``python bench/bench_server.py [--rounds R] [--quick] [--json PATH]``. Numbers on
a shared 2-core VM are noisy: compare the ours/reference ratios of one run, not
absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("RLMESH_WORKFLOW_EDITION", "2026.06")

from support import envs, scripts, wire  # noqa: E402
from support.refserver import ServerConfig, ServerProcess, start_server  # noqa: E402

KINDS = ("ref", "ours")


@dataclass
class Row:
    """One measured quantity, a list of per-round values per server."""

    workload: str
    metric: str
    unit: str
    higher_is_better: bool
    values: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})

    def median(self, kind: str) -> float:
        return statistics.median(self.values[kind]) if self.values[kind] else float("nan")

    def ratio(self) -> float:
        ref = self.median("ref")
        return self.median("ours") / ref if ref else float("nan")


def run_episodes(address: str, kind: scripts.EnvKind, seeds: list[int]) -> tuple[float, int]:
    """Wall time and env steps of ``rlmesh.run`` over ``seeds``."""
    started = time.perf_counter()
    episodes = scripts.run_session(address, kind, seeds)
    return time.perf_counter() - started, sum(e["steps"] for e in episodes)


def run_sleepy(address: str, seeds: list[int]) -> tuple[float, int]:
    import rlmesh
    from rlmesh.numpy import Model

    model = Model(lambda observation: 1)
    started = time.perf_counter()
    result = rlmesh.run(model, address, seeds=seeds)
    return time.perf_counter() - started, result.total_steps


async def step_latencies(address: str, steps: int) -> list[float]:
    """Seconds per step round trip, one CartPole step in flight at a time."""
    out: list[float] = []
    async with wire.WireClient(address) as client, client.join() as join:
        await join.call(wire.configure())
        await join.call(wire.reset(seeds=[0]))
        actions = [[wire.i64([0])], [wire.i64([1])]]
        seed = 0
        while len(out) < steps:
            request = wire.step(actions[len(out) % 2])
            started = time.perf_counter()
            reply = await join.call(request)
            out.append(time.perf_counter() - started)
            assert reply.step is not None, reply
            if reply.step.terminated_mask != b"\x00" or reply.step.truncated_mask != b"\x00":
                seed += 1
                await join.call(wire.reset(seeds=[seed]))
        await join.call(wire.close())
    return out


async def pipelined_lanes(address: str, num_envs: int, seconds: float) -> tuple[float, int]:
    """A lean raw client: one lane-scoped step in flight per lane, for ``seconds``.

    The request pattern is ``rlmesh.run``'s (SPEC §11.3) without its per-step Python
    policy, so it measures what the server can sustain rather than what the client can
    send. Returns (wall seconds, steps answered).
    """
    async with wire.WireClient(address) as client, client.join() as join:
        await join.call(wire.configure())
        await join.call(wire.reset(seeds=list(range(num_envs))))
        action = [wire.i64([1])]
        steps = {
            lane: wire.step(action, env_indices=[lane], request_id=f"s{lane}")
            for lane in range(num_envs)
        }
        resets = {
            lane: wire.reset(env_indices=[lane], request_id=f"r{lane}") for lane in range(num_envs)
        }
        started = time.perf_counter()
        for lane in range(num_envs):
            await join.send(steps[lane])
        done = 0
        deadline = started + seconds
        in_flight = num_envs
        while in_flight:
            reply = await join.recv(timeout=30)
            assert reply is not None and reply.error is None, reply
            in_flight -= 1
            lane = int(reply.request_id[1:])
            if reply.step is not None:
                done += 1
                if reply.step.terminated_mask != b"\x00":
                    await join.send(resets[lane])  # the lane's episode ended: reset it
                    in_flight += 1
                    continue
            if time.perf_counter() < deadline:
                await join.send(steps[lane])
                in_flight += 1
        elapsed = time.perf_counter() - started
        await join.call(wire.close())
    return elapsed, done


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def start_pair(config: ServerConfig) -> dict[str, ServerProcess]:
    return {kind: start_server(kind, config) for kind in KINDS}  # type: ignore[arg-type]


def alternate(round_index: int) -> tuple[str, ...]:
    return KINDS if round_index % 2 == 0 else KINDS[::-1]


def bench(rounds: int, quick: bool) -> list[Row]:
    rows: list[Row] = []
    scale = 1 if quick else 2

    # 1. rlmesh.run on CartPole, N = 1, 3, 8.
    for n in (1, 3, 8):
        seeds = list(range(100, 100 + max(6, 3 * n) * scale))
        steps_row = Row(f"run CartPole N={n}", "steps/s", "1/s", True)
        episodes_row = Row(f"run CartPole N={n}", "episodes/s", "1/s", True)
        servers = start_pair(ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=n))
        try:
            for kind in KINDS:  # warm-up: connections, imports, first-episode costs
                run_episodes(servers[kind].address, "cartpole", seeds[:n])
            for r in range(rounds):
                for kind in alternate(r):
                    seconds, steps = run_episodes(servers[kind].address, "cartpole", seeds)
                    steps_row.values[kind].append(steps / seconds)
                    episodes_row.values[kind].append(len(seeds) / seconds)
        finally:
            for server in servers.values():
                server.stop()
        rows += [steps_row, episodes_row]
        _progress(rows[-2:])

    # 2. Raw wire client, N = 1: step round trip.
    steps = 500 * scale
    p50 = Row("raw step N=1", "round trip p50", "ms", False)
    p99 = Row("raw step N=1", "round trip p99", "ms", False)
    servers = start_pair(ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=1))
    try:
        for kind in KINDS:
            asyncio.run(step_latencies(servers[kind].address, 50))
        for r in range(rounds):
            for kind in alternate(r):
                latencies = asyncio.run(step_latencies(servers[kind].address, steps))
                p50.values[kind].append(percentile(latencies, 50) * 1e3)
                p99.values[kind].append(percentile(latencies, 99) * 1e3)
    finally:
        for server in servers.values():
            server.stop()
    rows += [p50, p99]
    _progress(rows[-2:])

    # 3. 8 lanes whose step sleeps 2 ms, driven by rlmesh.run.
    n = 8
    ideal = n / envs.SLEEP_STEP_SECONDS
    seeds = list(range(2 * n * scale))
    sleepy = Row(f"run SleepEnv(2 ms) N={n}", "steps/s", "1/s", True)
    efficiency = Row(f"run SleepEnv(2 ms) N={n}", f"of ideal {ideal:.0f}/s", "%", True)
    servers = start_pair(ServerConfig(entrypoint=scripts.ENTRYPOINTS["sleep"], num_envs=n))
    try:
        for kind in KINDS:
            run_sleepy(servers[kind].address, seeds[:n])
        for r in range(rounds):
            for kind in alternate(r):
                seconds, total = run_sleepy(servers[kind].address, seeds)
                sleepy.values[kind].append(total / seconds)
                efficiency.values[kind].append(100 * total / seconds / ideal)
    finally:
        for server in servers.values():
            server.stop()
    rows += [sleepy, efficiency]
    _progress(rows[-2:])

    # 4. The same 8 sleepy lanes under a lean pipelined raw client (server capacity).
    raw_sleepy = Row(f"raw SleepEnv(2 ms) N={n}", "steps/s", "1/s", True)
    raw_efficiency = Row(f"raw SleepEnv(2 ms) N={n}", f"of ideal {ideal:.0f}/s", "%", True)
    servers = start_pair(ServerConfig(entrypoint=scripts.ENTRYPOINTS["sleep"], num_envs=n))
    try:
        for kind in KINDS:
            asyncio.run(pipelined_lanes(servers[kind].address, n, 0.3))
        for r in range(rounds):
            for kind in alternate(r):
                seconds, total = asyncio.run(pipelined_lanes(servers[kind].address, n, 1.0 * scale))
                raw_sleepy.values[kind].append(total / seconds)
                raw_efficiency.values[kind].append(100 * total / seconds / ideal)
    finally:
        for server in servers.values():
            server.stop()
    rows += [raw_sleepy, raw_efficiency]
    _progress(rows[-2:])
    return rows


def _progress(rows: list[Row]) -> None:
    for row in rows:
        print(f"  done: {row.workload} / {row.metric}", file=sys.stderr, flush=True)


def table(rows: list[Row]) -> str:
    header = ("workload", "metric", "unit", "reference", "ours", "ours/ref", "better")
    lines = [header]
    for row in rows:
        ratio = row.ratio()
        better = ratio > 1 if row.higher_is_better else ratio < 1
        lines.append(
            (
                row.workload,
                row.metric,
                row.unit,
                _fmt(row.median("ref")),
                _fmt(row.median("ours")),
                f"{ratio:.2f}",
                "ours" if better else "ref",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _fmt(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per workload (median)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads, 3 rounds")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick and args.rounds == 5 else args.rounds
    started = time.monotonic()
    rows = bench(rounds, args.quick)
    print(f"\nrlmesh-trio vs rlmesh 0.1.0, median of {rounds} rounds (alternating order)\n")
    print(table(rows))
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    if args.json is not None:
        payload = [
            {
                "workload": r.workload,
                "metric": r.metric,
                "unit": r.unit,
                "values": r.values,
                "median": {k: r.median(k) for k in KINDS},
                "ratio": r.ratio(),
            }
            for r in rows
        ]
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
