"""The fleet on a local Ray: restart times, and throughput against one endpoint.

Not a test: nothing here asserts a speed. On one Ray (``num_cpus=2``, loopback, workers
at niceness 0) it launches two fleets with the same total of 4 CartPole lanes --
K=2 x N=2 and K=1 x N=4 -- and measures:

* throughput: ``fleet.run`` over 16 full episodes (500 steps each: 8,000 env steps) on
  each fleet (recording episodes as they end, the default, and without), and
  ``rlmesh.run`` straight to the K=1 endpoint (no fleet layer), in
  alternating order for ``--rounds`` rounds; env steps per second, median (min-max);
* restart times, each from the event until the endpoint answers a health probe and a
  Handshake again at its (pinned) address: SIGKILL of the endpoint's process (Ray
  restarts it), ``fleet.restart(i)`` (``ray.kill(no_restart=False)``), and SIGSTOP (a
  wedged process: the supervisor must notice, kill it, and Ray restart it).

Usage: ``python bench/bench_fleet.py [--rounds R] [--restarts M] [--json PATH]``
(default 5 rounds and 5 restarts of each kind, about two minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np
import ray
import rlmesh
import rlmesh.numpy

from rlmesh_trio.client import probe
from rlmesh_trio.fleet.ray import RayFleet, launch

SEEDS = list(range(16))
GAINS = np.array([0.0, 0.0, 1.0, 0.5])


def _policy(obs: Any) -> Any:
    # A PD controller on the pole: every CartPole-v1 episode runs its full 500 steps.
    return (np.asarray(obs) @ GAINS > 0).astype(np.int64)


MODEL = rlmesh.numpy.Model(_policy)
COMMON: dict[str, Any] = {
    "resources": {"CPU": 0.5},
    "bind": "127.0.0.1",
    "max_restarts": -1,
    "health_period_seconds": 0.5,
    "health_timeout_seconds": 1.0,
    "unhealthy_after": 2,
}


def _steps_per_s(run: Any) -> float:
    began = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - began
    assert sorted(e.seed for e in result.episodes) == SEEDS, "every seed exactly once"
    return float(result.total_steps) / elapsed


def _wait_serving(address: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if probe(address, timeout_seconds=0.5).serving:
            return
        time.sleep(0.02)
    raise TimeoutError(f"{address} not serving after {timeout} s")


def _restart_times(fleet: RayFleet, kind: str, count: int) -> list[float]:
    times = []
    for _ in range(count):
        fleet.wait_ready(60)
        address = fleet.addresses[0]
        pid = fleet.info(0).pid
        began = time.monotonic()
        if kind == "sigkill":
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)  # the probe must not catch the dying process still answering
            _wait_serving(address)
        elif kind == "ray.kill":
            fleet.restart(0)
            _wait_serving(fleet.addresses[0])
        else:  # a wedged process: only the supervisor can get it back
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 120
            while fleet.info(0, timeout_seconds=120).pid == pid and time.monotonic() < deadline:
                time.sleep(0.05)
            _wait_serving(fleet.addresses[0])
        times.append(time.monotonic() - began)
        if fleet.addresses[0] != address:
            print(f"  note: {kind} moved the endpoint {address} -> {fleet.addresses[0]}")
    return times


def _summary(values: list[float], fmt: str) -> str:
    return (
        f"{format(statistics.median(values), fmt)} "
        f"({format(min(values), fmt)}-{format(max(values), fmt)})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    began = time.monotonic()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    print(f"ray.init: {time.monotonic() - began:.1f} s; load average {os.getloadavg()}")
    results: dict[str, Any] = {"load_average_start": os.getloadavg()}
    try:
        began = time.monotonic()
        split = launch("CartPole-v1", endpoints=2, num_envs=2, **COMMON)
        results["launch_2x2_s"] = time.monotonic() - began
        began = time.monotonic()
        single = launch("CartPole-v1", endpoints=1, num_envs=4, **COMMON)
        results["launch_1x4_s"] = time.monotonic() - began
        print(
            f"launch: K=2 x N=2 {results['launch_2x2_s']:.2f} s, "
            f"K=1 x N=4 {results['launch_1x4_s']:.2f} s"
        )
        with split, single:
            configs = {
                "fleet K=2 x N=2": lambda: split.run(MODEL, seeds=SEEDS),
                "fleet K=1 x N=4": lambda: single.run(MODEL, seeds=SEEDS),
                "fleet K=2 x N=2, record_episodes=False": lambda: split.run(
                    MODEL, seeds=SEEDS, record_episodes=False
                ),
                "fleet K=1 x N=4, record_episodes=False": lambda: single.run(
                    MODEL, seeds=SEEDS, record_episodes=False
                ),
                "rlmesh.run, one endpoint N=4": lambda: rlmesh.run(
                    MODEL, single.addresses[0], seeds=SEEDS
                ),
            }
            for run in configs.values():  # warm-up
                run()
            rates: dict[str, list[float]] = {name: [] for name in configs}
            names = list(configs)
            for round_ in range(args.rounds):
                order = names if round_ % 2 == 0 else names[::-1]
                for name in order:
                    rates[name].append(_steps_per_s(configs[name]))
            print(f"\nthroughput, 16 episodes x 500 steps, {args.rounds} alternating rounds")
            print("| config | env steps/s, median (min-max) | ratio to K=1 x N=4 |")
            print("| --- | --- | --- |")
            base = statistics.median(rates["fleet K=1 x N=4"])
            for name, values in rates.items():
                ratio = statistics.median(values) / base
                print(f"| {name} | {_summary(values, ',.0f')} | {ratio:.2f} |")
            results["throughput"] = rates

            print(f"\nrestart times, {args.restarts} each, until serving again")
            print("| event | seconds, median (min-max) |")
            print("| --- | --- |")
            restarts: dict[str, list[float]] = {}
            for kind in ("sigkill", "ray.kill", "sigstop (supervisor)"):
                restarts[kind] = _restart_times(split, kind, args.restarts)
                print(f"| {kind} | {_summary(restarts[kind], '.2f')} |")
            results["restarts"] = restarts
            results["supervisor"] = vars(split.stats())
            results["endpoints"] = [vars(e) for e in split.endpoints]
            print(f"\nsupervisor: {split.stats()}")
    finally:
        ray.shutdown()
    results["load_average_end"] = os.getloadavg()
    print(f"load average at the end {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
