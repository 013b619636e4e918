"""A Join's request deadlines on one loop timer.

Every request may carry a deadline (``timeout_ms``; rlmesh's clients send 300 s with
every step), and nearly every one is cancelled a few milliseconds later, when its reply
goes out. A loop timer per request (``call_later`` and ``cancel``: a timer handle
created, armed, stopped and closed per step) is most of that cost. Here the deadlines
live in a heap beside one armed loop timer, set for the earliest; a cancel only forgets
the token (its heap entry is dropped when it comes up, or when stale entries outnumber
live ones). When the timer fires, every deadline that is due fires, in deadline order.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable

__all__ = ["Deadlines"]

EARLY = 0.001
"""Seconds by which a deadline may fire early: the loop's timers are of millisecond
grain (uvloop), so one due within this is fired now rather than re-armed for it."""


class Deadlines:
    """Per-token deadlines (loop thread only); ``fire(token)`` when one is due.

    :meth:`start` (re)starts a token's deadline, :meth:`cancel` drops it; :meth:`close`
    drops them all, and nothing fires afterwards.
    """

    __slots__ = ("_armed_at", "_closed", "_fire", "_handle", "_heap", "_live", "_loop", "_serial")

    def __init__(self, loop: asyncio.AbstractEventLoop, fire: Callable[[int], None]) -> None:
        self._loop = loop
        self._fire = fire
        self._live: dict[int, int] = {}  # token -> the serial of its current start
        self._heap: list[tuple[float, int, int]] = []  # (when, serial, token)
        self._serial = 0
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = math.inf
        self._closed = False

    def __len__(self) -> int:
        """The deadlines still running."""
        return len(self._live)

    def start(self, token: int, seconds: float) -> None:
        """``token`` is due in ``seconds`` (replacing a deadline it had)."""
        if self._closed:
            return
        self._serial += 1
        self._live[token] = self._serial
        when = self._loop.time() + seconds
        heapq.heappush(self._heap, (when, self._serial, token))
        if when < self._armed_at:
            self._arm(when)
        elif len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def cancel(self, token: int) -> None:
        self._live.pop(token, None)

    def close(self) -> None:
        self._closed = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._live.clear()
        self._heap.clear()

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed_at = when
        self._handle = self._loop.call_at(when, self._expired)

    def _compact(self) -> None:
        live = self._live
        self._heap = [entry for entry in self._heap if live.get(entry[2]) == entry[1]]
        heapq.heapify(self._heap)

    def _expired(self) -> None:
        self._handle = None
        self._armed_at = math.inf
        now = self._loop.time() + EARLY
        heap, live = self._heap, self._live
        due: list[int] = []
        while heap and heap[0][0] <= now:
            _, serial, token = heapq.heappop(heap)
            if live.get(token) == serial:
                del live[token]
                due.append(token)
        while heap and live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)  # cancelled or restarted: stale
        if heap:
            self._arm(heap[0][0])
        for token in due:
            if self._closed:
                return
            self._fire(token)
