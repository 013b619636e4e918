"""Benchmark: one env served on loopback against the local vector envs a user would run instead.

``python bench/bench_vs_local.py ENV N`` (default ``CartPole-v1 8``) steps N copies of the
gymnasium env ``ENV`` through each contender and prints env-steps per second, each as a
ratio to gymnasium's ``AsyncVectorEnv`` (what a trainer runs when one process is not
enough):

* ``sync``: gymnasium's ``SyncVectorEnv``, in this process;
* ``async``: gymnasium's ``AsyncVectorEnv``, one worker process per env (its default
  context: fork on Linux, so it is built before any client starts a thread);
* ``thread``: ``rlmesh_trio.client.VectorEnv`` against ``rlmesh-trio serve --env ENV
  --num-envs N`` in a subprocess (thread lanes, the default);
* ``process``: the same against ``serve --lane-isolation process`` (a child process
  per env);
* ``unix``: the ``thread`` server on a unix socket (``--address unix:///...``), not TCP
  loopback: what a same-host client saves on the socket (not a default contender);
* ``rlmesh``: rlmesh 0.1.0's ``rlmesh.numpy.RemoteVectorEnv`` against a thread-lane server
  of ours (``RemoteEnv`` at N = 1, where ``RemoteVectorEnv`` refuses the endpoint). It
  has no autoreset and no lane-scoped reset: its lanes step on past the end of their
  episodes, as in bench_client.py (the server still runs one env step per lane);
* ``--ref`` adds ``ref-vector`` and ``ref-rlmesh``: ``VectorEnv`` and ``RemoteVectorEnv``
  against rlmesh 0.1.0's own server (``rlmesh.EnvServer``, in a subprocess).

Every contender resets once with the same seed (``--seed``; env i gets seed + i) and
steps the same actions: a cycle of vector actions sampled beforehand from the batched
action space, seeded the same. The gymnasium contenders and ``VectorEnv`` autoreset
NEXT_STEP (gymnasium's default), so they follow the same trajectories: the script checks
that the last observations are equal to ``SyncVectorEnv``'s. Each contender gets its own
server, all started (and warmed up) before the first round; then ``--rounds`` rounds of
``--steps`` env-steps each, alternating the order (ABC, CBA, ...), and the table shows
medians. Loopback only.

Per vector step (one step of all N envs), medians too: the wall time; this process's CPU
(all its threads: for ``sync`` that is the envs themselves); the server process's user
and system CPU (``/proc/<pid>/stat``, all its threads); and the CPU of the processes
below the contender (``AsyncVectorEnv``'s workers, process lanes).

``--profile`` runs ``py-spy record`` on each server of ours over its measured rounds
(``--gil`` by default: which thread holds the GIL; ``--profile-mode cpu`` samples every
thread that is not idle, ``all`` idle ones too) and prints the samples split by thread
name (lane threads, the transport thread, the main thread, where Trio runs) and the
top functions by own samples. py-spy slows what it samples: compare the rounds of one
profiled run with each other, not with an unprofiled run.

On a shared machine absolute numbers move from run to run: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("RLMESH_WORKFLOW_EDITION", "2026.06")

from _common import (
    Served,
    descendants,
    serve_ours,
    serve_reference,
    server_usage,
    tree_cpu,
)

CONTENDERS = {
    "sync": "SyncVectorEnv",
    "async": "AsyncVectorEnv",
    "thread": "VectorEnv, thread lanes",
    "process": "VectorEnv, process lanes",
    "unix": "VectorEnv, thread lanes, unix socket",
    "rlmesh": "rlmesh RemoteVectorEnv -> ours",
    "ref-vector": "VectorEnv -> reference",
    "ref-rlmesh": "rlmesh RemoteVectorEnv -> reference",
}
DEFAULT_CONTENDERS = ("sync", "async", "thread", "process", "rlmesh")
REFERENCE_CONTENDERS = ("ref-vector", "ref-rlmesh")
OURS = ["thread", "process", "unix", "rlmesh"]
"""The contenders served by rlmesh-trio: the ones ``--profile`` samples."""
SOURCES: dict[str, str] = {}
"""``--ours-src``: contender key -> the ``src`` directory its server runs."""
SOURCE_LANES: dict[str, str] = {}
"""``--ours-src``: contender key -> its server's lane isolation (``--src-lanes``)."""

