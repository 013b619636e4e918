"""Benchmark: rlmesh-trio's server against the reference (rlmesh 0.1.0) under the same clients.

Both servers run as subprocesses started the same way (``tests/support/refserver.py``)
and are driven by the same client code in this process, alternating which one goes
first from round to round; every number is the median over the rounds.

Workloads:

* ``rlmesh.run`` with CartPole-v1 at N = 1, 3 and 8 lanes: env steps/s and episodes/s
  (N = 1 is serial request/reply; N > 1 keeps one lane-scoped request per lane in
  flight, as the 0.1.0 runtime does);
* ``rlmesh.run`` on 4 lanes of an env with Atari-sized frames (210 x 160 x 3 uint8,
  ``support.envs.ImageEnv``): what the value path costs on big observations;
* a raw wire client (``tests/support/wire.py``) stepping CartPole at N = 1, one request
  at a time: round-trip latency of a step, p50 and p99;
* ``rlmesh.run`` on 8 lanes of an env whose step sleeps 2 ms (GIL released): steps/s
  against the ideal N / 2 ms = 4000 steps/s, i.e. how well the lanes overlap;
* the same 8 sleepy lanes under a lean pipelined raw client (server capacity).

Every workload also reports the **server's CPU per env step**, user and system µs apart
(all threads of the server process, from ``/proc/<pid>/stat``, over the round), and its
**voluntary context switches per step** (summed over its threads' ``/proc/<pid>/task/*/
status``): on a shared machine these move much less than throughput, which depends on
what else runs. The 1-minute load average before and after the run is printed with the
table.

``--gil DIR`` writes a py-spy ``--gil --threads`` profile (collapsed stacks) of our
server over its first measured round of each workload into ``DIR`` (skipped, with a
note, when ``py-spy`` is not on PATH; it is pinned in the ``dev`` extra).
``--baseline SRC`` puts our server run from another ``src`` tree (``git archive`` of an
earlier commit) in the reference's column: a same-run A/B of one change.
``--lanes 8`` picks the CartPole workload's lane counts; ``--ours-args "--lane-isolation
process"`` passes options to our server(s).

``--profile`` prints the phases of one CartPole step instead (raw client, N = 1): the
round trip, the server's own timing fields (SPEC §8: endpoint total, action decode, env
call, encode, lane queue), what is left for transport and client, and the server CPU.

Run: ``python bench/bench_server.py [--rounds R] [--quick] [--only W,...] [--lanes N,...]
[--profile] [--gil DIR] [--baseline SRC] [--json PATH]``. Numbers on a shared 2-core VM are noisy: compare the ours/reference
ratios of one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _support  # noqa: F401  (the test harness as ``support``: see bench/_support.py)
from _common import CpuMeter, ServerUsage, server_usage
from support import envs, scripts, wire
from support.refserver import ServerConfig, ServerProcess, start_server

ROOT = Path(__file__).resolve().parent.parent

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


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` used so far (Linux ``/proc``)."""
    usage = server_usage(pid)
    return usage.user + usage.sys


