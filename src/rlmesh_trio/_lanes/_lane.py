"""One lane: its mailbox, its state and the transitions that change it.

Every state change of a lane is one of :class:`Lane`'s transition methods (:meth:`serve`,
:meth:`rebuilding`, :meth:`wedged`, :meth:`dead`, :meth:`stopped`), each called with the
lane's lock held: it checks the move against :data:`~._state.TRANSITIONS` and updates,
together, every field that goes with the state (the refusal ``post`` raises, the
incarnation, the attempt counter, the clock the watchdog reads). Nothing else assigns
``state``.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Final

import outcome
import trio

from .._errors import LaneBrokenError, LaneDeadError, LaneError, LaneWedgedError
from .._jobs import Job, LaneFault, LaneReply, Phases, ReplyFn
from ._state import LaneState, check_transition

if TYPE_CHECKING:
    from ._contract import EnvFacts
    from ._work import LaneWork

logger = logging.getLogger("rlmesh_trio.lanes")


LANE_THREAD_PREFIX: Final = "rlmesh-trio-lane-"
"""Lane ``i``'s serving thread is named ``f"{LANE_THREAD_PREFIX}{i}"``. A thread the lane
left behind is renamed ``...-<i>-retired`` (closing a faulted env) or ``...-<i>-abandoned``
(stuck in a wedged env call)."""


class Stop:
    """The mailbox sentinel that tells a lane thread to wind down."""

    __slots__ = ()


STOP: Final = Stop()

Item = tuple[int, Job, ReplyFn]
"""``(perf_counter_ns() at post, job, reply)``."""

MailboxItem = Item | Stop

Execute = Callable[[Job, int], tuple[outcome.Outcome[Any], Phases, bool]]
"""``execute(job, queue_ns) -> (outcome, phases, env_raised)`` (:meth:`LaneWork.execute`)."""


class Incarnation:
    """One OS thread of a lane and its env: the bookkeeping, and the protocol."""

    __slots__ = ("abandoned", "detached", "exited", "index", "number", "thread")

    def __init__(self, index: int, number: int) -> None:
        self.index = index
        self.number = number
        self.thread: threading.Thread | None = None
        self.detached = False
        """The lane moved on (this thread faulted or was abandoned): it takes no more jobs,
        closes its env when it gets control back, and exits."""
        self.abandoned = False
        """Detached while still inside an env call (wedged) and not killable."""
        self.exited = trio.Event()
        """Set on the Trio thread once the thread's last act ran."""

    @property
    def pid(self) -> int | None:
        """The env's process, when it has one of its own."""
        return None

    def build(self) -> EnvFacts:
        """The incarnation's thread: build the env; what it serves, or the factory's error."""
        raise NotImplementedError

    def executor(self, work: LaneWork) -> Execute:
        """The incarnation's thread, after :meth:`build`: how it runs one job."""
        raise NotImplementedError

    def interrupt(self) -> bool:
        """Any thread: stop the env call that overran. True when it was killed; False
        when it cannot be and the thread is left behind (:attr:`abandoned`)."""
        raise NotImplementedError

    def close(self, timeout: float) -> None:
        """The incarnation's thread, last: close the env (never raises)."""
        raise NotImplementedError

    def lost_by(self, error: BaseException) -> bool:
        """Whether a job's ``error`` means the env is gone with its host (a process lane's
        child died): under policy ``error`` the lane is then dead."""
        return False

    def stack(self) -> str:
        """Any thread: where the env's code is right now, for the wedge warning -- the
        thread's current Python stack (``sys._current_frames()``), innermost last."""
        thread = self.thread
        frame = sys._current_frames().get(thread.ident) if thread and thread.ident else None
        if frame is None:
            return "(the lane thread has no Python stack: it has exited)"
        return "".join(traceback.format_stack(frame)).rstrip()


Spawn = Callable[[int, int], Incarnation]
"""``spawn(lane, number)``: a lane's incarnation ``number``, not started yet (the
protocol and its two variants are in :mod:`._incarnation`)."""