ACTION_CYCLE = 1024
"""Vector actions sampled beforehand; every contender steps through them in order."""


@dataclass
class Sample:
    """One measured round of one contender: wall seconds, vector steps, and CPU seconds
    (this process; the server's user and system; the processes below the contender)."""

    seconds: float
    vector_steps: int
    client: float
    server_user: float | None
    server_sys: float | None
    children: float | None


@dataclass
class Contender:
    """A vector env ready to step, and what serves it."""

    key: str
    label: str
    env: Any
    server: Served | None = None
    children: Callable[[], list[int]] = list
    lane_reset: bool = True
    """Whether its lanes autoreset (NEXT_STEP); rlmesh's client has no autoreset."""
    cursor: int = 0
    last_obs: Any = None
    samples: list[Sample] = field(default_factory=list)
    profile: Counter[tuple[str, str]] = field(default_factory=Counter)
    """py-spy samples by (thread group, function)."""

    def close(self) -> None:
        try:
            self.env.close()
        finally:
            if self.server is not None:
                self.server.stop()


def build(key: str, env_id: str, n: int, seed: int, ours_args: tuple[str, ...]) -> Contender:
    """The contender ``key`` over ``n`` copies of ``env_id``, reset with ``seed``."""
    import gymnasium as gym
    from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

    label = CONTENDERS[key]
    fns = [functools.partial(gym.make, env_id) for _ in range(n)]
    if key == "sync":
        c = Contender(key, label, SyncVectorEnv(fns, autoreset_mode=AutoresetMode.NEXT_STEP))
    elif key == "async":
        env = AsyncVectorEnv(fns, autoreset_mode=AutoresetMode.NEXT_STEP)
        c = Contender(key, label, env, children=lambda: [p.pid for p in env.processes if p.pid])
    else:
        if key.startswith("ref-"):
            server = serve_reference(env_id, n)
        elif key in SOURCES:
            isolation = ("--lane-isolation", SOURCE_LANES.get(key, "thread"))
            server = serve_ours(env_id, n, *isolation, *ours_args, src=SOURCES[key])
        elif key == "process":
            server = serve_ours(env_id, n, "--lane-isolation", "process", *ours_args)
        elif key == "unix":  # the same server on a unix socket (a later --address wins)
            path = Path(tempfile.mkdtemp(prefix="rlt-bench-")) / "vector.sock"
            server = serve_ours(env_id, n, *ours_args, "--address", f"unix://{path}")
        else:
            server = serve_ours(env_id, n, *ours_args)
        try:
            c = _client(key, label, server, n)
        except BaseException:
            server.stop()
            raise
        c.children = functools.partial(descendants, server.pid)
    if c.lane_reset or n == 1:
        c.last_obs, _ = c.env.reset(seed=seed)
    else:
        c.last_obs, _ = c.env.reset(seed=list(range(seed, seed + n)))
    return c


def _client(key: str, label: str, server: Served, n: int) -> Contender:
    if key in ("thread", "process", "unix", "ref-vector") or key in SOURCES:
        from rlmesh_trio.client import VectorEnv

        return Contender(key, label, VectorEnv(server.address), server)
    from rlmesh.numpy import RemoteEnv, RemoteVectorEnv

    if n == 1:  # RemoteVectorEnv refuses a one-lane endpoint
        env = RemoteEnv(server.address)
        label = label.replace("RemoteVectorEnv", "RemoteEnv")
        return Contender(key, label, env, server, lane_reset=False)
    return Contender(key, label, RemoteVectorEnv(server.address), server, lane_reset=False)


