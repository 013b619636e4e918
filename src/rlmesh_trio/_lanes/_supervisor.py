"""A lane's supervisor: one Trio task per lane that starts its incarnations, backs off
failed rebuilds, and retires or abandons the threads the lane left behind.

The supervisor never runs env code and never waits on a lane thread: it sleeps on the
lane's wake-up channel (a thread that exits, a fault, a close, a failed rebuild each send
one) or until the next moment it has something to do (a backoff over, a retired thread
overdue), and it returns when the lane stopped -- within the teardown deadline the engine
gives its (shielded) cancel scope.

:class:`AbandonedLedger` counts, process-wide, the threads left behind inside an env call:
past ``max_abandoned`` the engine is no longer healthy (health reports NOT_SERVING).
:class:`GivenUpLanes` counts the lanes given up for good: past ``max_given_up_lanes``
(default 0: the first one) the engine is no longer healthy either.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Final

import outcome
import trio

from .._bridge import thread_gone
from .._errors import LaneDeadError, LaneRebuildFailedError
from .._jobs import Phases
from ._lane import LANE_THREAD_PREFIX, Incarnation, Lane, answer
from ._state import LaneState

__all__ = [
    "FREE_REBUILDS",
    "MAX_LEFT_BEHIND",
    "REBUILD_BACKOFF",
    "AbandonedLedger",
    "GivenUpLanes",
    "Supervisor",
]

logger = logging.getLogger("rlmesh_trio.lanes")

REBUILD_BACKOFF: Final = (0.5, 30.0)
"""First delay and cap, in seconds, between failed rebuild attempts (doubling), and
between the rebuilds of a lane whose fresh envs keep faulting (a fault storm)."""

MAX_LEFT_BEHIND: Final = 8
"""Abandoned threads (in an env call or an ``env.close()`` that did not return) a lane
may leave behind, still running, before it is given up: dead, never rebuilt again, so
that a storm of faults cannot grow the process's threads without bound."""

FREE_REBUILDS: Final = 5
"""Rebuilds in a row (no rebuilt env answering a step in between) done at once; past
them a lane's fresh envs are built after the backoff of :data:`REBUILD_BACKOFF`."""


def thread_name(inc: Incarnation) -> str:
    return inc.thread.name if inc.thread is not None else "?"


class AbandonedLedger:
    """Lane threads abandoned in a wedged env call (or a close that never returned) and
    still running, over all lanes. Any thread."""

    def __init__(self, max_abandoned: int) -> None:
        self.max_abandoned = max_abandoned
        self._lock = threading.Lock()
        self.count = 0

    @property
    def healthy(self) -> bool:
        return self.count <= self.max_abandoned

    def add(self, lane: Lane, inc: Incarnation) -> None:
        """``inc``'s thread is left behind: count it, rename it, say so past the cap."""
        with self._lock:
            self.count += 1
            over = self.count > self.max_abandoned
        with lane.lock:
            lane.thread_abandoned()
        if inc.thread is not None:
            inc.thread.name = f"{LANE_THREAD_PREFIX}{lane.index}-abandoned"
        if over:
            logger.error(
                "%d lane threads are abandoned, more than the %d tolerated: health now "
                "reports NOT_SERVING; restart this server",
                self.count,
                self.max_abandoned,
            )

    def returned(self, lane: Lane, inc: Incarnation) -> None:
        """An abandoned thread finished on its own and exited."""
        with self._lock:
            self.count -= 1
        with lane.lock:
            lane.abandoned_thread_exited()
        logger.info(
            "lane %d: abandoned thread %r finished on its own and exited",
            lane.index,
            thread_name(inc),
        )


