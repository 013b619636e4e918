"""Benchmark: one ``VectorEnv`` over several endpoints against one endpoint of all the
lanes, and against gymnasium's local vector envs (issue 40).

``python bench/bench_span.py [ENV N] [--rounds R] [--steps S] [--shapes 1,2,4,8]`` starts,
for each shape K, ``rlmesh-trio serve --env ENV --num-envs N/K --endpoints K`` on
loopback (K endpoints of N/K lanes, one process), and measures a blocking
``VectorEnv`` over all K endpoints: ``reset(seed=0)``, ``--steps`` whole-vector steps of
random actions sampled beforehand (NEXT_STEP), in a fresh client process per round; then
the same loop over ``SyncVectorEnv`` and ``AsyncVectorEnv`` of N ``gymnasium.make(ENV)``.
Rounds alternate the contenders' order. The table has each contender's median vector
steps/s and its ratio to one endpoint (K = 1) in the same run, and the client process's
CPU per vector step: what spanning endpoints costs a trainer whose envs sit on one
machine (on several machines the endpoints' round trips overlap: each round's requests
go to every endpoint before any answer is read). Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _common import WORKFLOW_EDITION, serve_ours

os.environ.setdefault("RLMESH_WORKFLOW_EDITION", WORKFLOW_EDITION)

ROUND = r"""
import json, os, resource, sys, time
import gymnasium as gym
kind, env_id, n, steps, addresses = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
if kind == "span":
    from rlmesh_trio.client import VectorEnv
    env = VectorEnv(addresses)
elif kind == "sync":
    env = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(n)])
else:
    env = gym.vector.AsyncVectorEnv([lambda: gym.make(env_id) for _ in range(n)])
env.action_space.seed(0)
actions = [env.action_space.sample() for _ in range(64)]
env.reset(seed=0)
for i in range(100):
    env.step(actions[i % 64])
r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for i in range(steps):
    env.step(actions[i % 64])
w1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
env.close()
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print(json.dumps({"steps_per_s": steps / (w1 - w0), "cpu_us": cpu / steps * 1e6}))
"""


def _round(kind: str, env_id: str, n: int, steps: int, addresses: list[str]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", ROUND, kind, env_id, str(n), str(steps), *addresses],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("env", nargs="?", default="CartPole-v1")
    parser.add_argument("n", nargs="?", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--shapes", default="1,2,4,8", help="endpoint counts K (each dividing N)")
    args = parser.parse_args()
    shapes = [int(k) for k in args.shapes.split(",") if args.n % int(k) == 0]
    servers = {k: serve_ours(args.env, args.n // k, "--endpoints", str(k)) for k in shapes}
    try:
        contenders = [f"K={k}" for k in shapes] + ["SyncVectorEnv", "AsyncVectorEnv"]
        runs: dict[str, list[dict[str, float]]] = {c: [] for c in contenders}
        for r in range(args.rounds):
            order = contenders if r % 2 == 0 else list(reversed(contenders))
            for name in order:
                if name.startswith("K="):
                    addresses = servers[int(name[2:])].addresses
                    runs[name].append(_round("span", args.env, args.n, args.steps, addresses))
                else:
                    kind = "sync" if name.startswith("Sync") else "async"
                    runs[name].append(_round(kind, args.env, args.n, args.steps, []))
    finally:
        for server in servers.values():
            server.stop()
    base = statistics.median(x["steps_per_s"] for x in runs[f"K={shapes[0]}"])
    print(f"{args.env}, N = {args.n} lanes, {args.rounds} rounds of {args.steps} vector steps")
    print(f"| contender | vector steps/s | / K={shapes[0]} | client CPU per vector step |")
    print("| --- | ---: | ---: | ---: |")
    for name in contenders:
        rate = statistics.median(x["steps_per_s"] for x in runs[name])
        cpu = statistics.median(x["cpu_us"] for x in runs[name])
        label = f"`VectorEnv` over {name[2:]} endpoints" if name.startswith("K=") else name
        print(f"| {label} | {rate:,.0f} | {rate / base:.2f} | {cpu:.0f} µs |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