def sample_actions(env_id: str, n: int, seed: int) -> list[Any]:
    """:data:`ACTION_CYCLE` vector actions from the batched action space, seeded."""
    import gymnasium as gym
    from gymnasium.vector.utils import batch_space

    env = gym.make(env_id)
    try:
        space = batch_space(env.action_space, n)
    finally:
        env.close()
    space.seed(seed)
    return [space.sample() for _ in range(ACTION_CYCLE)]


def run(c: Contender, actions: list[Any], vector_steps: int, n: int) -> Sample:
    """``vector_steps`` steps of ``c``, measured."""
    children = c.children()
    server0 = server_usage(c.server.pid) if c.server is not None else None
    children0 = tree_cpu(children)
    step = c.env.step
    single = n == 1 and not c.lane_reset
    begin, end = c.cursor, c.cursor + vector_steps
    out: Any = None
    cpu0 = time.process_time()
    started = time.perf_counter()
    if single:  # rlmesh's RemoteEnv (N = 1): one env's action
        for i in range(begin, end):
            out = step(actions[i % ACTION_CYCLE][0])
    else:
        for i in range(begin, end):
            out = step(actions[i % ACTION_CYCLE])
    seconds = time.perf_counter() - started
    client = time.process_time() - cpu0
    c.cursor = end
    c.last_obs = out[0]
    server = server_usage(c.server.pid) - server0 if c.server and server0 else None
    return Sample(
        seconds,
        vector_steps,
        client,
        server.user if server is not None else None,
        server.sys if server is not None else None,
        tree_cpu(children) - children0 if children else None,
    )


# ---------------------------------------------------------------------------- py-spy


class ProfileError(RuntimeError):
    """py-spy is missing or cannot attach here."""


def py_spy() -> str:
    """The py-spy executable (beside this Python first, then on PATH)."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise ProfileError(
            "--profile: py-spy not found (beside this Python or on PATH); "
            "`pip install py-spy` (the dev extra pins it)"
        )
    return found


def check_attach(exe: str, pid: int) -> None:
    """``py-spy dump`` once: a clear error now rather than an empty profile later."""
    done = subprocess.run(
        [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise ProfileError(
            f"--profile: py-spy cannot attach to the server (pid {pid}): "
            f"{said(done.stderr or done.stdout)}\n"
            "(on a permission error: py-spy needs ptrace on the process: kernel.yama.ptrace_scope 0 (or running as "
            "root), and CAP_SYS_PTRACE in a container (docker run --cap-add SYS_PTRACE))"
        )


def said(text: str) -> str:
    """py-spy's error, without the backtrace it may add."""
    head = [line.strip() for line in text.split("Stack backtrace:")[0].splitlines()]
    return " / ".join([line for line in head if line][:4])[:500]


class Spy:
    """``py-spy record`` of one server over one round: raw collapsed stacks, ``--threads``
    (every stack starts with its thread), into a temporary file."""

    ATTACH_SECONDS = 0.5
    """Time given py-spy to attach before the round starts (it says nothing when it has)."""

    def __init__(self, exe: str, pid: int, mode: str, rate: int, subprocesses: bool) -> None:
        self.out = Path(tempfile.mkstemp(prefix="rlt-spy-", suffix=".txt")[1])
        cmd = [exe, "record", "--pid", str(pid), "--threads", "--rate", str(rate)]
        cmd += ["--format", "raw", "--output", str(self.out), "--nonblocking"]
        cmd += {"gil": ["--gil"], "cpu": [], "all": ["--idle"]}[mode]
        if subprocesses:
            cmd.append("--subprocesses")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        time.sleep(self.ATTACH_SECONDS)
        if self.proc.poll() is not None:
            raise ProfileError(
                f"--profile: py-spy record exited: {said(self.proc.communicate()[1])}"
            )

    def stop(self, into: Counter[tuple[str, str]], server_pid: int) -> None:
        """SIGINT (py-spy writes its output then), and add the samples to ``into``."""
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        try:
            text = self.out.read_text(errors="replace")
        finally:
            self.out.unlink(missing_ok=True)
        if not text.strip():
            raise ProfileError(f"--profile: py-spy wrote no samples: {said(err)}")
        for line in text.splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                into[split_stack(stack, server_pid)] += int(count)