class GivenUpLanes:
    """The lanes given up for good (:attr:`Lane.given_up`: dead, never rebuilt again
    in this process), for health. Any thread.

    Such a lane fails every whole-vector request from then on, so past ``tolerated``
    (``max_given_up_lanes``; default 0) the engine is no longer healthy: health reports
    NOT_SERVING and a supervisor restarts the process. A lane that is down only for a
    while (rebuilding, dead until its next rebuild attempt, wedged) is not counted here;
    ``min_serving_lanes`` counts those.
    """

    def __init__(self, lanes: Sequence[Lane], tolerated: int) -> None:
        self._lanes = lanes
        self.tolerated = tolerated

    @property
    def count(self) -> int:
        return sum(lane.given_up for lane in self._lanes)

    @property
    def healthy(self) -> bool:
        return self.count <= self.tolerated

    def added(self, lane: Lane) -> None:
        """``lane`` was just given up (its ``given_up`` set): say what that does to health."""
        count = self.count
        if count > self.tolerated:
            logger.error(
                "lane %d is given up for good: health now reports NOT_SERVING (%d of %d "
                "lanes given up, max_given_up_lanes tolerates %d); restart this server",
                lane.index,
                count,
                len(self._lanes),
                self.tolerated,
            )
        else:
            logger.warning(
                "lane %d is given up for good; health stays SERVING (%d of %d lanes "
                "given up, max_given_up_lanes tolerates %d): whole-vector requests fail "
                "until this server restarts",
                lane.index,
                count,
                len(self._lanes),
                self.tolerated,
            )


