"""A Join's request deadlines on one loop timer (``_transport._deadlines.Deadlines``).

Driven by a fake loop whose clock the test moves: what fires, when, in which order; a
cancelled or restarted deadline never fires for its old time; stale entries do not pile
up; nothing fires after close. The end-to-end deadline behaviour (TIMEOUT replies, a
deadline while a request waits its turn) is in test_transport_service.py and the
differential suites.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh_trio._transport._deadlines import EARLY, Deadlines

pytestmark = pytest.mark.timeout(60)


class FakeHandle:
    def __init__(self, loop: FakeLoop, when: float, callback: Any) -> None:
        self.loop, self.when, self.callback = loop, when, callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    def __init__(self) -> None:
        self.now = 100.0
        self.handles: list[FakeHandle] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Any) -> FakeHandle:
        handle = FakeHandle(self, when, callback)
        self.handles.append(handle)
        return handle

    def armed(self) -> list[FakeHandle]:
        return [h for h in self.handles if not h.cancelled]

    def advance(self, seconds: float) -> None:
        """Move the clock, running every armed handle that comes due, in time order."""
        target = self.now + seconds
        while True:
            due = [h for h in self.armed() if h.when <= target]
            if not due:
                break
            handle = min(due, key=lambda h: h.when)
            self.now = max(self.now, handle.when)
            handle.cancelled = True  # a handle runs once
            handle.callback()
        self.now = target


def _deadlines() -> tuple[FakeLoop, Deadlines, list[tuple[int, float]]]:
    loop = FakeLoop()
    fired: list[tuple[int, float]] = []
    deadlines = Deadlines(
        cast(asyncio.AbstractEventLoop, loop), lambda t: fired.append((t, loop.now))
    )
    return loop, deadlines, fired


def test_due_deadlines_fire_in_order_on_one_timer() -> None:
    loop, deadlines, fired = _deadlines()
    deadlines.start(1, 3.0)
    deadlines.start(2, 1.0)
    deadlines.start(3, 2.0)
    assert len(loop.armed()) == 1 and loop.armed()[0].when == 101.0
    loop.advance(10)
    assert fired == [(2, 101.0), (3, 102.0), (1, 103.0)]
    assert len(deadlines) == 0 and loop.armed() == []


def test_cancelled_and_restarted_deadlines_keep_only_their_last_start() -> None:
    loop, deadlines, fired = _deadlines()
    deadlines.start(1, 1.0)
    deadlines.start(2, 2.0)
    deadlines.cancel(1)
    deadlines.start(2, 5.0)  # restarted: its first start no longer counts
    deadlines.cancel(99)  # unknown: nothing
    loop.advance(3)
    assert fired == []
    loop.advance(3)
    assert fired == [(2, 105.0)]


def test_a_fired_deadline_may_start_another() -> None:
    loop = FakeLoop()
    fired: list[int] = []

    def fire(token: int) -> None:
        fired.append(token)
        if token < 3:
            deadlines.start(token + 1, 0.5)

    deadlines = Deadlines(cast(asyncio.AbstractEventLoop, loop), fire)
    deadlines.start(1, 1.0)
    loop.advance(5)
    assert fired == [1, 2, 3]


def test_stale_entries_do_not_pile_up() -> None:
    """rlmesh's clients send a 300 s deadline with every step, cancelled milliseconds
    later: a million steps must not leave a million heap entries."""
    loop, deadlines, fired = _deadlines()
    deadlines.start(0, 1000.0)  # one that stays
    for token in range(1, 100_000):
        deadlines.start(token, 300.0)
        deadlines.cancel(token)
    assert len(deadlines._heap) <= 2 * len(deadlines) + 65
    loop.advance(2000)
    assert fired == [(0, 1100.0)]


def test_nothing_fires_after_close() -> None:
    loop, deadlines, fired = _deadlines()
    deadlines.start(1, 1.0)
    deadlines.close()
    deadlines.start(2, 1.0)
    loop.advance(5)
    assert fired == [] and loop.armed() == []


def test_close_from_a_firing_deadline_stops_the_rest() -> None:
    loop = FakeLoop()
    fired: list[int] = []

    def fire(token: int) -> None:
        fired.append(token)
        deadlines.close()

    deadlines = Deadlines(cast(asyncio.AbstractEventLoop, loop), fire)
    deadlines.start(1, 1.0)
    deadlines.start(2, 1.0)
    loop.advance(5)
    assert fired == [1]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(("start", "start", "cancel", "advance")),
            st.integers(0, 6),
            st.integers(0, 500).map(lambda n: n / 100),  # whole 10 ms: far above EARLY
        ),
        max_size=40,
    )
)
def test_fires_what_one_timer_per_deadline_would(ops: list[tuple[str, int, float]]) -> None:
    """Against a model with one timer per token: each advance of the clock fires the
    same tokens, each at its deadline (within the loop's millisecond grain)."""
    loop, deadlines, fired = _deadlines()
    model: dict[int, float] = {}
    for op, token, seconds in ops:
        if op == "start":
            deadlines.start(token, seconds)
            model[token] = loop.now + seconds
        elif op == "cancel":
            deadlines.cancel(token)
            model.pop(token, None)
        else:
            target = loop.now + seconds
            due = {t: w for t, w in model.items() if w <= target + 1e-9}
            model = {t: w for t, w in model.items() if t not in due}
            fired.clear()
            loop.advance(seconds)
            assert sorted(t for t, _ in fired) == sorted(due)
            for t, at in fired:
                assert due[t] - EARLY - 1e-9 <= at <= due[t] + 1e-9
            assert [at for _, at in fired] == sorted(at for _, at in fired)
    assert len(deadlines) == len(model)