THREAD = re.compile(r"thread \((?:0x)?[0-9A-Fa-f]+\): ?(.*)")
PROCESS = re.compile(r"process (\d+):")
LINE = re.compile(r":\d+\)$")


def split_stack(stack: str, server_pid: int) -> tuple[str, str]:
    """(thread group, leaf function) of one collapsed stack: lane threads' trailing
    numbers become ``*`` (``rlmesh-trio-lane-*``), a child process's threads are named
    as such, and the function loses its line number."""
    frames = stack.split(";")
    group = "?"
    child = False
    for frame in frames:
        process = PROCESS.match(frame)
        if process is not None:
            child = int(process.group(1)) != server_pid
            continue
        thread = THREAD.match(frame)
        if thread is not None:
            group = re.sub(r"\d+$", "*", thread.group(1).strip() or "(unnamed)")
            break
    if child:
        group = f"lane process: {group}"
    leaf = LINE.sub(")", frames[-1]) if len(frames) > 1 else "?"
    return group, leaf


def profile_report(label: str, counts: Counter[tuple[str, str]], mode: str, top: int) -> str:
    total = sum(counts.values())
    lines = [f"py-spy ({mode}) of the server of {label}: {total} samples"]
    if not total:
        return lines[0]
    threads: Counter[str] = Counter()
    functions: Counter[tuple[str, str]] = Counter()
    for (group, leaf), count in counts.items():
        threads[group] += count
        functions[(leaf, group)] += count
    lines.append("  by thread:")
    for group, count in threads.most_common():
        lines.append(f"    {100 * count / total:5.1f} %  {count:6}  {group}")
    if mode == "gil" and any(group.startswith("lane process:") for group in threads):
        lines.append("  (each lane process has a GIL of its own: its samples add to the server's)")
    lines.append(f"  top {top} functions (own samples):")
    for (leaf, group), count in functions.most_common(top):
        lines.append(f"    {100 * count / total:5.1f} %  {leaf}  [{group}]")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- report


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summary(c: Contender, n: int) -> dict[str, float | None]:
    """Medians over the rounds: env-steps/s, and µs per vector step."""

    def per_step(pick: Callable[[Sample], float | None]) -> float | None:
        values = [pick(s) for s in c.samples]
        return median(
            [
                None if v is None else v / s.vector_steps * 1e6
                for v, s in zip(values, c.samples, strict=True)
            ]
        )

    return {
        "steps_per_s": median([s.vector_steps * n / s.seconds for s in c.samples]),
        "wall_us": per_step(lambda s: s.seconds),
        "client_us": per_step(lambda s: s.client),
        "server_user_us": per_step(lambda s: s.server_user),
        "server_sys_us": per_step(lambda s: s.server_sys),
        "children_us": per_step(lambda s: s.children),
    }


COLUMNS = (
    ("steps_per_s", "env-steps/s"),
    ("ratio", "/ Async"),
    ("wall_us", "wall"),
    ("client_us", "client CPU"),
    ("server_user_us", "server user"),
    ("server_sys_us", "server sys"),
    ("children_us", "child procs"),
)


