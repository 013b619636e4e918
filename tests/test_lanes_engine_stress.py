"""Stress for the lane engine: many jobs from many posters, and close() racing with posts.

8 lanes x 2,000 jobs (trivial ``CallJob``s) posted from concurrent Trio tasks and from a
foreign thread: every reply reaches its own caller exactly once, from its lane's thread,
and each poster's jobs run in its posting order on every lane. Then posts racing with a
``close()`` from another thread: every job that was accepted is answered exactly once.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import gymnasium as gym
import pytest
import trio
from gymnasium import spaces

from rlmesh_trio._errors import LaneBrokenError, LaneClosedError
from rlmesh_trio._jobs import CallJob, LaneReply
from rlmesh_trio._lanes import LANE_THREAD_PREFIX, LaneEngine

LANES = 8
JOBS_PER_LANE = 2_000
TRIO_POSTERS = 3
THREAD_POSTERS = 1
POSTERS = TRIO_POSTERS + THREAD_POSTERS
SAFETY = 60.0


@pytest.fixture(autouse=True)
def _no_threads_left_behind() -> Any:
    before = set(threading.enumerate())
    yield
    assert [t.name for t in threading.enumerate() if t.name.startswith(LANE_THREAD_PREFIX)] == []
    new = [t for t in threading.enumerate() if t not in before]
    assert all(t.daemon and t.name.startswith("Trio thread") for t in new), new


class TinyEnv(gym.Env[Any, Any]):
    def __init__(self) -> None:
        self.observation_space = spaces.Discrete(2)
        self.action_space = spaces.Discrete(2)
        self.lane = int(threading.current_thread().name[len(LANE_THREAD_PREFIX) :])
        self.executed: list[tuple[int, int]] = []  # (poster, seq), touched by its lane only
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


class Envs:
    def __init__(self) -> None:
        self.by_lane: dict[int, TinyEnv] = {}

    def __call__(self) -> TinyEnv:
        env = TinyEnv()
        self.by_lane[env.lane] = env
        return env


def run_job(poster: int, seq: int) -> Callable[[gym.Env[Any, Any]], tuple[int, int, int]]:
    def fn(env: gym.Env[Any, Any]) -> tuple[int, int, int]:
        assert isinstance(env, TinyEnv)
        env.executed.append((poster, seq))
        return (env.lane, poster, seq)

    return fn


async def test_many_posters_many_lanes_every_reply_to_its_caller_in_order() -> None:
    per_poster = JOBS_PER_LANE // POSTERS
    total = LANES * per_poster * POSTERS
    token = trio.lowlevel.current_trio_token()
    all_done = trio.Event()
    answered: list[tuple[int, int, int]] = []  # list.append is atomic: safe from 8 threads
    wrong: list[str] = []
    lock = threading.Lock()

    def reply_for(lane: int, poster: int, seq: int) -> Callable[[LaneReply], None]:
        def reply(r: LaneReply) -> None:
            if r.lane != lane or r.outcome.unwrap() != (lane, poster, seq):
                wrong.append(f"job {(lane, poster, seq)} got {r}")
            if threading.current_thread().name != f"{LANE_THREAD_PREFIX}{lane}":
                wrong.append(
                    f"job {(lane, poster, seq)} answered on {threading.current_thread().name}"
                )
            with lock:
                answered.append((lane, poster, seq))
                if len(answered) == total:
                    token.run_sync_soon(all_done.set)

        return reply

    def post_all(engine: LaneEngine, poster: int) -> None:
        for seq in range(per_poster):
            for lane in range(LANES):
                engine.post(lane, CallJob(fn=run_job(poster, seq)), reply_for(lane, poster, seq))

    async def trio_poster(engine: LaneEngine, poster: int) -> None:
        for seq in range(per_poster):
            for lane in range(LANES):
                engine.post(lane, CallJob(fn=run_job(poster, seq)), reply_for(lane, poster, seq))
            if seq % 20 == 0:
                await trio.lowlevel.checkpoint()  # let the other posters interleave

    envs = Envs()
    engine = LaneEngine(envs, LANES)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        with trio.fail_after(SAFETY):
            async with trio.open_nursery() as posters:
                for poster in range(TRIO_POSTERS):
                    posters.start_soon(trio_poster, engine, poster)
                for poster in range(TRIO_POSTERS, POSTERS):
                    posters.start_soon(trio.to_thread.run_sync, post_all, engine, poster)
            await all_done.wait()
        engine.close()

    assert wrong == []
    assert len(answered) == total == LANES * JOBS_PER_LANE
    assert len(set(answered)) == total  # exactly once each
    for lane, env in envs.by_lane.items():
        assert len(env.executed) == JOBS_PER_LANE
        for poster in range(POSTERS):
            seqs = [seq for p, seq in env.executed if p == poster]
            assert seqs == list(range(per_poster)), (lane, poster)
        assert env.closes == 1


async def test_posts_racing_with_close_are_answered_exactly_once() -> None:
    token = trio.lowlevel.current_trio_token()
    accepted: list[tuple[int, int]] = []
    refusals: list[str] = []
    replies: Counter[tuple[int, int]] = Counter()
    outcomes: dict[tuple[int, int], str] = {}
    lock = threading.Lock()
    settled = trio.Event()
    posting_done = threading.Event()

    def maybe_settled() -> None:
        # Called with the lock held: all posting finished and every accepted job answered.
        if posting_done.is_set() and sum(replies.values()) == len(accepted):
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(settled.set)

    def reply_for(key: tuple[int, int]) -> Callable[[LaneReply], None]:
        def reply(r: LaneReply) -> None:
            try:
                r.outcome.unwrap()
                kind = "done"
            except LaneBrokenError as exc:
                kind = str(exc)
            with lock:
                replies[key] += 1
                outcomes[key] = kind
                maybe_settled()

        return reply

    def poster(engine: LaneEngine, lane: int, started: threading.Event) -> None:
        seq = 0
        while True:
            key = (lane, seq)
            with lock:
                try:
                    engine.post(lane, CallJob(fn=lambda env: None), reply_for(key))
                except LaneClosedError as exc:
                    refusals.append(str(exc))
                    return
                accepted.append(key)
            seq += 1
            if seq == 200:
                started.set()

    envs = Envs()
    engine = LaneEngine(envs, LANES)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        starts = [threading.Event() for _ in range(LANES)]
        with trio.fail_after(SAFETY):
            async with trio.open_nursery() as posters:
                for lane in range(LANES):
                    posters.start_soon(trio.to_thread.run_sync, poster, engine, lane, starts[lane])

                def closer() -> None:
                    for event in starts:
                        event.wait(SAFETY)
                    engine.close()  # from a foreign thread, while the posters post

                posters.start_soon(trio.to_thread.run_sync, closer)
    with lock:
        posting_done.set()
        maybe_settled()
    with trio.fail_after(SAFETY):
        await settled.wait()
    assert len(accepted) >= LANES * 200
    assert sorted(refusals) == [f"lane {lane} is no longer running" for lane in range(LANES)]
    assert set(replies) == set(accepted)
    assert all(count == 1 for count in replies.values())
    kinds = Counter(
        "done" if kind == "done" else kind.replace(str(lane), "<i>", 1)
        for (lane, _), kind in outcomes.items()
    )
    assert set(kinds) <= {"done", "lane <i> stopped before answering"}
    assert all(env.closes == 1 for env in envs.by_lane.values())
