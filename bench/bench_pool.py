"""Benchmark: EnvPool-style ``send``/``recv`` against the synchronous ``VectorEnv`` on
uneven envs.

The server (a subprocess, ``tests/support/refserver.py`` as in the tests) serves N lanes
of ``support.uneven:make``: CartPole whose every step sleeps a heavy-tailed time
(Pareto, shape 1.2, from 1 ms, clipped at 20 ms; ``time.sleep`` releases the GIL as a
native simulator does). Two clients, each for ``--seconds`` per round, alternating which
goes first from round to round:

* ``sync``: ``VectorEnv(address)``, ``step(actions)`` in a loop: every vector step waits
  for the slowest of the N lanes;
* ``pool``: ``VectorEnv(address, batch_size=N/4)``: ``recv()`` the next N/4 lanes that
  finished, ``send()`` their actions straight back (the learner does no work of its
  own, so the figures are the client's and server's ceiling).

Rows: env steps/s (lane steps per second) and the learner's wait per batch (the mean
time inside ``step()`` / ``recv()``), and the client's and the server's CPU per env
step, medians over the rounds, for N = 8 and 16; our server and rlmesh 0.1.0's
(``--servers``).

Run: ``python bench/bench_pool.py [--rounds R] [--seconds S] [--lanes 8,16]
[--servers ours,ref] [--quick] [--json PATH]``. On a shared 2-core VM numbers move from
run to run: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _support  # noqa: F401  (the test harness as ``support``: see bench/_support.py)
import numpy as np
from support.refserver import ServerConfig, start_server

from rlmesh_trio.client import VectorEnv

ROOT = Path(__file__).resolve().parent.parent

ENTRYPOINT = "support.uneven:make"


def run_sync(address: str, n: int, seconds: float, seed: int) -> dict[str, float]:
    env = VectorEnv(address)
    try:
        rng = np.random.default_rng(seed)
        actions = rng.integers(0, 2, size=(4096, n))
        env.reset(seed=seed)
        steps = waited = 0.0
        batches = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            env.step(actions[batches % len(actions)])
            waited += time.perf_counter() - t0
            batches += 1
            steps += n
        elapsed = time.perf_counter() - start
    finally:
        env.close()
    return {
        "steps_per_s": steps / elapsed,
        "wait_ms": 1000 * waited / max(1, batches),
        "steps": steps,
    }


def run_pool(address: str, n: int, seconds: float, seed: int) -> dict[str, float]:
    k = max(1, n // 4)
    env = VectorEnv(address, batch_size=k)
    try:
        rng = np.random.default_rng(seed)
        actions = rng.integers(0, 2, size=(4096, k))
        env.async_reset(seed=seed)
        steps = waited = 0.0
        batches = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            _obs, _rew, _term, _trunc, infos = env.recv()
            waited += time.perf_counter() - t0
            lanes = infos["env_id"]
            env.send(actions[batches % len(actions)][: len(lanes)], lanes)
            batches += 1
            steps += len(lanes)
        elapsed = time.perf_counter() - start
    finally:
        env.close()
    return {
        "steps_per_s": steps / elapsed,
        "wait_ms": 1000 * waited / max(1, batches),
        "steps": steps,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(run: Any, pid: int, *args: Any) -> dict[str, float]:
    """``run(*args)`` with the client's and the server's CPU per env step."""
    client0, server0 = time.process_time(), cpu_seconds(pid)
    result: dict[str, float] = run(*args)
    steps = result.pop("steps")
    result["client_us"] = 1e6 * (time.process_time() - client0) / steps
    result["server_us"] = 1e6 * (cpu_seconds(pid) - server0) / steps
    return result


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--lanes", default="8,16")
    parser.add_argument("--servers", default="ours,ref")
    parser.add_argument("--quick", action="store_true", help="1 round of 2 s")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 1, 2.0
    lanes = [int(x) for x in args.lanes.split(",")]
    kinds = [x.strip() for x in args.servers.split(",") if x.strip()]
    print(f"load average before: {load()}")
    results: list[dict[str, Any]] = []
    for kind in kinds:
        for n in lanes:
            config = ServerConfig(entrypoint=ENTRYPOINT, num_envs=n)
            with start_server(kind, config) as server:  # type: ignore[arg-type]
                samples: dict[str, list[dict[str, float]]] = {"sync": [], "pool": []}
                for r in range(args.rounds):
                    order = ["sync", "pool"] if r % 2 == 0 else ["pool", "sync"]
                    for mode in order:
                        run = run_sync if mode == "sync" else run_pool
                        samples[mode].append(
                            measured(run, server.pid, server.address, n, args.seconds, r)
                        )
            row: dict[str, Any] = {"server": kind, "num_envs": n, "batch_size": max(1, n // 4)}
            for mode, runs in samples.items():
                row[f"{mode}_steps_per_s"] = statistics.median(x["steps_per_s"] for x in runs)
                for key in ("wait_ms", "client_us", "server_us"):
                    row[f"{mode}_{key}"] = statistics.median(x[key] for x in runs)
            row["speedup"] = row["pool_steps_per_s"] / row["sync_steps_per_s"]
            results.append(row)
            print(
                f"{kind:4} N={n:2} batch={row['batch_size']:2}: "
                f"sync {row['sync_steps_per_s']:7.0f} steps/s wait {row['sync_wait_ms']:6.2f} ms | "
                f"pool {row['pool_steps_per_s']:7.0f} steps/s wait {row['pool_wait_ms']:6.2f} ms | "
                f"x{row['speedup']:.2f} | CPU us/step client {row['sync_client_us']:.0f}/"
                f"{row['pool_client_us']:.0f} server {row['sync_server_us']:.0f}/"
                f"{row['pool_server_us']:.0f} (sync/pool)",
                flush=True,
            )
    print(f"load average after: {load()}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
