"""Benchmark: what the hops of a process lane cost, without the server around them.

``python bench/bench_lane_hops.py ENV N`` (default ``CartPole-v1 8``) starts N process-lane
children (:class:`rlmesh_trio._lanes._process.ChildLane`, as ``--lane-isolation process``
does) and steps them in three shapes, one vector step (one step of every child) at a
time:

* ``proxy``: what the server does today -- a thread per child, fed by a queue (the lane
  thread and its mailbox), sends the job and waits for the answer; the stepping thread
  (standing in for the transport) posts N jobs and waits for N answers;
* ``direct``: no proxy thread -- the stepping thread sends to every child, then receives
  from every child (the shape of gymnasium's ``AsyncVectorEnv``);
* ``post-send``: the stepping thread writes each job to its child as it posts it, and the
  child's thread only waits for the answer (the mailbox hop gone, the lane thread kept).

Per vector step, medians of ``--rounds`` alternating rounds: the wall time, this process's
CPU (all its threads) and the children's CPU (``/proc/<pid>/stat``). An episode's end is
reset by whoever saw it (the proxy thread; in ``direct``, all the vector step's resets are
sent, then received). Resolution: clock ticks; keep
rounds of a second or more.

``--echo``: the floor under all of it, and what observations in shared memory with "a
byte on the pipe" could save. N bare echo children (a ``recv``, then a ``sendall`` of a
fixed answer; no env, no codec, no rlmesh-trio) answer messages of 1, 100, 4,096 and
100,000 bytes in the ``proxy`` and ``direct`` shapes: per vector step, the same columns.

This is a measuring harness, not a server: it reaches into ``ChildLane``'s pipe for the
shapes the server does not have.
"""

from __future__ import annotations

import argparse
import functools
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RLMESH_WORKFLOW_EDITION", "2026.06")

SHAPES = ("proxy", "direct", "post-send")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def post_and_wait(boxes: list[queue.SimpleQueue[int]], done: queue.SimpleQueue[int]) -> None:
    """The ``proxy`` shape's vector step: wake every lane thread, wait for each answer."""
    for box in boxes:
        box.put(1)
    for _ in boxes:
        done.get()


ECHO_SIZES = (1, 100, 4096, 100_000)
"""``--echo``: the answer sizes (bytes) of the bare echo children."""

ECHO_CHILD = """
import socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
answer = b"x" * int(sys.argv[2])
while sock.recv(65536):
    sock.sendall(answer)
"""


