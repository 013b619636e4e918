"""One lane: its mailbox, its state and the transitions that change it.

Every state change of a lane is one of :class:`Lane`'s transition methods (:meth:`serve`,
:meth:`rebuilding`, :meth:`wedged`, :meth:`wedged_rebuilding`, :meth:`dead`,
:meth:`stopped`), each called with the lane's lock held: it checks the move against
:data:`~._state.TRANSITIONS` and updates, together, every field that goes with the state
(the refusal ``post`` raises, the incarnation, the attempt counter, the clock the watchdog
reads). What the lane thread, the supervisor and the watchdog tell a lane besides (a job
begins or ends, a fault, a rebuilt env proven healthy, a thread abandoned, the
supervisor's deadline) are its event methods. Nothing else assigns a lane's fields, or
the fields of what it holds (``tests/test_lanes_fields.py`` reads ``_lanes/`` and holds
the rule).
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

_WEDGED: Final = LaneState.WEDGED
"""Read by :meth:`Lane.end_job` after every job: a module name (an enum member read off
its class costs ~100 ns on Python 3.11, a global ~10 ns)."""


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

SendAhead = Callable[[Job], bool]
"""``send_ahead(job) -> sent``: the posting thread hands ``job`` to the env's host at
once (a process lane's child); the lane thread then only waits for the answer."""


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

    def ahead(self) -> tuple[SendAhead, Execute] | None:
        """The incarnation's thread, after :meth:`build`: ``(send_ahead, finish)`` when a
        job can be handed to the env's host by the thread that posts it, while this
        thread is still being woken (:meth:`Lane.await_job`); ``finish(job, queue_ns)``
        then completes it here. None (the default): every job runs with the executor."""
        return None

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
        "ahead",
        "attempt",
        "current",
        "faults",
        "given_up",
        "incarnation",
        "index",
        "last_cause",
        "lock",
        "mailbox",
        "presend",
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
        self.presend: SendAhead | None = None
        """Set while the lane thread waits on an empty mailbox and its incarnation can
        take a job ahead (:meth:`await_job`): ``post`` hands the next job over with it."""
        self.ahead: Job | None = None
        """The job ``post`` handed over ahead, until the lane thread takes it."""
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
        self.presend = None
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
        for the caller to answer), as the lane's own watchdog does. The wedge is counted.

        Already WEDGED (a request's deadline declared the call first, and now the lane's
        own watchdog does): no state change and no second count; with ``take`` the jobs
        are taken out all the same."""
        if self.state is not LaneState.WEDGED:
            self._move(LaneState.WEDGED)
            self.wedges += 1
            self.refusal = refusal
        if not take:
            return []
        self.current = None
        return self.take_queued()

    def wedged_rebuilding(self, cause: str) -> Incarnation:
        """-> REBUILDING (policy ``rebuild``/``truncate``): the running job's env call
        overran a deadline. The wedge is counted, the job taken out (the caller answers
        it) and ``cause`` kept; the old incarnation, returned, is the caller's to
        interrupt."""
        self.wedges += 1
        self.current = None
        old = self.rebuilding()
        self.last_cause = cause
        return old

    def hold_off(self, refusal: LaneError) -> list[Item]:
        """REBUILDING, no state change: the fresh env is held back (a fault storm's
        backoff) and jobs are refused with ``refusal`` meanwhile (until
        :meth:`build_starts`); the queued ones are returned for the caller to answer."""
        self.refusal = refusal
        return self.take_queued()

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

    # ---- events (the lane lock held unless said) -------------------------------------
    #
    # What the lane thread, the supervisor and the watchdog tell a lane. Every write to a
    # lane's fields is here or above (tests/test_lanes_fields.py holds the rule). The
    # job ones (:meth:`begin_job`, :meth:`end_job`) run on the hot path, once a job each.

    def begin_job(self, item: MailboxItem, now: int) -> bool:
        """Lane thread: ``item``, just taken from the mailbox, starts running at ``now``
        (``perf_counter_ns()``). False, and nothing changes, when the lane stops instead
        (it is closing, or ``item`` is the stop sentinel)."""
        if self.stopping or isinstance(item, Stop):
            return False
        self.current = item
        self.since = now
        return True

    def await_job(self, send: SendAhead) -> None:
        """Lane thread, as it is about to wait on its mailbox: when nothing is queued and
        the lane is not stopping, the next job ``post`` queues is handed over ahead with
        ``send`` too (a process lane: written to the child's pipe by the posting thread,
        so the child runs it while the lane thread wakes). At most one job: the pipe
        carries one request at a time."""
        if not self.stopping and self.mailbox.empty():
            self.presend = send

    def post_ahead(self, job: Job) -> None:
        """``post``, as it queues ``job``: hand it over ahead if the lane thread waits for
        it (:meth:`await_job`)."""
        send, self.presend = self.presend, None
        if send is not None and send(job):
            self.ahead = job

    def take_ahead(self, item: MailboxItem) -> bool:
        """Lane thread, as it takes ``item`` from the mailbox: whether ``item`` was handed
        over ahead (its answer is then all that is left to wait for)."""
        ahead, self.ahead = self.ahead, None
        self.presend = None
        return ahead is not None and not isinstance(item, Stop) and item[1] is ahead

    def end_job(self, item: Item) -> bool:
        """Lane thread: the running ``item`` returned from the env (or was refused without
        running). False when it was taken out meanwhile and answered for the thread (the
        lane stopped or abandoned it, or policy ``error`` declared it wedged). A wedged
        lane whose call returned serves again (-> SERVING)."""
        if self.current is not item:
            return False
        self.current = None
        if self.state is _WEDGED:
            self.serve()
        return True

    def fault(self, item: Item, *, rebuild: bool, retry: bool) -> bool:
        """Lane thread, after :meth:`end_job`: ``item``'s env call raised. The fault is
        counted; with ``rebuild`` (policy ``rebuild``/``truncate``) and unless the lane is
        closing, it goes REBUILDING, and with ``retry`` the fresh incarnation runs
        ``item`` again first. Whether the thread hands over (it is detached now)."""
        self.faults += 1
        if not rebuild or self.stopping:
            return False
        self.rebuilding()
        if retry:
            self.retry = (item, 1)
        return True

    def went_down(self, cause: str) -> None:
        """Why the lane's env last went down (``"Type: message"``), for the messages that
        follow: a step refused on the rebuilt env, a fault storm's refusal."""
        self.last_cause = cause

    def take_retry(self) -> tuple[Item, int] | None:
        """Lane thread, as a fresh incarnation starts serving: the job it runs first (a
        reset retried after a fault) and how often it was tried, or None."""
        pending, self.retry = self.retry, None
        return pending

    def proven_healthy(self) -> None:
        """Lane thread, no lock (one flag, once per rebuilt env): a rebuilt env answered a
        step, so the lane is not in a fault storm."""
        self.proven = True

    def take_proof(self) -> bool:
        """Supervisor, no lock, as it counts a fault's rebuild: whether a rebuilt env
        answered a step since it last asked (:meth:`proven_healthy`); the proof is used
        up."""
        proven, self.proven = self.proven, False
        return proven

    def build_starts(self) -> None:
        """Supervisor: the fresh incarnation is started now. Jobs queue again (a fault
        storm's refusal is lifted) and, while rebuilding, the factory's bound counts from
        now."""
        self.refusal = None
        if self.state is LaneState.REBUILDING:
            self.since = perf_counter_ns()

    def thread_ended(self, inc: Incarnation, *, died: bool) -> tuple[bool, bool]:
        """Lane thread, last: ``inc``'s thread stops serving (``died``: of an engine bug).
        Returns ``(mine, lost)``: ``inc`` still held the lane (its thread no longer
        serves), and the lane is lost with it -- given up for good (:attr:`given_up`)."""
        mine = self.incarnation is inc and not inc.detached
        lost = mine and died and not self.stopping and not self.given_up
        if mine:
            self.running = False
        if lost:
            self.given_up = True
        return mine, lost

    def thread_abandoned(self) -> None:
        """One of the lane's threads was left behind, still running (a wedged env call, or
        a close that never returned)."""
        self.abandoned += 1

    def abandoned_thread_exited(self) -> None:
        """A thread the lane left behind finished on its own and exited."""
        self.abandoned -= 1

    def supervised(self) -> trio.CancelScope:
        """Trio thread, no lock, once (:meth:`LaneEngine.run`): the shielded scope the
        lane's supervisor runs in; teardown gives it the shared deadline."""
        self.scope = trio.CancelScope(shield=True)
        return self.scope

    def limit(self, deadline: float) -> None:
        """Trio thread, no lock, after :meth:`supervised`: the lane's supervisor is
        cancelled by ``deadline`` (Trio time) at the latest. A deadline only ever moves
        earlier: the teardown's shared one, an owner's stop bound."""
        assert self.scope is not None
        self.scope.deadline = min(self.scope.deadline, deadline)

    # ---- the mailbox --------------------------------------------------------------------

    def close_mailbox(self) -> bool:
        """Under the lock: take no more jobs, and stop. Whether it was closed already."""
        already = self.stopping
        self.accepting = False
        self.stopping = True
        self.presend = None
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