class GilProfile:
    """``--gil DIR``: a py-spy ``--gil`` profile of our server over its first measured
    round of each workload (collapsed stacks, ``--format raw``: any flame-graph tool reads them); nothing when py-spy is not installed."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.exe = shutil.which("py-spy") if directory is not None else None
        if directory is not None and self.exe is None:
            print("--gil: py-spy not found on PATH; no profile", file=sys.stderr)
        self.taken: set[str] = set()

    def start(self, workload: str, pid: int) -> subprocess.Popen[bytes] | None:
        if self.exe is None or self.directory is None or workload in self.taken:
            return None
        self.taken.add(workload)
        self.directory.mkdir(parents=True, exist_ok=True)
        name = "".join(c if c.isalnum() else "-" for c in workload).strip("-")
        out = self.directory / f"{name}.txt"
        cmd = [self.exe, "record", "--gil", "--threads", "--rate", "500", "--format", "raw"]
        cmd += ["--pid", str(pid), "-o", str(out)]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @staticmethod
    def stop(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is None:
            return
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


GIL = GilProfile(None)


def run_episodes(address: str, kind: scripts.EnvKind, seeds: list[int]) -> tuple[float, int]:
    """Wall time and env steps of ``rlmesh.run`` over ``seeds``."""
    started = time.perf_counter()
    episodes = scripts.run_session(address, kind, seeds)
    return time.perf_counter() - started, sum(e["steps"] for e in episodes)


def run_constant(address: str, seeds: list[int]) -> tuple[float, int]:
    """``rlmesh.run`` with a policy that always plays action 1: wall time, env steps."""
    import rlmesh
    from rlmesh.numpy import Model

    model = Model(lambda observation: 1)
    started = time.perf_counter()
    result = rlmesh.run(model, address, seeds=seeds)
    return time.perf_counter() - started, result.total_steps


PHASES = ("endpoint_total_ns", "decode_ns", "user_ns", "encode_ns", "queue_ns")


async def step_latencies(
    address: str, steps: int, phases: dict[str, list[float]] | None = None
) -> list[float]:
    """Seconds per step round trip, one CartPole step in flight at a time; the replies'
    timing fields (seconds) are appended to ``phases`` when given."""
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
            if phases is not None:
                for name in PHASES:
                    value = getattr(reply, name)
                    phases.setdefault(name, []).append((value or 0) / 1e9)
                phases.setdefault("round trip", []).append(out[-1])
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


BASELINE: Path | None = None
"""``--baseline SRC``: the "reference" column is our server run from the ``src`` tree
``SRC`` (e.g. ``git archive`` of an earlier commit): a same-run A/B of one change."""


OURS_ARGS: tuple[str, ...] = ()
"""``--ours-args "..."``: extra ``serve`` options of our server(s), e.g. process lanes."""


def start_pair(config: ServerConfig) -> dict[str, ServerProcess]:
    config = dataclasses.replace(config, ours_args=(*config.ours_args, *OURS_ARGS))
    if BASELINE is None:
        return {kind: start_server(kind, config) for kind in KINDS}  # type: ignore[arg-type]
    path = os.pathsep.join((str(ROOT / "tests"), str(BASELINE)))
    base = dataclasses.replace(config, env=(*config.env, ("PYTHONPATH", path)))
    return {"ref": start_server("ours", base), "ours": start_server("ours", config)}


def alternate(round_index: int) -> tuple[str, ...]:
    return KINDS if round_index % 2 == 0 else KINDS[::-1]


def measure(
    config: ServerConfig,
    rounds: int,
    workload: Callable[[str], tuple[float, int]],
    record: Callable[[str, float, int, ServerUsage], None],
    warm_up: Callable[[str], object],
    name: str = "",
) -> None:
    """Start both servers; warm each up; then ``rounds`` alternating rounds of
    ``workload(address) -> (seconds, steps)``, each passed to ``record(kind, seconds,
    steps, server usage)``."""
    servers = start_pair(config)
    try:
        for kind in KINDS:  # warm-up: connections, imports, first-episode costs
            warm_up(servers[kind].address)
        for r in range(rounds):
            for kind in alternate(r):
                server = servers[kind]
                spy = GIL.start(name, server.pid) if kind == "ours" else None
                try:
                    with CpuMeter(server.pid) as meter:
                        seconds, steps = workload(server.address)
                finally:
                    GIL.stop(spy)
                record(kind, seconds, steps, meter.usage)
    finally:
        for server in servers.values():
            server.stop()


def cpu_rows(workload: str) -> list[Row]:
    """Server user and system CPU µs per step, and voluntary context switches per step."""
    return [
        Row(workload, "server user CPU/step", "µs", False),
        Row(workload, "server sys CPU/step", "µs", False),
        Row(workload, "server vol. ctx sw/step", "1", False),
    ]


def record_usage(rows: list[Row], kind: str, usage: ServerUsage, steps: int) -> None:
    user, system, switches = rows
    user.values[kind].append(usage.user / steps * 1e6)
    system.values[kind].append(usage.sys / steps * 1e6)
    switches.values[kind].append(usage.voluntary / steps)


WORKLOADS = ("cartpole", "image", "raw", "sleepy", "raw-sleepy")


def bench(
    rounds: int, quick: bool, only: set[str] | None = None, lanes: tuple[int, ...] = (1, 3, 8)
) -> list[Row]:
    rows: list[Row] = []
    scale = 1 if quick else 2

    def wanted(name: str) -> bool:
        return only is None or name in only

    def throughput_rows(name: str, extra: Row | None = None, ideal: float = 0.0) -> Any:
        steps_row = Row(name, "steps/s", "1/s", True)
        cpu = cpu_rows(name)
        new = [steps_row, *cpu] + ([extra] if extra is not None else [])

        def record(kind: str, seconds: float, steps: int, usage: ServerUsage) -> None:
            steps_row.values[kind].append(steps / seconds)
            record_usage(cpu, kind, usage, steps)
            if extra is not None:
                extra.values[kind].append(100 * steps / seconds / ideal)

        return new, record

    # 1. rlmesh.run on CartPole, N = 1, 3, 8.
    if wanted("cartpole"):
        for n in lanes:
            seeds = list(range(100, 100 + max(6, 3 * n) * scale))
            new, record = throughput_rows(f"run CartPole N={n}")
            measure(
                ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=n),
                rounds,
                lambda address, seeds=seeds: run_episodes(address, "cartpole", seeds),
                record,
                lambda address, n=n, seeds=seeds: run_episodes(address, "cartpole", seeds[:n]),
                new[0].workload,
            )
            rows += new
            _progress(new)

    # 2. rlmesh.run on 4 lanes of Atari-sized frames.
    if wanted("image"):
        n = 4
        seeds = list(range(2 * n * scale))
        h, w, c = envs.IMAGE_SHAPE
        new, record = throughput_rows(f"run ImageEnv {h}x{w}x{c} u8 N={n}")
        measure(
            ServerConfig(entrypoint=scripts.ENTRYPOINTS["image"], num_envs=n),
            rounds,
            lambda address: run_constant(address, seeds),
            record,
            lambda address: run_constant(address, seeds[:n]),
            new[0].workload,
        )
        rows += new
        _progress(new)

    # 3. Raw wire client, N = 1: step round trip.
    if wanted("raw"):
        steps = 500 * scale
        p50 = Row("raw step N=1", "round trip p50", "ms", False)
        p99 = Row("raw step N=1", "round trip p99", "ms", False)
        cpu = cpu_rows("raw step N=1")

        last: list[float] = []

        def raw_round(address: str) -> tuple[float, int]:
            last[:] = asyncio.run(step_latencies(address, steps))
            return sum(last), len(last)

        def raw_record(kind: str, seconds: float, count: int, usage: ServerUsage) -> None:
            p50.values[kind].append(percentile(last, 50) * 1e3)
            p99.values[kind].append(percentile(last, 99) * 1e3)
            record_usage(cpu, kind, usage, count)

        measure(
            ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=1),
            rounds,
            raw_round,
            raw_record,
            lambda address: asyncio.run(step_latencies(address, 50)),
            "raw step N=1",
        )
        rows += [p50, p99, *cpu]
        _progress([p50, p99, *cpu])

    # 4. 8 lanes whose step sleeps 2 ms, driven by rlmesh.run.
    n = 8
    ideal = n / envs.SLEEP_STEP_SECONDS
    sleep_config = ServerConfig(entrypoint=scripts.ENTRYPOINTS["sleep"], num_envs=n)
    if wanted("sleepy"):
        seeds = list(range(2 * n * scale))
        name = f"run SleepEnv(2 ms) N={n}"
        new, record = throughput_rows(name, Row(name, f"of ideal {ideal:.0f}/s", "%", True), ideal)
        measure(
            sleep_config,
            rounds,
            lambda address: run_constant(address, seeds),
            record,
            lambda address: run_constant(address, seeds[:n]),
            new[0].workload,
        )
        rows += new
        _progress(new)

    # 5. The same 8 sleepy lanes under a lean pipelined raw client (server capacity).
    if wanted("raw-sleepy"):
        name = f"raw SleepEnv(2 ms) N={n}"
        new, record = throughput_rows(name, Row(name, f"of ideal {ideal:.0f}/s", "%", True), ideal)
        measure(
            sleep_config,
            rounds,
            lambda address: asyncio.run(pipelined_lanes(address, n, 1.0 * scale)),
            record,
            lambda address: asyncio.run(pipelined_lanes(address, n, 0.3)),
            new[0].workload,
        )
        rows += new
        _progress(new)
    return rows


def profile(rounds: int, steps: int) -> str:
    """The phases of one CartPole step (raw client, N = 1), µs, medians over all steps."""
    phases: dict[str, dict[str, list[float]]] = {kind: {} for kind in KINDS}
    cpu: dict[str, list[float]] = {kind: [] for kind in KINDS}

    def record(kind: str, seconds: float, count: int, usage: ServerUsage) -> None:
        cpu[kind].append((usage.user + usage.sys) / count * 1e6)

    current: list[str] = []

    def workload(address: str) -> tuple[float, int]:
        kind = current.pop(0)
        latencies = asyncio.run(step_latencies(address, steps, phases[kind]))
        return sum(latencies), len(latencies)

    config = ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=1)
    servers = start_pair(config)
    try:
        for kind in KINDS:
            asyncio.run(step_latencies(servers[kind].address, 50))
        for r in range(rounds):
            for kind in alternate(r):
                current.append(kind)
                with CpuMeter(servers[kind].pid) as meter:
                    seconds, count = workload(servers[kind].address)
                record(kind, seconds, count, meter.usage)
    finally:
        for server in servers.values():
            server.stop()

    def med(kind: str, name: str) -> float:
        return statistics.median(phases[kind][name]) * 1e6

    labels = [
        ("round trip (client)", lambda k: med(k, "round trip")),
        ("  server: endpoint total", lambda k: med(k, "endpoint_total_ns")),
        ("    action decode", lambda k: med(k, "decode_ns")),
        ("    env call (user)", lambda k: med(k, "user_ns")),
        ("    encode", lambda k: med(k, "encode_ns")),
        ("    lane queue", lambda k: med(k, "queue_ns")),
        (
            "  transport + client (round trip - endpoint total)",
            lambda k: (
                statistics.median(
                    rt - total
                    for rt, total in zip(
                        phases[k]["round trip"], phases[k]["endpoint_total_ns"], strict=True
                    )
                )
                * 1e6
            ),
        ),
        ("server CPU/step", lambda k: statistics.median(cpu[k])),
    ]
    width = max(len(label) for label, _ in labels)
    lines = [f"{'phase (µs, median)':{width}}  {'reference':>9}  {'ours':>9}"]
    for label, value in labels:
        lines.append(f"{label:{width}}  {value('ref'):9.1f}  {value('ours'):9.1f}")
    return "\n".join(lines)


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
    parser.add_argument(
        "--only", default=None, help=f"comma-separated workloads of {','.join(WORKLOADS)}"
    )
    parser.add_argument(
        "--profile", action="store_true", help="print the per-phase µs of a CartPole step"
    )
    parser.add_argument(
        "--lanes", default="1,3,8", help="the CartPole workload's lane counts (default 1,3,8)"
    )
    parser.add_argument(
        "--gil",
        type=Path,
        default=None,
        metavar="DIR",
        help="py-spy --gil flame graphs of our server (first round of each workload) into DIR",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="SRC",
        help="compare with our server from this src tree instead of the reference",
    )
    parser.add_argument(
        "--ours-args",
        default="",
        help='extra serve options of our server(s), e.g. "--lane-isolation process"',
    )
    args = parser.parse_args(argv)
    global GIL, BASELINE, OURS_ARGS
    OURS_ARGS = tuple(args.ours_args.split())
    GIL = GilProfile(args.gil)
    BASELINE = args.baseline.resolve() if args.baseline is not None else None
    rounds = 3 if args.quick and args.rounds == 5 else args.rounds
    started = time.monotonic()
    if args.profile:
        print(f"\nOne CartPole step, raw client, N = 1; {rounds} alternating rounds\n")
        print(profile(rounds, 300 if args.quick else 1000))
        print(f"\ntotal {time.monotonic() - started:.0f} s")
        return 0
    only = None if args.only is None else set(args.only.split(","))
    if only is not None and not only <= set(WORKLOADS):
        parser.error(f"unknown workload(s): {', '.join(sorted(only - set(WORKLOADS)))}")
    load_before = os.getloadavg()
    lanes = tuple(int(n) for n in args.lanes.split(","))
    rows = bench(rounds, args.quick, only, lanes)
    load_after = os.getloadavg()
    against = (
        "rlmesh 0.1.0" if BASELINE is None else f"rlmesh-trio from {BASELINE} (as 'reference')"
    )
    print(f"\nrlmesh-trio vs {against}, median of {rounds} rounds (alternating order)")
    print(
        "load average (1 min) before / after: "
        f"{load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} CPUs"
        + (
            "  -- a loaded machine: trust the CPU rows over steps/s"
            if max(load_before[0], load_after[0]) >= 1.5
            else ""
        )
        + "\n"
    )
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