def table(rows: list[dict[str, Any]]) -> str:
    def cell(key: str, value: float | None) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}" if key == "ratio" else f"{value:,.0f}"

    lines = [("contender", *(title for _, title in COLUMNS))]
    for row in rows:
        lines.append((row["label"], *(cell(key, row[key]) for key, _ in COLUMNS)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for i, line in enumerate(lines):
        cells = [line[0].ljust(widths[0])]
        cells += [text.rjust(w) for text, w in zip(line[1:], widths[1:], strict=True)]
        out.append("  ".join(cells))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def same_as_sync(contenders: dict[str, Contender]) -> dict[str, bool | None]:
    """Whether each contender's last observations equal ``SyncVectorEnv``'s (None: not
    comparable; rlmesh's client does not autoreset)."""
    import numpy as np

    sync = contenders.get("sync")
    verdicts: dict[str, bool | None] = {}
    for key, c in contenders.items():
        if sync is None or key == "sync":
            continue
        if not c.lane_reset:
            verdicts[key] = None
            continue
        try:
            verdicts[key] = bool(np.array_equal(np.asarray(c.last_obs), np.asarray(sync.last_obs)))
        except (TypeError, ValueError):
            verdicts[key] = None
    return verdicts


# ---------------------------------------------------------------------------- main


def bench(args: argparse.Namespace, keys: list[str]) -> dict[str, Any]:
    n: int = args.num_envs
    vector_steps = max(1, args.steps // n)
    warmup = max(1, vector_steps // 4)
    actions = sample_actions(args.env, n, args.seed)
    spy_exe = py_spy() if args.profile else None
    load_before = os.getloadavg()
    contenders: dict[str, Contender] = {}
    started = time.monotonic()
    try:
        # AsyncVectorEnv forks: build the local ones first, before any client thread.
        for key in keys:
            _progress(f"starting {CONTENDERS[key]}")
            contenders[key] = build(key, args.env, n, args.seed, tuple(args.ours_args.split()))
        for c in contenders.values():
            run(c, actions, warmup, n)
        spied = [k for k in OURS if k in contenders] if spy_exe is not None else []
        for key in spied:
            server = contenders[key].server
            assert spy_exe is not None and server is not None
            check_attach(spy_exe, server.pid)
        order = list(contenders)
        for r in range(args.rounds):
            for key in order if r % 2 == 0 else order[::-1]:
                c = contenders[key]
                spy = None
                if key in spied and spy_exe is not None and c.server is not None:
                    spy = Spy(
                        spy_exe,
                        c.server.pid,
                        args.profile_mode,
                        args.profile_rate,
                        subprocesses=key == "process",
                    )
                try:
                    c.samples.append(run(c, actions, vector_steps, n))
                finally:
                    if spy is not None and c.server is not None:
                        spy.stop(c.profile, c.server.pid)
            _progress(f"round {r + 1}/{args.rounds} done")
        verdicts = same_as_sync(contenders)
    finally:
        for c in contenders.values():
            c.close()
    rows = []
    async_rate = summary(contenders["async"], n)["steps_per_s"] if "async" in contenders else None
    for key, c in contenders.items():
        row: dict[str, Any] = {"key": key, "label": c.label, **summary(c, n)}
        row["ratio"] = row["steps_per_s"] / async_rate if async_rate else None
        row["samples"] = [vars(s) for s in c.samples]
        rows.append(row)
    return {
        "env": args.env,
        "num_envs": n,
        "steps_per_round": vector_steps * n,
        "vector_steps_per_round": vector_steps,
        "warmup_vector_steps": warmup,
        "rounds": args.rounds,
        "seed": args.seed,
        "load_before": load_before[0],
        "load_after": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "seconds": time.monotonic() - started,
        "rows": rows,
        "same_as_sync": verdicts,
        "profile": {
            key: [[group, leaf, count] for (group, leaf), count in c.profile.most_common()]
            for key, c in contenders.items()
            if c.profile
        },
        "profile_labels": {key: c.label for key, c in contenders.items() if c.profile},
    }


def report(result: dict[str, Any], profile_mode: str, top: int) -> str:
    n = result["num_envs"]
    lines = [
        f"{result['env']}, N = {n}: {result['steps_per_round']:,} env-steps per round "
        f"({result['vector_steps_per_round']:,} vector steps), median of {result['rounds']} "
        f"rounds in alternating order after {result['warmup_vector_steps']:,} warm-up vector "
        f"steps; seeds {result['seed']}..{result['seed'] + n - 1}",
        f"load average (1 min) before / after: {result['load_before']:.2f} / "
        f"{result['load_after']:.2f} on {result['cpus']} CPUs"
        + (
            "  -- a loaded machine: trust the CPU columns over steps/s"
            if max(result["load_before"], result["load_after"]) >= 1.5
            else ""
        ),
        "",
        table(result["rows"]),
        "",
        "wall and CPU columns: µs per vector step (one step of all N envs). client CPU: this "
        "process, all its threads; server user / sys: the server process, all its threads; "
        "child procs: AsyncVectorEnv's workers, or the server's lane processes.",
    ]
    verdicts = result["same_as_sync"]
    if verdicts:
        said = {True: "equal", False: "DIFFERENT", None: "not compared"}
        lines.append(
            "last observations vs SyncVectorEnv's: "
            + ", ".join(f"{key} {said[v]}" for key, v in verdicts.items())
        )
    for key, stacks in result["profile"].items():
        counts = Counter({(g, leaf): count for g, leaf, count in stacks})
        lines += ["", profile_report(result["profile_labels"][key], counts, profile_mode, top)]
    if result["profile"]:
        lines.append("\n(the profiled contenders' rounds ran under py-spy: slower than without)")
    lines.append(f"\ntotal {result['seconds']:.0f} s")
    return "\n".join(lines)


def _progress(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Contenders: " + ", ".join(f"{k} ({v})" for k, v in CONTENDERS.items()),
    )
    parser.add_argument(
        "env", nargs="?", default="CartPole-v1", help="gymnasium id (default CartPole-v1)"
    )
    parser.add_argument(
        "num_envs", nargs="?", type=int, default=8, metavar="N", help="envs (default 8)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="env-steps per round (default 16000; --quick 4000)"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds, median reported (default 5; --quick 3)"
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds of 4000 env-steps")
    parser.add_argument(
        "--contenders",
        default=",".join(DEFAULT_CONTENDERS),
        help="comma-separated, of: " + ",".join(CONTENDERS),
    )
    parser.add_argument(
        "--ref", action="store_true", help="also ref-vector,ref-rlmesh: rlmesh 0.1.0's server"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="env i resets with seed + i; actions are sampled with seed",
    )
    parser.add_argument(
        "--ours-args",
        default="",
        help='extra serve options of our servers, e.g. "--event-loop asyncio"',
    )
    parser.add_argument(
        "--ours-src",
        action="append",
        default=[],
        metavar="PATH",
        help="also a server running the package in PATH (a source tree's src directory), "
        "as its own row; repeat for several (same tree twice: an A/A)",
    )
    parser.add_argument(
        "--src-lanes",
        choices=("thread", "process"),
        default="thread",
        help="the lane isolation of the --ours-src servers (default thread)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="py-spy our servers over their measured rounds"
    )
    parser.add_argument(
        "--profile-mode",
        choices=("gil", "cpu", "all"),
        default="gil",
        help="gil: the GIL holder (default); cpu: every busy thread; all: idle ones too",
    )
    parser.add_argument("--profile-rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--profile-top", type=int, default=15, help="functions listed")
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the numbers (every round) here"
    )
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 4000 if args.quick else 16000
    if args.rounds is None:
        args.rounds = 3 if args.quick else 5
    keys = [k.strip() for k in args.contenders.split(",") if k.strip()]
    for i, src in enumerate(args.ours_src, 1):
        key = f"src{i}"
        CONTENDERS[key] = f"VectorEnv, {args.src_lanes} lanes, src{i} ({src})"
        SOURCES[key] = str(Path(src).resolve())
        SOURCE_LANES[key] = args.src_lanes
        OURS.append(key)
        keys.append(key)
    if args.ref:
        keys += [k for k in REFERENCE_CONTENDERS if k not in keys]
    unknown = [k for k in keys if k not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s): {', '.join(unknown)}")
    if args.num_envs < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("N, --steps and --rounds must be at least 1")
    keys = sorted(set(keys), key=list(CONTENDERS).index)  # local ones first: fork before threads
    try:
        result = bench(args, keys)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    print(report(result, args.profile_mode, args.profile_top))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
