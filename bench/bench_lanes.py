"""Benchmark: the cost of one lane round trip.

post -> lane thread -> reply callback -> back to the poster, for

* ``CallJob`` on a no-op env (the engine's own overhead),
* ``StepJob`` on a trivial env (Discrete action/observation: decode + step + encode),
* ``StepJob`` on gymnasium's CartPole-v1 with a real Discrete action leaf (a ``ResetJob``
  whenever an episode ends, counted as a round trip too),

against the floor of two plain threads ping-ponging through SimpleQueues, with 1 lane
busy (one poster, one job in flight) and with 8 lanes busy (8 posters, one
per lane, each with one job in flight), in microseconds per round trip as one poster sees
it, and the total jobs/s over the 8 lanes. Posters are plain threads (the transport
thread's role) whose reply callback puts into the poster's own ``SimpleQueue``; the Trio
thread only owns the engine and is idle while jobs flow, as in the server. One more row
uses an asyncio loop as the poster, answered through ``loop.call_soon_threadsafe`` (what
the transport does). Run: ``python bench/bench_lanes.py [--jobs N]``.

Numbers on a shared 2-core VM are noisy: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import outcome
import trio
from gymnasium import spaces

from rlmesh_trio._jobs import CallJob, Job, LaneReply, ResetJob, StepJob, StepResult
from rlmesh_trio._lanes import LaneEngine


class TrivialEnv(gym.Env[Any, Any]):
    def __init__(self) -> None:
        self.observation_space = spaces.Discrete(4)
        self.action_space = spaces.Discrete(2)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[int, dict[str, Any]]:
        return 0, {}

    def step(self, action: int) -> tuple[int, float, bool, bool, dict[str, Any]]:
        return 1, 1.0, False, False, {}


ACTION_LEAVES = [[np.int64(a).tobytes()] for a in (0, 1)]


def noop(env: Any) -> None:
    return None


# ---- job makers: (seq, last reply) -> the next job's constructor -----------------------

MakeJob = Callable[[int, "LaneReply | None", Callable[[LaneReply], None]], Job]


def call_job(seq: int, last: LaneReply | None, reply: Callable[[LaneReply], None]) -> Job:
    return CallJob(fn=noop)


def step_job(seq: int, last: LaneReply | None, reply: Callable[[LaneReply], None]) -> Job:
    return StepJob(leaves=ACTION_LEAVES[seq & 1], n=1, row=0, validated=False)


def cartpole_job(seq: int, last: LaneReply | None, reply: Callable[[LaneReply], None]) -> Job:
    if last is None:
        return ResetJob(seed=seq, options=None)
    # An outcome can be unwrapped only once (the session does that): peek at the value.
    result = last.outcome.value if isinstance(last.outcome, outcome.Value) else None
    if isinstance(result, StepResult) and (result.terminated or result.truncated):
        return ResetJob(seed=None, options=None)
    return StepJob(leaves=ACTION_LEAVES[seq & 1], n=1, row=0, validated=False)


# ---- posters -----------------------------------------------------------------------------


def thread_poster(engine: LaneEngine, lane: int, make: MakeJob, jobs: int) -> float:
    """Sequential round trips from this thread; returns seconds spent."""
    replies: queue.SimpleQueue[LaneReply] = queue.SimpleQueue()
    put = replies.put
    get = replies.get
    last: LaneReply | None = None
    for seq in range(min(200, jobs)):  # warm-up
        engine.post(lane, make(seq, last, put), put)
        last = get()
    start = time.perf_counter()
    for seq in range(jobs):
        engine.post(lane, make(seq, last, put), put)
        last = get()
        if isinstance(last.outcome, outcome.Error):
            raise last.outcome.error
    return time.perf_counter() - start


def asyncio_poster(engine: LaneEngine, lane: int, make: MakeJob, jobs: int) -> float:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        last: LaneReply | None = None
        for phase in ("warm", "measure"):
            count = min(200, jobs) if phase == "warm" else jobs
            start = time.perf_counter()
            for seq in range(count):
                future: asyncio.Future[LaneReply] = loop.create_future()

                def reply(r: LaneReply, future: asyncio.Future[LaneReply] = future) -> None:
                    loop.call_soon_threadsafe(future.set_result, r)

                engine.post(lane, make(seq, last, reply), reply)
                last = await future
            elapsed = time.perf_counter() - start
        return elapsed

    return asyncio.run(main())  # a selector loop on Linux, as the transport's


def bare_ping_pong(jobs: int) -> float:
    """The floor: two plain threads ping-ponging through two SimpleQueues, no engine."""
    inbox: queue.SimpleQueue[Callable[[None], None] | None] = queue.SimpleQueue()
    replies: queue.SimpleQueue[None] = queue.SimpleQueue()

    def lane() -> None:
        while (reply := inbox.get()) is not None:
            reply(None)

    thread = threading.Thread(target=lane, name="bench-bare-lane")
    thread.start()
    put = replies.put
    for _ in range(min(200, jobs)):
        inbox.put(put)
        replies.get()
    start = time.perf_counter()
    for _ in range(jobs):
        inbox.put(put)
        replies.get()
    elapsed = time.perf_counter() - start
    inbox.put(None)
    thread.join()
    return elapsed


async def measure(
    make_env: Callable[[], gym.Env[Any, Any]],
    make: MakeJob,
    lanes_busy: int,
    jobs: int,
    poster: Callable[[LaneEngine, int, MakeJob, int], float] = thread_poster,
) -> tuple[float, float]:
    """(µs per round trip as one poster sees it, total jobs/s)."""
    engine = LaneEngine(make_env, lanes_busy)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        results: list[float] = []
        limiter = trio.CapacityLimiter(lanes_busy)
        gc.collect()
        wall_start = time.perf_counter()
        async with trio.open_nursery() as posters:
            for lane in range(lanes_busy):

                async def one(lane: int = lane) -> None:
                    results.append(
                        await trio.to_thread.run_sync(
                            poster, engine, lane, make, jobs, limiter=limiter
                        )
                    )

                posters.start_soon(one)
        wall = time.perf_counter() - wall_start
        engine.close()
    per_trip_us = sum(results) / len(results) / jobs * 1e6
    return per_trip_us, lanes_busy * jobs / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5000, help="round trips per poster")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # gymnasium's passive checker chatter
    cases: list[tuple[str, Callable[[], gym.Env[Any, Any]], MakeJob]] = [
        ("CallJob, no-op env", TrivialEnv, call_job),
        ("StepJob, trivial env", TrivialEnv, step_job),
        ("StepJob, CartPole-v1", LaneEngine.factory("CartPole-v1"), cartpole_job),
    ]
    rows: list[tuple[str, str, str, str]] = []

    async def run_all() -> None:
        bare_us = bare_ping_pong(args.jobs) / args.jobs * 1e6
        rows.append(("bare SimpleQueue ping-pong", f"{bare_us:8.1f}", "", ""))
        for label, make_env, make in cases:
            one_us, _ = await measure(make_env, make, 1, args.jobs)
            eight_us, eight_rate = await measure(make_env, make, 8, args.jobs)
            rows.append((label, f"{one_us:8.1f}", f"{eight_us:8.1f}", f"{eight_rate:10.0f}"))
        one_us, _ = await measure(TrivialEnv, call_job, 1, args.jobs, poster=asyncio_poster)
        rows.append(("CallJob, asyncio poster", f"{one_us:8.1f}", "", ""))

    trio.run(run_all)
    header = ("case", "µs/trip 1 lane", "µs/trip 8 lanes", "jobs/s 8 lanes")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    print(f"lane round trips, {args.jobs} per poster, {threading.active_count()} threads alive")
    for r in [header, *rows]:
        print(
            "  ".join(
                cell.rjust(w) if i else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(r, widths, strict=True))
            )
        )


if __name__ == "__main__":
    main()
