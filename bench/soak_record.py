"""Soak: a recording server for minutes, and the memory of its dataset's storage child.

``rlmesh-trio serve --env CartPole-v1 --num-envs 8 --record-dataset rlmesh/soak-v0`` (a
subprocess; Minari's root in a temporary directory) is driven by rlmesh 0.1.0's
``rlmesh.run`` for ``--minutes``, 400 seeds a run, with a policy that always pushes left
(episodes of ~10 steps: the most episodes, so the most per-episode storage work, a
minute). Every ``--every`` seconds the storage children's RSS (``/proc/PID/statm``: the
children of the server whose command is ``rlmesh_trio._recordchild``; a fresh one
replaces the last every 10,000 episodes) and the server's are sampled.

Reported: episodes and steps recorded and steps/s; the children seen (recycled); the
child's RSS at its first sample, max and last, and the server's; the dataset's bytes per
episode. At the end the server is stopped with SIGINT (exit 0 expected) and the dataset
loaded with Minari: every episode there, ``metadata.json`` saying it is complete. Exit
status 1 when the child's RSS went more than ``--rss-bound-mib`` (96: the recycle's
64 MiB of growth and slack) over its first sample, the server did not exit 0, or the
dataset is not whole; else 0.

Run: ``python bench/soak_record.py [--minutes M] [--rss-bound-mib MIB] [--json PATH]``
(``nox -s soak-record -- --minutes 20``); Linux (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _support  # noqa: F401  (the test harness as ``support``: see bench/_support.py)
from support.recording import storage_children

ROOT = Path(__file__).resolve().parent.parent
DATASET = "rlmesh/soak-v0"
SEEDS_PER_RUN = 400


def statm_mib(pid: int) -> float | None:
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    parser.add_argument("--rss-bound-mib", type=float, default=96.0)
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args()

    import rlmesh
    import rlmesh.numpy

    root = Path(tempfile.mkdtemp(prefix="rlmesh-trio-soak-record-"))
    env = {**os.environ, "MINARI_DATASETS_PATH": str(root)}
    read_fd, write_fd = os.pipe()
    server = subprocess.Popen(
        [sys.executable, "-m", "rlmesh_trio", "serve", "--env", "CartPole-v1", "--num-envs", "8",
         "--record-dataset", DATASET, "--ready-fd", str(write_fd)],
        env=env, pass_fds=(write_fd,), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        address = ready.read().decode().strip()
    print(f"soak_record: serving {address}, recording into {root}", flush=True)

    samples: list[dict[str, Any]] = []
    children: dict[int, list[float]] = {}
    done = threading.Event()

    def sample() -> None:
        started = time.monotonic()
        while not done.wait(args.every):
            for pid in storage_children(server.pid):
                rss = statm_mib(pid)
                if rss is not None:
                    children.setdefault(pid, []).append(rss)
            row = {
                "t": round(time.monotonic() - started),
                "server_mib": statm_mib(server.pid),
                "child_mib": [round(v[-1], 1) for v in children.values() if v][-1:],
            }
            samples.append(row)
            print(f"soak_record: {row}", flush=True)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = rlmesh.numpy.Model(lambda obs: 0)  # always left: short episodes
    episodes = steps = 0
    began = time.monotonic()
    seed = 0
    while time.monotonic() - began < args.minutes * 60:
        result = rlmesh.run(model, address, seeds=list(range(seed, seed + SEEDS_PER_RUN)))
        seed += SEEDS_PER_RUN
        episodes += len(result.episodes)
        steps += sum(int(e.steps) for e in result.episodes)
    elapsed = time.monotonic() - began
    done.set()
    sampler.join()
    server.send_signal(signal.SIGINT)
    code = server.wait(300)

    os.environ["MINARI_DATASETS_PATH"] = str(root)
    import minari

    dataset = minari.load_dataset(DATASET)
    said = dataset.storage.metadata.get("rlmesh_trio", {})
    size = (root / DATASET / "data" / "main_data.hdf5").stat().st_size
    first_child = next(iter(children.values()), [0.0])
    all_child = [v for values in children.values() for v in values]
    growth = max(all_child, default=0.0) - first_child[0]
    report = {
        "minutes": round(elapsed / 60, 1),
        "episodes_played": episodes,
        "steps_per_second": round(steps / elapsed),
        "episodes_in_dataset": dataset.total_episodes,
        "complete": said.get("complete"),
        "storage_children": len(children),
        "child_rss_first_mib": round(first_child[0], 1),
        "child_rss_max_mib": round(max(all_child, default=0.0), 1),
        "child_rss_last_mib": round(all_child[-1] if all_child else 0.0, 1),
        "server_rss_first_mib": samples[0]["server_mib"] if samples else None,
        "server_rss_last_mib": samples[-1]["server_mib"] if samples else None,
        "bytes_per_episode": round(size / max(1, dataset.total_episodes)),
        "server_exit": code,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"report": report, "samples": samples}, indent=2))
    failed = []
    if growth > args.rss_bound_mib:
        failed.append(f"the storage child grew {growth:.0f} MiB (bound {args.rss_bound_mib})")
    if code != 0:
        failed.append(f"the server exited {code}")
    if not said.get("complete") or dataset.total_episodes < episodes:
        failed.append(f"the dataset: {dataset.total_episodes} episodes of {episodes}, {said}")
    for why in failed:
        print(f"soak_record: FAILED: {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
