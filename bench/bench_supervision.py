"""Benchmark: lane supervision. What a wedged lane costs the others, how fast a lane recovers.

Both servers run as subprocesses (``tests/support/refserver.py``) serving
``support.faulty:make`` (an episodic counter whose action picks a fault: 2 raises, 3 hangs
for ``RLMESH_FAULTY_HANG_SECONDS``), driven by the raw wire client of
``tests/support/wire.py``.

Rows:

* **healthy lanes while one of 4 is wedged**: steps/s of lanes 0-2 (one lane-scoped step
  in flight per lane) while lane 3 hangs in ``env.step``, as a ratio to the same window
  with lane 3 idle -- per server, alternating which window goes first;
* **fault to serving again** (ours, ``--on-lane-fault rebuild`` and ``truncate``): from
  the reply to a step that raised (an error, or a truncation) to the reply of the next
  reset of that lane, which is the first job of the rebuilt env; next to it a plain
  lane-scoped reset's round trip on the same server (ours and the reference);
* **wedge to serving again** (ours, ``rebuild`` with ``--lane-timeout-seconds 0.2``): from
  sending a step that hangs to the reply of the next reset (watchdog + abandon +
  rebuild).

Run: ``python bench/bench_supervision.py [--rounds R] [--json PATH]``. Noisy on a shared
2-core VM: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import _support  # noqa: F401  (the test harness as ``support``: see bench/_support.py)
from support import wire
from support.faulty import HANG, RAISE
from support.refserver import ServerConfig, start_server

ROOT = Path(__file__).resolve().parent.parent

HANG_SECONDS = 3.0
WINDOW_SECONDS = 2.0


def acts(action: int) -> list[bytes]:
    return [wire.i64([action])]


async def healthy_throughput(address: str, wedge: bool) -> float:
    """Steps/s of lanes 0-2 over one window; lane 3 hangs during it when ``wedge``."""
    async with wire.WireClient(address) as client, client.join() as join:
        for lane in range(4):
            await join.call(wire.reset(seeds=[lane], env_indices=[lane], request_id=f"r{lane}"))
        if wedge:
            await join.send(wire.step(acts(HANG), env_indices=[3], request_id="hang"))
            await asyncio.sleep(0.05)
        started = time.perf_counter()
        deadline = started + WINDOW_SECONDS
        for lane in range(3):
            await join.send(wire.step(acts(0), env_indices=[lane], request_id=f"s{lane}"))
        in_flight, done = 3, 0
        while in_flight:
            reply = await join.recv(timeout=30)
            assert reply is not None, join.end
            if reply.request_id == "hang":
                continue
            assert reply.error is None, reply
            in_flight -= 1
            lane = int(reply.request_id[1:])
            if reply.step is not None:
                done += 1
                if reply.step.terminated_mask != b"\x00":
                    await join.send(wire.reset(env_indices=[lane], request_id=f"r{lane}"))
                    in_flight += 1
                    continue
            if time.perf_counter() < deadline:
                await join.send(wire.step(acts(0), env_indices=[lane], request_id=f"s{lane}"))
                in_flight += 1
        elapsed = time.perf_counter() - started
    return done / elapsed


async def reset_round_trips(address: str, count: int) -> list[float]:
    out = []
    async with wire.WireClient(address) as client, client.join() as join:
        for k in range(count):
            t0 = time.perf_counter()
            reply = await join.call(wire.reset(seeds=[k], env_indices=[1]))
            out.append(time.perf_counter() - t0)
            assert reply.reset is not None, reply
    return out


async def fault_recoveries(address: str, count: int, action: int) -> list[float]:
    """Time from the faulting step's reply (``RAISE``) or from sending it (``HANG``) to
    the reply of the reset that follows, which the rebuilt env serves."""
    out = []
    async with wire.WireClient(address) as client, client.join() as join:
        for k in range(count):
            await join.call(wire.reset(seeds=[k], env_indices=[1]))
            t0 = time.perf_counter()
            await join.call(wire.step(acts(action), env_indices=[1]))
            if action == RAISE:
                t0 = time.perf_counter()
            reply = await join.call(wire.reset(seeds=[k], env_indices=[1]))
            out.append(time.perf_counter() - t0)
            assert reply.reset is not None, reply
    return out


def ms(values: list[float], q: float = 0.5) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench(rounds: int) -> dict[str, Any]:
    env = (("RLMESH_FAULTY_HANG_SECONDS", str(HANG_SECONDS)),)
    results: dict[str, Any] = {}
    ratios: dict[str, list[float]] = {"ref": [], "ours": []}
    base: dict[str, list[float]] = {"ref": [], "ours": []}
    for kind in ("ref", "ours"):
        config = ServerConfig(entrypoint="support.faulty:make", num_envs=4, env=env)
        server = start_server(kind, config)  # type: ignore[arg-type]
        try:
            for r in range(rounds):
                order = (False, True) if r % 2 == 0 else (True, False)
                got = {}
                for wedge in order:
                    got[wedge] = asyncio.run(healthy_throughput(server.address, wedge))
                    if wedge:
                        time.sleep(HANG_SECONDS - WINDOW_SECONDS + 0.3)  # let lane 3 return
                ratios[kind].append(got[True] / got[False])
                base[kind].append(got[False])
            results[f"reset_ms_{kind}"] = ms(asyncio.run(reset_round_trips(server.address, 50)))
        finally:
            server.stop()
    for kind in ("ref", "ours"):
        results[f"wedged_ratio_{kind}"] = statistics.median(ratios[kind])
        results[f"healthy_steps_per_s_{kind}"] = statistics.median(base[kind])
    for mode in ("rebuild", "truncate"):
        config = ServerConfig(
            entrypoint="support.faulty:make",
            num_envs=4,
            env=env,
            ours_args=("--on-lane-fault", mode),
        )
        server = start_server("ours", config)
        try:
            values = asyncio.run(fault_recoveries(server.address, 30 * rounds, RAISE))
        finally:
            server.stop()
        results[f"fault_to_serving_ms_{mode}_p50"] = ms(values)
        results[f"fault_to_serving_ms_{mode}_p90"] = ms(values, 0.9)
    config = ServerConfig(
        entrypoint="support.faulty:make",
        num_envs=4,
        env=env,
        ours_args=("--on-lane-fault", "rebuild", "--lane-timeout-seconds", "0.2"),
    )
    server = start_server("ours", config)
    try:
        values = asyncio.run(fault_recoveries(server.address, 5 * rounds, HANG))
    finally:
        server.stop()
    results["wedge_to_serving_ms_p50"] = ms(values)
    results["wedge_to_serving_ms_p90"] = ms(values, 0.9)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = bench(2 if args.quick else args.rounds)
    print("| row | ours | reference |")
    print("| --- | --- | --- |")
    print(
        f"| healthy lanes' steps/s, 1 of 4 wedged / none wedged | "
        f"{results['wedged_ratio_ours']:.2f} | {results['wedged_ratio_ref']:.2f} |"
    )
    print(
        f"| healthy lanes' steps/s, none wedged | {results['healthy_steps_per_s_ours']:.0f} | "
        f"{results['healthy_steps_per_s_ref']:.0f} |"
    )
    print(
        f"| lane-scoped reset round trip, p50 ms | {results['reset_ms_ours']:.2f} | "
        f"{results['reset_ms_ref']:.2f} |"
    )
    for mode in ("rebuild", "truncate"):
        print(
            f"| step raised → lane serving again ({mode}), p50 / p90 ms | "
            f"{results[f'fault_to_serving_ms_{mode}_p50']:.2f} / "
            f"{results[f'fault_to_serving_ms_{mode}_p90']:.2f} | (never rebuilt) |"
        )
    print(
        "| step hung → lane serving again (rebuild, lane timeout 0.2 s), p50 / p90 ms | "
        f"{results['wedge_to_serving_ms_p50']:.0f} / {results['wedge_to_serving_ms_p90']:.0f}"
        " | (never) |"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
