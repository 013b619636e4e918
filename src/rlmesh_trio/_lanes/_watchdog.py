"""Wedged lanes: the watchdog and what a wedge does.

A lane's env call is *wedged* when it overran ``lane_timeout`` (the watchdog, one Trio
task for all lanes) or a request's deadline (the session says so, through
:meth:`Wedges.request_deadline`). What happens then depends on the fault policy
(:meth:`Wedges.wedge`); a rebuild whose factory call overran is handled here too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from time import perf_counter_ns
from typing import Final

import outcome
import trio

from .._errors import LaneTimeoutError, LaneWedgedError
from .._jobs import Job, LaneFault, Phases
from ._lane import Incarnation, Item, Lane, answer
from ._state import LaneState
from ._supervisor import AbandonedLedger, thread_name
from ._work import verb_of

__all__ = ["BUILD_TIMEOUT_FLOOR", "Wedges"]

logger = logging.getLogger("rlmesh_trio.lanes")

BUILD_TIMEOUT_FLOOR: Final = 30.0
"""Seconds a rebuild's factory call may take, at least, before the watchdog gives up on it."""


class Wedges:
    """Declares lanes wedged. ``wake(i)`` (any thread) wakes lane ``i``'s supervisor;
    ``rebuild_failed(lane, inc, exc)`` declares a rebuild failed (the lane dead)."""

    def __init__(
        self,
        lanes: Sequence[Lane],
        *,
        rebuilds: bool,
        ledger: AbandonedLedger,
        wake: Callable[[int], None],
        rebuild_failed: Callable[[Lane, Incarnation, BaseException], None],
    ) -> None:
        self._lanes = lanes
        self._rebuilds = rebuilds
        self._ledger = ledger
        self._wake = wake
        self._rebuild_failed = rebuild_failed

    def request_deadline(self, lane: Lane, job: Job, seconds: float) -> None:
        """A request's deadline of ``seconds`` expired while ``job`` was queued on or run
        by ``lane``. Any thread; never blocks.

        The lane is wedged if ``job`` is the one running, or if the job running has run
        for longer than that deadline; otherwise ``job`` is merely queued behind a busy
        lane and nothing happens.
        """
        item = lane.current
        if item is None:
            return
        verb = verb_of(item[1])
        error = LaneTimeoutError(f"env.{verb} timed out after {round(seconds * 1000)}ms")
        min_age_ns = 0 if item[1] is job else int(seconds * 1e9)
        self.wedge(lane, item, error, min_age_ns=min_age_ns, answer=False)

    def wedge(
        self,
        lane: Lane,
        item: Item,
        error: LaneTimeoutError,
        *,
        min_age_ns: int,
        answer: bool,
    ) -> None:
        """``item``'s env call overran a deadline.

        ``rebuild``/``truncate``: ``item`` is answered now with ``error``; the call is
        interrupted (a process is killed; a thread cannot be, so it is abandoned with its
        env) and a fresh incarnation takes the lane; queued jobs wait for it.

        ``error``: the thread keeps running the call, and until it returns the lane
        refuses new jobs at once (:class:`LaneWedgedError`, naming the lane), so that a
        later session is not stuck behind it. ``item`` itself is answered now only when
        the lane's own watchdog declared it (``answer``); a request's deadline already
        answered its request, and the call's late result is still accounted when it
        comes, as the reference does (SPEC §7.11). Jobs already queued behind the call are
        refused with the wedge error when the watchdog declared it, and otherwise wait.
        """
        verb = verb_of(item[1])
        with lane.lock:
            if lane.current is not item or lane.stopping:
                return
            age = perf_counter_ns() - lane.since
            if age < min_age_ns:
                return
            if lane.state is LaneState.WEDGED and not answer:
                return  # declared already
            queued: list[Item] = []
            killed = False
            # Where the env is stuck, taken before anything interrupts it (item 8).
            stack = lane.incarnation.stack()
            if self._rebuilds:
                inc = lane.wedged_rebuilding(f"TimeoutError: {error}")
                killed = inc.interrupt()  # under the lock: never seen detached, not abandoned
            else:
                inc = lane.incarnation
                refusal = LaneWedgedError(
                    f"lane {lane.index} is wedged: its env.{verb} overran a deadline after "
                    f"{age / 1e9:.3g} s and has not returned"
                )
                queued = lane.wedged(refusal, take=answer)
        if self._rebuilds:
            self._interrupted(lane, inc, killed, verb, age, error, stack)
            fault = LaneFault(lane=lane.index, error=f"TimeoutError: {error}")
            _answer_error(lane, item, error, fault)
            self._wake(lane.index)
            return
        logger.warning(
            "lane %d: env.%s has run for %.3g s (%s) on thread %r; the lane refuses jobs "
            "until it returns. It is stuck in:\n%s",
            lane.index,
            verb,
            age / 1e9,
            error,
            thread_name(inc),
            stack,
        )
        if answer:
            _answer_error(lane, item, error)
        for waiting in queued:
            _answer_error(lane, waiting, refusal)

    def _interrupted(
        self,
        lane: Lane,
        inc: Incarnation,
        killed: bool,
        verb: str,
        age: int,
        error: LaneTimeoutError,
        stack: str,
    ) -> None:
        name = thread_name(inc)
        if killed:
            logger.warning(
                "lane %d: env.%s has run for %.3g s (%s); killed its process %s and "
                "rebuilding the lane in a fresh one. It was stuck in:\n%s",
                lane.index,
                verb,
                age / 1e9,
                error,
                inc.pid,
                stack,
            )
            return
        self._ledger.add(lane, inc)
        logger.warning(
            "lane %d: env.%s has run for %.3g s (%s); abandoning thread %r with its "
            "env and rebuilding the lane on a fresh thread (%d abandoned lane "
            "threads in this process). It is stuck in:\n%s",
            lane.index,
            verb,
            age / 1e9,
            error,
            name,
            self._ledger.count,
            stack,
        )

    def build_overran(self, lane: Lane, seconds: float) -> None:
        """Trio thread (watchdog): a rebuild's factory call overran its bound."""
        with lane.lock:
            inc = lane.incarnation
            if lane.state is not LaneState.REBUILDING or lane.current is not None:
                return
            if inc.thread is None or lane.stopping:
                return
            lane.detach()
            killed = inc.interrupt()
        if not killed:
            self._ledger.add(lane, inc)
        exc = TimeoutError(f"the env factory did not return within {seconds:.3g} s")
        # The new (never started) incarnation records the failure, as its own would.
        self._rebuild_failed(lane, lane.incarnation, exc)
        self._wake(lane.index)

    async def watchdog(self, seconds: float) -> None:
        """Declare wedged every lane job running longer than ``seconds``, and give up on a
        rebuild whose factory runs longer than ``max(seconds, BUILD_TIMEOUT_FLOOR)``
        (building an env -- or starting a lane's process -- may rightly take longer than
        any step).

        Sleeps until the earliest moment a running job could overrun, so it costs nothing
        per job and at most one wakeup per ``seconds`` while the lanes are idle.
        """
        limit_ns = int(seconds * 1e9)
        build_seconds = max(seconds, BUILD_TIMEOUT_FLOOR)
        build_ns = int(build_seconds * 1e9)
        millis = round(seconds * 1000)
        while True:
            now = perf_counter_ns()
            next_ns = now + limit_ns
            for lane in self._lanes:
                item, since, state = lane.current, lane.since, lane.state
                if item is None and state is not LaneState.REBUILDING:
                    continue
                due = since + (limit_ns if item is not None else build_ns)
                if due > now:
                    next_ns = min(next_ns, due)
                elif item is not None:
                    verb = verb_of(item[1])
                    error = LaneTimeoutError(f"env.{verb} timed out after {millis}ms")
                    self.wedge(lane, item, error, min_age_ns=limit_ns, answer=True)
                else:
                    self.build_overran(lane, build_seconds)
            await trio.sleep(max(next_ns - now, 1_000_000) / 1e9)


def _answer_error(
    lane: Lane, item: Item, error: BaseException, fault: LaneFault | None = None
) -> None:
    answer(lane.index, item, outcome.Error(error), Phases(), fault)
