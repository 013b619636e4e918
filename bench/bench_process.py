"""Benchmark: process lanes (``--lane-isolation process``) against thread lanes and the reference.

Three servers as subprocesses (``tests/support/refserver.py``): the reference, ours with
thread lanes, ours with process lanes; one raw wire client keeps one lane-scoped step in
flight per lane (``rlmesh.run``'s pattern without its per-step policy) for a fixed
window, alternating the servers' order from round to round; medians.

Rows: CartPole-v1 at N = 4 (what the pipe and pickling cost per step); ``BusyEnv``
(``tests/support/crashy.py``: a step of ~4 ms of pure-Python work) at N = 2 and 4 (what
escaping the server's GIL buys on this machine's cores); ``FramesEnv`` (210x160x3 uint8
frames) at N = 4 (big observations through the pipe); and, ours only, the time from a
segfault in ``env.step`` to the lane's next reply (``--on-lane-fault rebuild``: a fresh
process is started and builds the env).

Run: ``python bench/bench_process.py [--rounds R] [--quick]``. Noisy on a shared 2-core
VM: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import _support  # noqa: F401  (the test harness as ``support``: see bench/_support.py)
from support import wire
from support.crashy import FRAMES_SEGFAULT
from support.refserver import ServerConfig, start_server

ROOT = Path(__file__).resolve().parent.parent

SERVERS = {
    "reference": ("ref", ()),
    "thread lanes": ("ours", ()),
    "process lanes": ("ours", ("--lane-isolation", "process")),
}


async def throughput(address: str, lanes: int, seconds: float) -> float:
    async with wire.WireClient(address) as client, client.join() as join:
        await join.call(wire.reset(seeds=list(range(lanes))))
        started = time.perf_counter()
        deadline = started + seconds
        for lane in range(lanes):
            await join.send(wire.step([wire.i64([1])], env_indices=[lane], request_id=f"s{lane}"))
        in_flight, done = lanes, 0
        while in_flight:
            reply = await join.recv(timeout=30)
            assert reply is not None and reply.error is None, reply
            in_flight -= 1
            lane = int(reply.request_id[1:])
            if reply.step is not None:
                done += 1
                if reply.step.terminated_mask != b"\x00" or reply.step.truncated_mask != b"\x00":
                    await join.send(wire.reset(env_indices=[lane], request_id=f"r{lane}"))
                    in_flight += 1
                    continue
            if time.perf_counter() < deadline:
                await join.send(
                    wire.step([wire.i64([1])], env_indices=[lane], request_id=f"s{lane}")
                )
                in_flight += 1
        elapsed = time.perf_counter() - started
        await join.call(wire.close())
    return done / elapsed


def bench(rounds: int, seconds: float) -> list[tuple[str, dict[str, float]]]:
    rows = []
    for label, entrypoint, lanes in (
        ("CartPole-v1, N=4", "support.envs:make_cartpole", 4),
        ("BusyEnv (~4 ms pure Python), N=2", "support.crashy:make_busy", 2),
        ("BusyEnv (~4 ms pure Python), N=4", "support.crashy:make_busy", 4),
        ("FramesEnv (210x160x3 uint8), N=4", "support.crashy:make_frames", 4),
    ):
        servers = {}
        try:
            for name, (kind, extra) in SERVERS.items():
                config = ServerConfig(entrypoint=entrypoint, num_envs=lanes, ours_args=extra)
                servers[name] = start_server(kind, config)  # type: ignore[arg-type]
            values: dict[str, list[float]] = {name: [] for name in servers}
            for r in range(rounds):
                names = list(servers)
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    values[name].append(
                        asyncio.run(throughput(servers[name].address, lanes, seconds))
                    )
        finally:
            for server in servers.values():
                server.stop()
        rows.append((label, {name: statistics.median(v) for name, v in values.items()}))
    return rows


async def segfault_recoveries(address: str, count: int) -> list[float]:
    out = []
    async with wire.WireClient(address) as client, client.join() as join:
        for k in range(count):
            await join.call(wire.reset(seeds=[k], env_indices=[0]))
            reply = await join.call(wire.step([wire.i64([FRAMES_SEGFAULT])], env_indices=[0]))
            assert reply.error is not None, reply
            t0 = time.perf_counter()
            reply = await join.call(wire.reset(seeds=[k], env_indices=[0]))
            out.append(time.perf_counter() - t0)
            assert reply.reset is not None, reply
            # A step that succeeds proves the rebuilt lane: without it, the next segfault
            # would count as a storm of faults in a row and be answered with a backoff.
            reply = await join.call(wire.step([wire.i64([0])], env_indices=[0]))
            assert reply.step is not None, reply
    return out


def segfault_row(count: int) -> list[float]:
    config = ServerConfig(
        entrypoint="support.crashy:make_frames",
        num_envs=2,
        ours_args=("--lane-isolation", "process", "--on-lane-fault", "rebuild"),
    )
    server = start_server("ours", config)
    try:
        return sorted(asyncio.run(segfault_recoveries(server.address, count)))
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 1 s")
    args = parser.parse_args(argv)
    rounds, seconds = (3, 1.0) if args.quick else (args.rounds, 2.0)
    print(
        "| workload (steps/s) | reference | thread lanes | process lanes | process / thread | process / reference |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for label, medians in bench(rounds, seconds):
        ref, thread, process = (medians[k] for k in SERVERS)
        print(
            f"| {label} | {ref:.0f} | {thread:.0f} | {process:.0f} | "
            f"{process / thread:.2f} | {process / ref:.2f} |"
        )
    times = segfault_row(3 * rounds)
    p50, p90 = times[len(times) // 2], times[min(len(times) - 1, int(0.9 * len(times)))]
    print(
        f"\nsegfault in env.step → lane serving again (process lanes, rebuild): "
        f"p50 {1000 * p50:.0f} ms, p90 {1000 * p90:.0f} ms over {len(times)} segfaults"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
