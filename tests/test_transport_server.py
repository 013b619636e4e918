"""The server's one lane-reply route: every job of every Join posted with one callback,
each reply handed to the Join that posted its job, by job id and lane."""

from __future__ import annotations

import threading
from typing import Any

import outcome
import pytest

from rlmesh_trio._bridge import ToLoop
from rlmesh_trio._errors import LaneDeadError
from rlmesh_trio._jobs import CallJob, LaneReply, Phases, ReplyFn, StepJob
from rlmesh_trio._transport._routes import ReplyRoutes


class FakeJoin:
    def __init__(self) -> None:
        self.replies: list[LaneReply] = []
        self.flushes = 0

        self.batches: list[list[LaneReply]] = []

    def on_lane_reply(self, reply: LaneReply) -> None:
        self.replies.append(reply)

    def on_lane_replies(self, batch: list[LaneReply]) -> None:
        self.batches.append(batch)

    def flush(self) -> None:
        self.flushes += 1


class Loop:
    """call_soon_threadsafe that queues; :meth:`run` runs what was queued (the loop)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
        self.calls.append((fn, args))

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for fn, args in calls:
            fn(*args)


def test_replies_reach_the_join_that_posted_and_each_join_flushes_once() -> None:
    loop = Loop()
    posted: list[tuple[int, Any, ReplyFn]] = []
    routes = ReplyRoutes(
        lambda lane, job, reply: posted.append((lane, job, reply)),
        3,
        ToLoop(loop.call_soon_threadsafe),
    )
    a, b = FakeJoin(), FakeJoin()
    step = StepJob(leaves=[], n=2, row=0, validated=True, id=7)  # one id, two lanes
    routes.post(0, step, a)  # type: ignore[arg-type]
    routes.post(2, step, a)  # type: ignore[arg-type]
    routes.post(1, CallJob(fn=lambda env: None, id=8), b)  # type: ignore[arg-type]
    callbacks = {reply for _, _, reply in posted}
    assert len(callbacks) == 1  # one callback for every job of every Join
    (reply,) = callbacks

    def answer(job_id: int, lane: int) -> None:
        reply(LaneReply(job_id, lane, outcome.Value(lane), Phases()))

    for args in ((7, 2), (8, 1), (7, 0)):  # from lane threads, interleaved Joins
        thread = threading.Thread(target=answer, args=args)
        thread.start()
        thread.join()
    assert len(loop.calls) == 1  # one wake-up of the loop for the whole batch
    answer(99, 0)  # nobody posted it (an ended Join's job): dropped
    loop.run()
    assert sorted(r.lane for r in a.replies) == [0, 2]
    assert [r.job_id for r in b.replies] == [8]
    assert (a.flushes, b.flushes) == (1, 1)
    # Each route is used once: a second reply for the same job and lane goes nowhere.
    answer(7, 0)
    loop.run()
    assert len(a.replies) == 2


def test_a_refused_post_leaves_no_route() -> None:
    def refuse(lane: int, job: Any, reply: ReplyFn) -> None:
        raise LaneDeadError("lane 0 is gone")

    loop = Loop()
    routes = ReplyRoutes(refuse, 1, ToLoop(loop.call_soon_threadsafe))
    with pytest.raises(LaneDeadError, match="lane 0 is gone"):
        routes.post(0, CallJob(fn=lambda env: None, id=3), FakeJoin())  # type: ignore[arg-type]
    assert routes._routes == {}


def _from_thread(fn: Any, *args: Any) -> None:
    thread = threading.Thread(target=fn, args=args)
    thread.start()
    thread.join()


def test_a_gathered_job_wakes_the_loop_once_when_its_last_lane_answers() -> None:
    loop = Loop()
    posted: list[tuple[int, Any, ReplyFn]] = []
    routes = ReplyRoutes(
        lambda lane, job, reply: posted.append((lane, job, reply)),
        4,
        ToLoop(loop.call_soon_threadsafe),
    )
    join = FakeJoin()
    gather = routes.gather(5, [0, 1, 3], join)  # type: ignore[arg-type]
    for lane in (0, 1, 3):
        routes.post_to(lane, StepJob(leaves=[], n=3, row=0, validated=True, id=5), gather.reply)
    answers = [LaneReply(5, lane, outcome.Value(lane), Phases()) for lane in (3, 0, 1)]
    for reply in answers[:2]:
        _from_thread(gather.reply, reply)
    assert loop.calls == []  # two of three lanes answered: the loop sleeps on
    _from_thread(gather.reply, answers[2])
    assert len(loop.calls) == 1
    loop.run()
    assert join.batches == [answers] and join.replies == [] and join.flushes == 1
    assert routes._routes == {}  # every lane's route used
    assert gather.release() == []  # the batch crossed: nothing is left to take


def test_a_released_gather_hands_over_what_came_and_the_rest_crosses_alone() -> None:
    loop = Loop()
    routes = ReplyRoutes(lambda lane, job, reply: None, 3, ToLoop(loop.call_soon_threadsafe))
    join = FakeJoin()
    gather = routes.gather(9, [0, 1, 2], join)  # type: ignore[arg-type]
    first = LaneReply(9, 1, outcome.Value(1), Phases())
    _from_thread(gather.reply, first)
    assert routes.release(gather) == [first]  # a deadline: what came so far
    assert sorted(routes._routes) == [9 * 3 + 0, 9 * 3 + 2]  # its route is used
    late = [LaneReply(9, lane, outcome.Value(lane), Phases()) for lane in (2, 0)]
    for reply in late:
        _from_thread(gather.reply, reply)
    loop.run()
    assert join.replies == late and join.batches == []  # one by one, as ungathered
    assert routes._routes == {}