class Lane:
    """One lane's mailbox and state. ``lock`` guards the mutable fields below.

    The lock is the lane's own (never shared between lanes) and is only held for a few
    attribute reads and writes, never while a job runs, so ``post`` never really waits.
    The mailbox outlives the lane's incarnations: jobs queued while a lane is rebuilt are
    served by the fresh env.
    """

    __slots__ = (
        "abandoned",
        "accepting",
        "attempt",
        "current",
        "faults",
        "given_up",
        "incarnation",
        "index",
        "last_cause",
        "lock",
        "mailbox",
        "proven",
        "rebuilds",
        "refusal",
        "retry",
        "running",
        "scope",
        "since",
        "spawn",
        "state",
        "stopping",
        "wedges",
    )

    def __init__(self, index: int, spawn: Spawn) -> None:
        self.index = index
        self.spawn = spawn
        self.mailbox: queue.SimpleQueue[MailboxItem] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.accepting = True
        """``post`` puts jobs into the mailbox (false once closing or the thread is gone)."""
        self.stopping = False
        """Close was requested: finish the current job, answer the queued ones as stopped."""
        self.current: Item | None = None
        """The job the lane thread is running; whoever takes it out answers it."""
        self.since = 0
        """``perf_counter_ns()`` when ``current`` started (or the rebuild began)."""
        self.running = False
        """The lane thread is up and serving (set at startup, cleared when it exits)."""
        self.scope: trio.CancelScope | None = None
        self.state = LaneState.STARTING
        self.refusal: LaneError | None = None
        """While set, ``post`` raises it instead of queueing (wedged, dead)."""
        self.incarnation: Incarnation = spawn(index, 0)
        self.retry: tuple[Item, int] | None = None
        """A job the next incarnation runs first (a reset retried after a fault)."""
        self.attempt = 0
        """Rebuild attempts since the lane last served (for backoff and messages)."""
        self.last_cause = ""
        self.faults = 0
        self.wedges = 0
        self.rebuilds = 0
        self.abandoned = 0
        """Abandoned threads of this lane still running (wedged env calls)."""
        self.proven = False
        """A rebuilt env answered a step: the lane is not in a fault storm (backoff)."""
        self.given_up = False
        """The lane is lost for good: dead (too many threads left behind; a process lane
        lost under policy ``error``) or its thread died of an engine bug. Never rebuilt
        again; health counts it (``max_given_up_lanes``) until the process restarts."""

    # ---- transitions (the lane lock held) --------------------------------------------

    def _move(self, new: LaneState) -> LaneState:
        old = self.state
        check_transition(self.index, old, new)
        self.state = new
        # One record per state change (docs/supervision.md, "Observing it"); startup and
        # stop, which every lane makes, at DEBUG. Rare: logged under the lane lock.
        quiet = old is LaneState.STARTING or new is LaneState.STOPPED
        attempt = f" (rebuild attempt {self.attempt + 1})" if new is LaneState.REBUILDING else ""
        logger.log(
            logging.DEBUG if quiet else logging.INFO,
            "lane %d: %s -> %s%s",
            self.index,
            old.value,
            new.value,
            attempt,
        )
        return old

    def serve(self) -> int:
        """-> SERVING: startup agreed, a fresh env agreed (a rebuild), or a wedged call
        returned. The lane takes jobs again. Returns the rebuild attempts it took (0 when
        it was no rebuild)."""
        old = self._move(LaneState.SERVING)
        self.refusal = None
        self.running = True
        if old is not LaneState.REBUILDING:
            return 0
        self.rebuilds += 1
        attempt, self.attempt = self.attempt, 0
        return attempt

    def rebuilding(self) -> Incarnation:
        """-> REBUILDING: the env faulted or wedged (from SERVING), or a failed rebuild's
        backoff is over (from DEAD). A fresh incarnation (not started yet) takes the lane;
        the old one, returned, is detached. Queued jobs wait for the fresh env."""
        was = self._move(LaneState.REBUILDING)
        self.refusal = None
        self.attempt += 1
        self.since = perf_counter_ns()
        # A dead lane's incarnation gave up by itself (its thread exits on its own).
        return self.detach() if was is LaneState.SERVING else self._next_incarnation()

    def detach(self) -> Incarnation:
        """The lane moves on from its incarnation, which stops serving (no state change
        here: a rebuild whose factory overran gets a new, never started, incarnation
        before it is declared dead)."""
        old = self._next_incarnation()
        old.detached = True
        return old

    def _next_incarnation(self) -> Incarnation:
        old = self.incarnation
        self.incarnation = self.spawn(self.index, old.number + 1)
        return old

    def wedged(self, refusal: LaneWedgedError, *, take: bool) -> list[Item]:
        """-> WEDGED (policy ``error``): refuse new jobs with ``refusal`` until the call
        returns. ``take``: the running job and the queued ones are taken out (returned,
        for the caller to answer), as the lane's own watchdog does."""
        self._move(LaneState.WEDGED)
        self.refusal = refusal
        if not take:
            return []
        self.current = None
        return self.take_queued()

    def hold_off(self, refusal: LaneError | None) -> list[Item]:
        """REBUILDING, no state change: the fresh env is held back (a fault storm's
        backoff) and jobs are refused with ``refusal`` meanwhile (None: they queue again);
        the queued ones are returned for the caller to answer."""
        self.refusal = refusal
        return self.take_queued() if refusal is not None else []

    def dead(self, refusal: LaneDeadError, cause: str, *, for_good: bool = False) -> list[Item]:
        """-> DEAD: a rebuild failed (for a while: the supervisor tries again), or, with
        ``for_good``, the lane is given up (:attr:`given_up`: a process lane lost under
        ``error``, too many threads left behind). Jobs are refused with ``refusal``; the
        queued ones are returned for the caller to answer."""
        self._move(LaneState.DEAD)
        if for_good:
            self.given_up = True
        self.last_cause = cause
        self.refusal = refusal
        return self.take_queued()

    def stopped(self) -> None:
        """-> STOPPED: the lane's supervisor is done (the engine closed)."""
        self._move(LaneState.STOPPED)

    # ---- the mailbox --------------------------------------------------------------------

    def close_mailbox(self) -> bool:
        """Under the lock: take no more jobs, and stop. Whether it was closed already."""
        already = self.stopping
        self.accepting = False
        self.stopping = True
        return already

    def take_queued(self) -> list[Item]:
        """Under the lock: every job waiting in the mailbox (and the retry slot)."""
        items: list[Item] = []
        if self.retry is not None:
            items.append(self.retry[0])
            self.retry = None
        stop = False
        while True:
            try:
                item = self.mailbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Stop):
                stop = True
            else:
                items.append(item)
        if stop:
            self.mailbox.put(STOP)
        return items

    def fail_pending(self) -> None:
        """Any thread: stop taking jobs; answer the running and the queued ones as stopped.

        Safe to run concurrently from the lane thread and the Trio thread (an abandoned
        lane that later comes back): each job is taken out of ``current`` or the mailbox by
        exactly one caller, under the lane lock or by the queue itself.
        """
        with self.lock:
            self.close_mailbox()
            current, self.current = self.current, None
            queued = self.take_queued()
        if current is not None:
            answer(self.index, current, outcome.Error(stopped_error(self.index)), Phases())
        for item in queued:
            answer(self.index, item, outcome.Error(stopped_error(self.index)), Phases())
        # No job can follow (``accepting`` is false); a fresh sentinel makes sure a lane
        # thread that comes back from being abandoned finds its way out of ``get()``.
        self.mailbox.put(STOP)


def stopped_error(index: int) -> LaneBrokenError:
    return LaneBrokenError(f"lane {index} stopped before answering")


def answer(
    index: int,
    item: Item,
    result: outcome.Outcome[Any],
    phases: Phases,
    fault: LaneFault | None = None,
) -> None:
    """Hand one answer to the job's reply callback; a callback error must not kill the lane."""
    _posted, job, reply = item
    try:
        reply(LaneReply(job.id, index, result, phases, fault))
    except Exception:
        logger.exception("lane %d: the reply callback of a %s raised", index, type(job).__name__)
