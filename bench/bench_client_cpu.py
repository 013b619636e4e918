"""Benchmark: the client's CPU per whole-vector step of ``VectorEnv``, source tree against
source tree, against one server.

``python bench/bench_client_cpu.py [ENV N] --tree A=PATH --tree B=PATH ...`` starts
``rlmesh-trio serve --env ENV --num-envs N`` on loopback (this process's
``rlmesh_trio``), then runs rounds of a blocking ``VectorEnv`` client loop in a fresh
process per round, its ``rlmesh_trio`` imported from each tree's ``PATH`` (a ``src``
folder) in turn, alternating the order (AB, BA, ...). A round resets with seed 0,
steps 200 vector steps to warm up, then ``--steps`` vector steps of actions sampled
beforehand (autoreset NEXT_STEP), and reports, per vector step, its own CPU (user and
system, ``getrusage``) and wall time. The table has the medians and each tree's CPU as a
ratio to the first tree's; give one tree twice (``A=src --tree A2=src``) for the noise
floor (without ``--tree``: this process's own tree twice, an A/A run). An older tree:
``git archive COMMIT src | tar -x -C /tmp/old``.

The server is the same for every tree, so only the client's code differs; client CPU is
far less noisy than wall time on a shared machine. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _common import WORKFLOW_EDITION, serve_ours

os.environ.setdefault("RLMESH_WORKFLOW_EDITION", WORKFLOW_EDITION)

ROUND = r"""
import json, os, resource, sys, time
os.environ.setdefault("RLMESH_WORKFLOW_EDITION", sys.argv[3])
from rlmesh_trio.client import VectorEnv
address, steps = sys.argv[1], int(sys.argv[2])
env = VectorEnv(address)
env.action_space.seed(0)
actions = [env.action_space.sample() for _ in range(64)]
env.reset(seed=0)
for i in range(200):
    env.step(actions[i % 64])
r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
for i in range(steps):
    env.step(actions[i % 64])
w1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
env.close()
print(json.dumps({
    "user": (r1.ru_utime - r0.ru_utime) / steps * 1e6,
    "sys": (r1.ru_stime - r0.ru_stime) / steps * 1e6,
    "wall": (w1 - w0) / steps * 1e6,
}))
"""


def _round(src: str, address: str, steps: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run(
        [sys.executable, "-c", ROUND, address, str(steps), WORKFLOW_EDITION],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode:
        raise SystemExit(f"a round from {src} failed:\n{out.stderr}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("env", nargs="?", default="CartPole-v1")
    parser.add_argument("n", nargs="?", type=int, default=8, metavar="N")
    parser.add_argument(
        "--tree",
        action="append",
        metavar="NAME=SRC",
        help="a source tree's src folder (repeatable; default: this one's, twice: A/A)",
    )
    parser.add_argument("--steps", type=int, default=4000, help="vector steps a round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 1,000 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 1000, 3
    if not args.tree:
        import rlmesh_trio

        here = str(Path(rlmesh_trio.__file__).resolve().parents[1])
        args.tree = [f"this={here}", f"this-again={here}"]
    trees = dict(t.split("=", 1) for t in args.tree)
    for name, src in trees.items():
        if not (Path(src) / "rlmesh_trio").is_dir():
            parser.error(f"--tree {name}={src}: no rlmesh_trio package there")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    with serve_ours(args.env, args.n) as served:
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                results[name].append(_round(trees[name], served.address, args.steps))
    print(
        f"{args.env} x{args.n}, {args.rounds} rounds of {args.steps} vector steps; "
        "client µs per vector step, medians"
    )
    print(f"{'tree':10s} {'CPU':>7s} {'ratio':>6s} {'user':>7s} {'sys':>6s} {'wall':>7s}")
    base: float | None = None
    for name, rounds in results.items():
        cpu = statistics.median(x["user"] + x["sys"] for x in rounds)
        base = cpu if base is None else base
        user = statistics.median(x["user"] for x in rounds)
        system = statistics.median(x["sys"] for x in rounds)
        wall = statistics.median(x["wall"] for x in rounds)
        print(f"{name:10s} {cpu:7.1f} {cpu / base:6.2f} {user:7.1f} {system:6.1f} {wall:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
