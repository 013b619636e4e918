"""Benchmark: what recording costs a served evaluation (issue 33).

Servers of ``rlmesh-trio serve --env CartPole-v1 --num-envs N`` (``--env``: another
gymnasium id with a Discrete action space) in subprocesses, started
once and driven by ``rlmesh.run`` over the same seeds, the order rotating from round to
round; every number is the median over the rounds:

* ``off`` and ``off-again``: no recording, twice (the A/A pair: the noise floor);
* ``dataset``: ``--record-dataset`` (every episode of every lane into a Minari dataset,
  under a temporary ``MINARI_DATASETS_PATH``);
* with ``--video``: ``video-lane0`` (``--record-video DIR --record-video-lanes 0``, the env
  made with ``render_mode="rgb_array"``) against ``render-off`` (the same env, no video):
  what one recorded lane costs.

Reported per server: env steps/s (wall) and the server's CPU per env step (user + system
µs, all its threads, from ``/proc``): the CPU figure moves much less under a shared
machine's load than the wall figure, and is the deciding one. Ratios are against ``off``
(``off-again`` shows the floor).

``--soak SECONDS`` instead runs one ``dataset`` server under ``rlmesh.run`` for that long
and prints its RSS (``VmRSS``) and the dataset's size every ``--every`` seconds: the
writer keeps no episode once written, so the RSS should stay flat.

``--ours-src PATH`` (repeatable) adds a ``dataset`` server served from another source
tree (``PATH`` first on its ``PYTHONPATH``, its storage child too): a same-run A/B of a
change to the recording path.

Run: ``python bench/bench_record.py [--rounds R] [--lanes N] [--seeds S] [--video]
[--ours-src PATH] [--soak SECONDS]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _support  # noqa: F401  (the test harness as ``support``: see bench/_support.py)
from _common import Served, descendants, rss_mib, serve_ours, server_usage, tree_cpu
from support import scripts


def tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def children_cpu(pid: int) -> float:
    """CPU seconds of every live process below ``pid`` (the dataset's storage child)."""
    return tree_cpu(descendants(pid))


def one_round(served: Served, seeds: list[int]) -> tuple[float, float, float]:
    """Steps/s, server CPU µs per step and its children's CPU µs per step of one
    ``rlmesh.run`` over ``seeds``."""
    before, kids_before = server_usage(served.pid), children_cpu(served.pid)
    started = time.perf_counter()
    episodes = scripts.run_session(served.address, "cartpole", seeds)
    wall = time.perf_counter() - started
    used = server_usage(served.pid) - before
    kids = children_cpu(served.pid) - kids_before
    steps = sum(e["steps"] for e in episodes)
    return steps / wall, (used.user + used.sys) * 1e6 / steps, kids * 1e6 / steps


def compare(
    env_id: str, rounds: int, lanes: int, seeds: int, video: bool, root: Path, sources: list[str]
) -> str:
    configs: dict[str, tuple[str, ...]] = {
        "off": (),
        "off-again": (),
        "dataset": ("--record-dataset", "bench/record-v0"),
    }
    src_of: dict[str, str] = {}
    for k, src in enumerate(sources, start=1):  # same-run twins from other trees
        configs[f"dataset-src{k}"] = ("--record-dataset", f"bench/record-src{k}-v0")
        src_of[f"dataset-src{k}"] = src
    if video:
        rgb = ("--kwargs-json", '{"render_mode": "rgb_array"}')
        configs["render-off"] = rgb
        configs["video-lane0"] = (
            *rgb,
            "--record-video",
            str(root / "video"),
            "--record-video-lanes",
            "0",
        )
    servers = {
        name: serve_ours(env_id, lanes, *extra, src=src_of.get(name))
        for name, extra in configs.items()
    }
    names = list(servers)
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    kids: dict[str, list[float]] = {name: [] for name in names}
    try:
        for name in names:  # warm up: imports, first episodes
            one_round(servers[name], list(range(2)))
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                rate, per_step, child = one_round(
                    servers[name], list(range(r * seeds, (r + 1) * seeds))
                )
                rates[name].append(rate)
                cpu[name].append(per_step)
                kids[name].append(child)
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        for served in servers.values():
            served.stop()
    base_rate = statistics.median(rates["off"])
    base_cpu = statistics.median(cpu["off"])
    lines = [
        f"rlmesh.run {env_id}, N={lanes}, {seeds} seeds/round, {rounds} rounds "
        f"(medians; load {os.getloadavg()[0]:.2f})",
        f"{'server':<12} {'steps/s':>9} {'x off':>7} {'cpu us/step':>12} {'x off':>7} "
        f"{'+child us/step':>15}",
    ]
    for name in names:
        rate, per_step = statistics.median(rates[name]), statistics.median(cpu[name])
        child = statistics.median(kids[name])
        lines.append(
            f"{name:<12} {rate:>9.0f} {rate / base_rate:>7.3f} {per_step:>12.1f} "
            f"{per_step / base_cpu:>7.3f} {child:>15.1f}"
        )
    if video:
        vrate = statistics.median(rates["video-lane0"]) / statistics.median(rates["render-off"])
        vcpu = statistics.median(cpu["video-lane0"]) / statistics.median(cpu["render-off"])
        lines.append(f"video-lane0 / render-off: steps/s x{vrate:.3f}, cpu/step x{vcpu:.3f}")
    size = tree_size(root / "bench")
    lines.append(f"dataset on disk: {size / 1e6:.1f} MB")
    return "\n".join(lines)


def soak(seconds: float, every: float, lanes: int, root: Path) -> str:
    served = serve_ours("CartPole-v1", lanes, "--record-dataset", "bench/soak-v0")
    lines = [f"soak: dataset recording, CartPole-v1 N={lanes}, {seconds:.0f} s"]
    lines.append(
        f"{'t (s)':>7} {'RSS (MiB)':>10} {'child (MiB)':>12} {'dataset (MB)':>13} {'steps':>9}"
    )
    started = time.monotonic()
    next_report = 0.0
    steps = 0
    seed = 0
    try:
        while True:
            elapsed = time.monotonic() - started
            if elapsed >= next_report:
                lines.append(
                    f"{elapsed:>7.0f} {rss_mib(served.pid):>10.1f} "
                    f"{sum(rss_mib(c) for c in descendants(served.pid)):>12.1f} "
                    f"{tree_size(root / 'bench') / 1e6:>13.1f} {steps:>9}"
                )
                print(lines[-1], file=sys.stderr, flush=True)
                next_report += every
            if elapsed >= seconds:
                break
            episodes = scripts.run_session(served.address, "cartpole", list(range(seed, seed + 16)))
            seed += 16
            steps += sum(e["steps"] for e in episodes)
    finally:
        served.stop()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds (median)")
    parser.add_argument("--lanes", type=int, default=8, help="lanes served (default 8)")
    parser.add_argument("--seeds", type=int, default=48, help="episodes per round")
    parser.add_argument(
        "--env",
        default="CartPole-v1",
        help="gymnasium id (default CartPole-v1); the model pushes on the sign of the "
        "observation's third element (actions 0 and 1): any Discrete env fits, e.g. "
        "Acrobot-v1, whose step costs several times CartPole's",
    )
    parser.add_argument("--video", action="store_true", help="also measure one video lane")
    parser.add_argument(
        "--ours-src",
        action="append",
        default=[],
        metavar="PATH",
        help="also a dataset-recording server from this source tree's src (repeatable): "
        "a same-run A/B twin (rows dataset-src1, dataset-src2, ...)",
    )
    parser.add_argument("--soak", type=float, default=None, metavar="SECONDS")
    parser.add_argument("--every", type=float, default=60.0, help="soak report period (s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlt-record-bench-") as tmp:
        root = Path(tmp)
        os.environ["MINARI_DATASETS_PATH"] = str(root)  # inherited by the servers
        if args.soak is not None:
            print(soak(args.soak, args.every, args.lanes, root))
        else:
            print(
                compare(
                    args.env, args.rounds, args.lanes, args.seeds, args.video, root, args.ours_src
                )
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