class Supervisor:
    """The supervisors of an engine's lanes (one :meth:`run` task per lane).

    ``start(lane, inc)`` starts an incarnation's thread; ``rebuilds`` is false under
    policy ``error`` (a dead lane then stays dead); ``max_left_behind`` is
    :data:`MAX_LEFT_BEHIND`; a lane it gives up is told to ``given_up``.
    """

    def __init__(
        self,
        *,
        start: Callable[[Lane, Incarnation], None],
        ledger: AbandonedLedger,
        given_up: GivenUpLanes,
        rebuilds: bool,
        retire_timeout: float,
        backoff: tuple[float, float],
        max_left_behind: int | None = None,
    ) -> None:
        self._start = start
        self._ledger = ledger
        self._given_up = given_up
        self._rebuilds = rebuilds
        self._retire_timeout = retire_timeout
        self._backoff = backoff
        self._max_left_behind = MAX_LEFT_BEHIND if max_left_behind is None else max_left_behind

    def rebuild_delay(self, attempt: int) -> float:
        first, cap = self._backoff
        return float(min(first * 2 ** max(attempt - 1, 0), cap))

    async def run(self, lane: Lane, wakeups: trio.MemoryReceiveChannel[None]) -> None:
        """Supervise ``lane`` until it stopped; then answer what is left and mark it
        STOPPED. The caller runs this in ``lane.scope`` (shielded, given the teardown
        deadline)."""
        assert lane.scope is not None
        threads: list[Incarnation] = []  # started and not exited yet
        ending: list[Incarnation] = []  # ran their last act; the OS thread may still be up
        retire_by: dict[int, float] = {}  # id(detached incarnation) -> abandon it then
        retry_at = math.inf
        start_at = math.inf  # when the fresh incarnation starts (a fault storm's backoff)
        streak = 0  # faults in a row, no rebuilt env answering a step in between
        with lane.scope:
            while True:
                now = trio.current_time()
                for inc in list(threads):
                    if inc.exited.is_set():
                        threads.remove(inc)
                        ending[:] = [i for i in ending if i.thread and i.thread.is_alive()]
                        ending.append(inc)
                        retire_by.pop(id(inc), None)
                        if inc.abandoned:
                            self._ledger.returned(lane, inc)
                    elif inc.detached and not inc.abandoned:
                        by = retire_by.setdefault(id(inc), now + self._retire_timeout)
                        if now >= by:
                            self._abandon_retired(lane, inc)
                            retire_by.pop(id(inc), None)
                current = lane.incarnation
                if lane.stopping:
                    if current.thread is None or current.exited.is_set():
                        break
                elif lane.state is LaneState.DEAD and (not self._rebuilds or lane.given_up):
                    pass  # lost (policy error) or given up: refuses until the stop
                elif lane.state is LaneState.DEAD:
                    if retry_at == math.inf:
                        retry_at = now + self.rebuild_delay(lane.attempt)
                    elif now >= retry_at:
                        retry_at = math.inf
                        self._next_attempt(lane)
                        continue
                elif current.thread is None:
                    if start_at == math.inf and lane.state is LaneState.REBUILDING:
                        left = sum(inc.abandoned and not inc.exited.is_set() for inc in threads)
                        if left > self._max_left_behind:
                            self._give_up(lane, left)
                            continue
                        if lane.attempt == 1:  # a fault (not a retry of a failed build)
                            streak = 1 if lane.take_proof() else streak + 1
                        free = streak <= FREE_REBUILDS
                        delay = 0.0 if free else self.rebuild_delay(streak - FREE_REBUILDS)
                        if delay and lane.attempt == 1:
                            self._hold_off(lane, streak, delay)
                        start_at = now + delay if lane.attempt == 1 else now
                    elif start_at == math.inf:
                        start_at = now
                    if now >= start_at:
                        start_at = math.inf
                        with lane.lock:
                            lane.build_starts()
                        self._start(lane, current)
                        threads.append(current)
                        continue
                elif current.exited.is_set():
                    break  # startup ended (failure or close before the decision)
                with trio.move_on_at(min(retry_at, start_at, *retire_by.values(), math.inf)):
                    await wakeups.receive()
            # The lane stopped: wait (within the teardown deadline) for threads still
            # closing a faulted env; abandoned ones are not waited for.
            for inc in threads:
                if not inc.abandoned:
                    await inc.exited.wait()
                    ending.append(inc)
            # ... and for their OS threads to be gone, so that a caller that returns from
            # serving finds none of its lane threads alive.
            for inc in ending:
                if inc.thread is not None and not inc.abandoned:
                    await thread_gone(inc.thread)
        for inc in threads:  # no child outlives the teardown; threads are left behind
            if not inc.exited.is_set():
                inc.interrupt()
        if lane.scope.cancelled_caught:
            current = lane.incarnation
            if current.thread is not None and not current.exited.is_set():
                logger.warning(
                    "lane %d did not stop within the %.3g s teardown deadline; "
                    "abandoning its thread %r",
                    lane.index,
                    self._retire_timeout,
                    current.thread.name,
                )
        # Jobs still queued (e.g. posted while a rebuild was pending when the stop came,
        # so no thread took them) are answered as stopped; idempotent otherwise.
        lane.fail_pending()
        with lane.lock:
            lane.stopped()

    def _hold_off(self, lane: Lane, streak: int, delay: float) -> None:
        """A fault storm: the lane's fresh envs keep faulting. The next one is built
        after ``delay``; meanwhile jobs are refused (recoverable) instead of queueing."""
        cause = lane.last_cause or "a fault"
        refusal = LaneRebuildFailedError(
            f"lane {lane.index} faulted {streak} times in a row (last: {cause}); it is "
            f"rebuilt again in {delay:.3g} s"
        )
        with lane.lock:
            if lane.stopping:
                return
            waiting = lane.hold_off(refusal)
        logger.warning(
            "lane %d: %d faults in a row (last: %s); holding the rebuild back for %.3g s",
            lane.index,
            streak,
            cause,
            delay,
        )
        for item in waiting:
            answer(lane.index, item, outcome.Error(refusal), Phases())

    def _give_up(self, lane: Lane, left: int) -> None:
        """The lane left more threads behind than tolerated: dead for good."""
        cause = (
            f"{left} threads it abandoned are still running (an env.close() or env call "
            "that does not return)"
        )
        refusal = LaneDeadError(
            f"lane {lane.index} is given up after repeated faults: {cause}; restart the "
            "server to get it back"
        )
        with lane.lock:
            if lane.stopping or lane.state is not LaneState.REBUILDING:
                return
            waiting = lane.dead(refusal, cause, for_good=True)
        logger.error(
            "lane %d: given up, not rebuilt again: %s (at most %d tolerated)",
            lane.index,
            cause,
            self._max_left_behind,
        )
        self._given_up.added(lane)
        for item in waiting:
            answer(lane.index, item, outcome.Error(refusal), Phases())

    def _next_attempt(self, lane: Lane) -> None:
        """A DEAD lane's backoff is over: try the factory again."""
        with lane.lock:
            if lane.stopping or lane.state is not LaneState.DEAD:
                return
            lane.rebuilding()

    def _abandon_retired(self, lane: Lane, old: Incarnation) -> None:
        """A detached thread did not finish closing its env in time: count it abandoned."""
        old.abandoned = True
        self._ledger.add(lane, old)
        logger.warning(
            "lane %d: the faulted env's close() has not returned after %.3g s; "
            "abandoning thread %r (%d abandoned lane threads in this process)",
            lane.index,
            self._retire_timeout,
            thread_name(old),
            self._ledger.count,
        )