def echo_round(n: int, size: int, shape: str, steps: int) -> tuple[float, float, float]:
    """One round of N bare echo children answering ``size`` bytes: wall, this process's
    CPU and the children's CPU, µs per vector step."""
    import socket
    import subprocess

    kids: list[tuple[subprocess.Popen[bytes], socket.socket]] = []
    for _ in range(n):
        ours, theirs = socket.socketpair()
        child = subprocess.Popen(
            [sys.executable, "-c", ECHO_CHILD, str(theirs.fileno()), str(size)],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        kids.append((child, ours))
    request = b"y" * min(size, 100)

    def receive(sock: socket.socket) -> None:
        got = 0
        while got < size:
            got += len(sock.recv(65536))

    boxes: list[queue.SimpleQueue[int]] = [queue.SimpleQueue() for _ in kids]
    done: queue.SimpleQueue[int] = queue.SimpleQueue()

    def lane(sock: socket.socket, box: queue.SimpleQueue[int], count: int) -> None:
        for _ in range(count):
            box.get()
            sock.sendall(request)
            receive(sock)
            done.put(1)

    proxy = functools.partial(post_and_wait, boxes, done)

    def direct() -> None:
        for _, sock in kids:
            sock.sendall(request)
        for _, sock in kids:
            receive(sock)

    warmup = 100
    if shape == "proxy":
        for (_, sock), box in zip(kids, boxes, strict=True):
            threading.Thread(target=lane, args=(sock, box, warmup + steps), daemon=True).start()
    step = proxy if shape == "proxy" else direct
    try:
        for _ in range(warmup):
            step()
        children0 = sum(cpu_seconds(child.pid) for child, _ in kids)
        cpu0 = time.process_time()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - started
        parent = time.process_time() - cpu0
        children = sum(cpu_seconds(child.pid) for child, _ in kids) - children0
    finally:
        for child, sock in kids:
            sock.close()
            child.wait(10)
    per = 1e6 / steps
    return wall * per, parent * per, children * per


def echo(n: int, rounds: int, steps: int) -> int:
    rows: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for r in range(rounds):
        for size in ECHO_SIZES:
            for shape in ("proxy", "direct") if r % 2 == 0 else ("direct", "proxy"):
                rows.setdefault((shape, size), []).append(echo_round(n, size, shape, steps))
        print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    print(
        f"\nN = {n} bare echo children: {steps} vector steps per round, median of {rounds}; "
        f"load (1 min) after: {load:.2f} on {os.cpu_count()} CPUs"
    )
    print("µs per vector step      answer bytes    wall   parent CPU   children CPU")
    for shape in ("proxy", "direct"):
        for size in ECHO_SIZES:
            wall, parent, children = (
                statistics.median(c) for c in zip(*rows[(shape, size)], strict=True)
            )
            print(f"{shape:18s} {size:12,d} {wall:7.0f} {parent:12.0f} {children:14.0f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("env", nargs="?", default="CartPole-v1")
    parser.add_argument("num_envs", nargs="?", type=int, default=8, metavar="N")
    parser.add_argument("--vector-steps", type=int, default=1500, help="per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--echo", action="store_true", help="bare echo children instead (the floor; ENV unused)"
    )
    args = parser.parse_args(argv)
    if args.echo:
        return echo(args.num_envs, args.rounds, args.vector_steps)

    import gymnasium as gym

    from rlmesh_trio._codec import SpaceCodec
    from rlmesh_trio._jobs import ResetJob, StepJob
    from rlmesh_trio._lanes._process import ChildLane, pack_job, unpack_result

    n = args.num_envs
    kids = [ChildLane(functools.partial(gym.make, args.env), "warn", i, 0) for i in range(n)]
    for kid in kids:
        kid.build()
        kid.execute(ResetJob(seed=0, options=None), 0)
    probe = gym.make(args.env)
    job = StepJob(
        leaves=SpaceCodec(probe.action_space).encode(probe.action_space.sample()),
        n=1,
        row=0,
        validated=False,
    )
    probe.close()
    packed = pack_job(job, 0)
    packed_reset = pack_job(ResetJob(seed=None, options=None), 0)

    def reset_if_done(kid: ChildLane, result: Any) -> None:
        if result.terminated or result.truncated:
            kid.execute(ResetJob(seed=None, options=None), 0)

    done: queue.SimpleQueue[int] = queue.SimpleQueue()
    boxes: list[queue.SimpleQueue[int]] = [queue.SimpleQueue() for _ in kids]

    def proxy_lane(kid: ChildLane, box: queue.SimpleQueue[int], count: int) -> None:
        for _ in range(count):  # the lane thread: wait on the mailbox, then the child
            box.get()
            reset_if_done(kid, kid.execute(job, 0)[0].unwrap())
            done.put(1)

    def post_send_lane(kid: ChildLane, box: queue.SimpleQueue[int], count: int) -> None:
        for _ in range(count):  # the job is in the pipe already: wait on the child only
            result = unpack_result(kid._conn.recv())[0].unwrap()
            box.get_nowait()
            reset_if_done(kid, result)
            done.put(1)

    proxy = functools.partial(post_and_wait, boxes, done)

    def direct() -> None:
        for kid in kids:
            kid._conn.send(packed)
        ended = []
        for kid in kids:
            result = unpack_result(kid._conn.recv())[0].unwrap()
            if result.terminated or result.truncated:
                ended.append(kid)
        for kid in ended:  # the episodes' resets, also all sent before any is received
            kid._conn.send(packed_reset)
        for kid in ended:
            kid._conn.recv()

    def post_send() -> None:
        for kid, box in zip(kids, boxes, strict=True):
            box.put(1)
            kid._conn.send(packed)
        for _ in boxes:
            done.get()

    steps: dict[str, Callable[[], None]] = {
        "proxy": proxy,
        "direct": direct,
        "post-send": post_send,
    }
    lanes: dict[str, Callable[[ChildLane, queue.SimpleQueue[int], int], None] | None] = {
        "proxy": proxy_lane,
        "direct": None,
        "post-send": post_send_lane,
    }
    warmup = 50
    rows: dict[str, list[tuple[float, float, float]]] = {shape: [] for shape in SHAPES}
    try:
        for r in range(args.rounds):
            for shape in SHAPES if r % 2 == 0 else SHAPES[::-1]:
                step = steps[shape]
                target = lanes[shape]
                threads = [
                    threading.Thread(
                        target=target, args=(k, b, warmup + args.vector_steps), daemon=True
                    )
                    for k, b in zip(kids, boxes, strict=True)
                    if target is not None
                ]
                for thread in threads:
                    thread.start()
                for _ in range(warmup):
                    step()
                children0 = sum(cpu_seconds(k.pid or 0) for k in kids)
                cpu0 = time.process_time()
                started = time.perf_counter()
                for _ in range(args.vector_steps):
                    step()
                wall = time.perf_counter() - started
                parent = time.process_time() - cpu0
                children = sum(cpu_seconds(k.pid or 0) for k in kids) - children0
                per = 1e6 / args.vector_steps
                rows[shape].append((wall * per, parent * per, children * per))
                for thread in threads:
                    thread.join()
            print(f"  round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for kid in kids:
            kid.close()
    load = os.getloadavg()[0]
    print(
        f"\n{args.env}, N = {n}: {args.vector_steps} vector steps per round, median of "
        f"{args.rounds}; load (1 min) after: {load:.2f} on {os.cpu_count()} CPUs"
    )
    print("µs per vector step      wall   parent CPU   children CPU   env-steps/s")
    for shape in SHAPES:
        wall, parent, children = (statistics.median(c) for c in zip(*rows[shape], strict=True))
        print(f"{shape:18s} {wall:9.0f} {parent:12.0f} {children:14.0f} {n * 1e6 / wall:13,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
