"""The lane thread: one incarnation's whole life, on its own OS thread.

Build the env (:meth:`Incarnation.build`, so the env is created on the thread that will
use it), report to the engine, serve the lane's mailbox (decode, env call, encode, answer
-- the hot path), hand over to a fresh incarnation after a fault, close the env. Nothing
here blocks on the Trio thread: what the supervisor must know crosses with ``to_trio``.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Sequence
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Final

import outcome

from .._errors import (
    ContractMismatchError,
    LaneDeadError,
    LaneNeedsResetError,
    LaneRebuildFailedError,
    exception_text,
)
from .._jobs import Job, LaneFault, Phases, ResetJob, StepJob
from ._contract import EnvFacts, contract_differences
from ._lane import (
    LANE_THREAD_PREFIX,
    Execute,
    Incarnation,
    Item,
    Lane,
    SendAhead,
    Stop,
    answer,
    stopped_error,
)
from ._state import LaneState
from ._work import LaneWork, verb_of

if TYPE_CHECKING:
    from .._record._served import LaneRecorder

__all__ = ["LaneThreads", "Progress", "Serving"]

logger = logging.getLogger("rlmesh_trio.lanes")


class Progress(enum.Enum):
    """How far an incarnation's env got, as its lane thread serves it: what it may run,
    and what it still has to tell the lane. ``FRESH -> RESET -> PROVEN``, never back."""

    FRESH = "fresh"
    """A rebuilt env the client has not reset yet: a step is refused, not run (and no
    job is handed over ahead: it could be one)."""
    RESET = "reset"
    """Reset, no step answered yet: the first one proves the rebuilt env healthy
    (:meth:`Lane.proven_healthy`: the lane is not in a fault storm)."""
    PROVEN = "proven"
    """Nothing left to prove: a rebuilt env answered a step, or the lane's first env."""


# The members as module names, for the serve loop: on Python 3.11 ``Progress.PROVEN``
# costs about 100 ns (an enum member is a descriptor on its class), a global 10 ns.
FRESH: Final = Progress.FRESH
RESET: Final = Progress.RESET
PROVEN: Final = Progress.PROVEN


class LaneThreads:
    """Starts and runs the lane threads of one engine.

    ``to_trio(fn, *args)`` runs ``fn`` on the Trio thread (any thread; dropped once the
    engine's run is over); ``report(index, outcome)`` (Trio thread) receives the first
    incarnation's facts; ``exited(lane, inc)`` (Trio thread) a thread's last act;
    ``wake(index)`` (Trio thread) wakes the lane's supervisor; ``rebuild_delay(attempt)``
    is the supervisor's backoff (for the log); ``gave_up(lane)`` (any thread) is told of
    a lane given up for good here (a process lane lost under ``error``, a lane thread
    that died of an engine bug).

    Startup: the first incarnations build, report, and wait on :attr:`go`; the engine
    sets :attr:`work` and :attr:`facts0` (the contract is agreed) before setting ``go``,
    or leaves them None (wind down).
    """

    def __init__(
        self,
        *,
        rebuilds: bool,
        truncate: bool,
        close_timeout: float,
        to_trio: Callable[..., None],
        report: Callable[[int, outcome.Outcome[EnvFacts]], None],
        exited: Callable[[Lane, Incarnation], None],
        wake: Callable[[int], None],
        rebuild_delay: Callable[[int], float],
        gave_up: Callable[[Lane], None],
    ) -> None:
        self._rebuilds = rebuilds
        self._truncate = truncate
        self._close_timeout = close_timeout
        self._to_trio = to_trio
        self._report = report
        self._exited = exited
        self._wake = wake
        self._rebuild_delay = rebuild_delay
        self._gave_up = gave_up
        self.go = threading.Event()
        self.work: LaneWork | None = None
        self.facts0: EnvFacts | None = None
        self.recorders: Sequence[LaneRecorder | None] = ()
        """Each lane's recorder (issue 33; set with ``work``, or left empty: none)."""

    def start(self, lane: Lane, inc: Incarnation) -> None:
        """Trio thread: start ``inc``'s thread (a fresh ``threading.Thread``, never a
        pooled worker: a rebuilt lane gets a thread no env ever ran on)."""
        thread = threading.Thread(
            target=self._main,
            args=(lane, inc),
            name=f"{LANE_THREAD_PREFIX}{lane.index}",
            daemon=True,
        )
        inc.thread = thread
        thread.start()

    def _main(self, lane: Lane, inc: Incarnation) -> None:
        """One incarnation's whole life: build the env, serve the mailbox, close the env."""
        died = False
        try:
            if lane.stopping:  # closed (or startup failed elsewhere) before we built
                return
            try:
                facts = inc.build()
            except Exception as exc:
                if inc.number == 0:
                    self._to_trio(self._report, lane.index, outcome.Error(exc))
                else:
                    self.rebuild_failed(lane, inc, exc)
                return
            if inc.number == 0:
                self._to_trio(self._report, lane.index, outcome.Value(facts))
                del facts
                self.go.wait()  # set by the engine once it decided; not a poll
                if self.work is None:
                    return
            else:
                assert self.facts0 is not None
                diffs = contract_differences(self.facts0, facts)
                del facts
                if diffs:
                    mismatch = ContractMismatchError(
                        f"the rebuilt env disagrees with lane 0 on the env contract: "
                        f"{'; '.join(diffs)}"
                    )
                    self.rebuild_failed(lane, inc, mismatch)
                    return
                if not self._rebuilt(lane, inc):
                    return
            assert self.work is not None
            Serving(  # (held by no name here: nothing keeps the env once it served)
                self,
                lane,
                inc,
                inc.executor(self.work),
                self.recorders[lane.index] if self.recorders else None,
                rebuilds=self._rebuilds,
                truncate=self._truncate,
            ).serve()
        except Exception:
            # Only an engine bug gets here (job and callback errors are caught per job):
            # the lane stops (its jobs are answered below), given up for good while the
            # engine runs; the other lanes go on.
            logger.exception("lane %d died", lane.index)
            died = True
        finally:
            with lane.lock:
                dead = lane.state is LaneState.DEAD
                mine, lost = lane.thread_ended(inc, died=died)
            if lost:
                self._gave_up(lane)
            if mine and not dead:
                lane.fail_pending()
            if self.recorders and (recorder := self.recorders[lane.index]) is not None:
                recorder.cut(inc.number, "server_stop" if lane.stopping else "lane_fault")
            inc.close(self._close_timeout)
            self._to_trio(self._exited, lane, inc)

    def _rebuilt(self, lane: Lane, inc: Incarnation) -> bool:
        """A fresh env agrees with the contract; serve (unless superseded)."""
        with lane.lock:
            if inc.detached or lane.stopping:
                return False
            attempt = lane.serve()
            took = (perf_counter_ns() - lane.since) / 1e9
        logger.info("lane %d rebuilt (attempt %d, %.3f s)", lane.index, attempt, took)
        return True

    def rebuild_failed(self, lane: Lane, inc: Incarnation, exc: BaseException) -> None:
        """Any thread: the factory raised, overran or built a disagreeing env. Refuse jobs
        (fatal) until the supervisor's next attempt; answer the ones waiting for this one."""
        with lane.lock:
            if inc.detached or lane.stopping:
                return
            cause = f"{type(exc).__name__}: {exception_text(exc)}"
            delay = self._rebuild_delay(lane.attempt)
            refusal = LaneRebuildFailedError(
                f"lane {lane.index} could not be rebuilt (attempt {lane.attempt}): {cause}; "
                f"the next attempt is in {delay:.3g} s"
            )
            waiting = lane.dead(refusal, cause)
        logger.error(
            "lane %d: rebuild attempt %d failed (%s); next attempt in %.3g s",
            lane.index,
            lane.attempt,
            cause,
            delay,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        for item in waiting:
            answer(lane.index, item, outcome.Error(refusal), Phases())

    def lost(self, lane: Lane, cause: str) -> None:
        """Policy ``error``: the incarnation is lost (a process lane's child died): refuse
        the lane's jobs from now on."""
        reason = cause.split(": ", 1)[-1]
        refusal = LaneDeadError(
            f"lane {lane.index} is gone: {reason} (--on-lane-fault rebuild would rebuild it)"
        )
        with lane.lock:
            waiting = lane.dead(refusal, reason, for_good=True)
        logger.error("lane %d: %s; the lane is lost (policy error)", lane.index, reason)
        self._gave_up(lane)
        for item in waiting:
            answer(lane.index, item, outcome.Error(refusal), Phases())

    def faulted(
        self,
        lane: Lane,
        item: Item,
        result: outcome.Error,
        phases: Phases,
        *,
        retry: bool,
    ) -> None:
        """Supervised: the env raised; answer, and hand over to a fresh env."""
        error = result.error
        verb = verb_of(item[1])
        cause = f"{type(error).__name__}: {error}"
        with lane.lock:
            lane.went_down(cause)
        logger.warning(
            "lane %d: env.%s raised (%s); rebuilding the lane on a fresh thread%s",
            lane.index,
            verb,
            cause,
            " and retrying the reset there" if retry else "",
        )
        if not retry:
            answer(lane.index, item, result, phases, LaneFault(lane=lane.index, error=cause))
        threading.current_thread().name = f"{LANE_THREAD_PREFIX}{lane.index}-retired"
        self._to_trio(self._wake, lane.index)


Ran = tuple[outcome.Outcome[Any], Phases, bool]
"""What :meth:`Serving.run` hands to :meth:`Serving.settle`: the executor's own answer,
``(outcome, phases, env_raised)``, passed on as it is (no new tuple per job)."""


class Serving:
    """One incarnation serving its lane's mailbox, on the incarnation's own thread: the
    hot path. :meth:`serve` takes each item (:meth:`next_item`), runs it (:meth:`run`)
    and settles it (:meth:`settle`) until the incarnation's serving is over: the lane
    stops, or the incarnation is detached, faulted or lost.

    Made once per incarnation. What one item carries from taking to settling (when it
    was picked, whether it was handed over ahead, its retry count) is kept in slots, not
    in a new object per item.
    """

    __slots__ = (
        "_execute",
        "_finish",
        "_get",
        "_inc",
        "_lane",
        "_picked",
        "_rebuilds",
        "_recorder",
        "_retried",
        "_send_ahead",
        "_sent",
        "_threads",
        "_truncate",
        "progress",
    )

    def __init__(
        self,
        threads: LaneThreads,
        lane: Lane,
        inc: Incarnation,
        execute: Execute,
        recorder: LaneRecorder | None,
        *,
        rebuilds: bool,
        truncate: bool,
    ) -> None:
        self._threads = threads
        self._lane = lane
        self._inc = inc
        self._execute = execute
        self._recorder = recorder
        self._rebuilds = rebuilds
        self._truncate = truncate
        self._get = lane.mailbox.get
        ahead = inc.ahead()  # a process lane: post may write the next job to the child
        self._send_ahead: SendAhead | None = None
        self._finish = execute
        if ahead is not None:
            self._send_ahead, self._finish = ahead
        self.progress = FRESH if inc.number > 0 else PROVEN
        self._picked = 0
        """``perf_counter_ns()`` when the item being run was taken."""
        self._sent = False
        """The item being run was handed over ahead: only its answer is left to read."""
        self._retried = 0
        """How often the item being run was tried before (a reset retried after a fault)."""

    def serve(self) -> None:
        """Serve until the incarnation's serving is over."""
        next_item, run, settle = self.next_item, self.run, self.settle
        while True:
            item = next_item()
            if item is None or not settle(item, run(item)):
                return
            del item  # nothing of a job is held while the mailbox is awaited

    def next_item(self) -> Item | None:
        """The next item this incarnation runs, begun (the lane's ``current``): the retry
        slot's, or the mailbox's. None when the lane stops instead (an item taken is
        answered). A step for a :attr:`Progress.FRESH` env is refused here, not run."""
        lane = self._lane
        lock = lane.lock
        send_ahead = self._send_ahead
        while True:
            retried = 0
            sent = False
            item: Item | Stop
            if lane.retry is not None:  # only ever set before this incarnation started
                with lock:
                    pending = lane.take_retry()
                if pending is None:
                    continue
                item, retried = pending
            else:
                if send_ahead is not None and self.progress is not FRESH:
                    with lock:
                        lane.await_job(send_ahead)
                item = self._get()
            picked = perf_counter_ns()
            with lock:
                if send_ahead is not None:
                    sent = lane.take_ahead(item)
                stop = not lane.begin_job(item, picked)
            if stop:
                if sent:  # the child has it already: its answer is read, and given
                    assert not isinstance(item, Stop)
                    result, phases, _faulted = self._finish(item[1], picked - item[0])
                    answer(lane.index, item, result, phases)
                elif not isinstance(item, Stop):
                    answer(lane.index, item, outcome.Error(stopped_error(lane.index)), Phases())
                return None
            assert not isinstance(item, Stop)
            if self.progress is FRESH and isinstance(item[1], StepJob):
                assert not sent  # (a fresh env takes no job ahead: await_job is not called)
                self._refuse_unreset(item)
                continue
            self._picked = picked
            self._sent = sent
            self._retried = retried
            return item

    def run(self, item: Item) -> Ran:
        """Run the begun ``item`` (read its answer, when it was handed over ahead) and
        hand it to the lane's recorder."""
        posted, job, _reply = item
        ran = (self._finish if self._sent else self._execute)(job, self._picked - posted)
        recorder = self._recorder
        if recorder is not None and not self._inc.detached:  # issue 33 (an abandoned
            # call's late result is not recorded); references kept; put may wait
            # (backpressure)
            result, phases, faulted = ran
            if faulted:
                recorder.cut(self._inc.number, "lane_fault")
            else:
                recorder.saw(self._inc.number, job, result, phases, self._execute)
        return ran

    def settle(self, item: Item, ran: Ran) -> bool:
        """The ``item`` that ran ends: the lane hears of it (the job ended, or the env
        faulted), the incarnation's :attr:`progress` moves, the job is answered. Whether
        the incarnation serves on."""
        result, phases, faulted = ran
        lane = self._lane
        inc = self._inc
        job = item[1]
        detach = False
        with lane.lock:
            taken = not lane.end_job(item)
            if faulted and not taken:
                retry = self._truncate and isinstance(job, ResetJob) and not self._retried
                detach = lane.fault(item, rebuild=self._rebuilds, retry=retry)
        if taken:
            # The job was answered for us: the lane stopped or abandoned us, or (policy
            # ``error``) declared the call wedged and now gets it back.
            if inc.detached or lane.stopping:
                return False
            self._unwedged(job)
            return True
        if detach:
            assert isinstance(result, outcome.Error)
            self._threads.faulted(lane, item, result, phases, retry=lane.retry is not None)
            return False  # the ``finally`` of LaneThreads._main closes the faulted env
        if isinstance(result, outcome.Error) and inc.lost_by(result.error):
            # Policy ``error``: nothing rebuilds the lane; it refuses from now on.
            answer(lane.index, item, result, phases)
            self._threads.lost(lane, str(result.error))
            return False
        if self.progress is not PROVEN and isinstance(result, outcome.Value):
            self._progressed(job)
        answer(lane.index, item, result, phases)
        return True

    def _progressed(self, job: Job) -> None:
        """A rebuilt env answered ``job``: a reset makes it :attr:`Progress.RESET`, then a
        step proves it healthy (:attr:`Progress.PROVEN`)."""
        if self.progress is FRESH:
            if isinstance(job, ResetJob):
                self.progress = RESET
        elif isinstance(job, StepJob):
            self.progress = PROVEN
            self._lane.proven_healthy()

    def _refuse_unreset(self, item: Item) -> None:
        """A step on a rebuilt env nobody reset yet is refused, not run."""
        lane = self._lane
        with lane.lock:
            lane.end_job(item)  # never wedged here: only a rebuild policy makes fresh envs
        cause = lane.last_cause or "a fault"
        error = LaneNeedsResetError(
            f"step failed: lane {lane.index} was rebuilt after a fault ({cause}); "
            "reset it before stepping"
        )
        fault = LaneFault(lane=lane.index, error=cause)
        answer(lane.index, item, outcome.Error(error), Phases(), fault)

    def _unwedged(self, job: Job) -> None:
        """Policy ``error``: a call declared wedged returned after all."""
        lane = self._lane
        with lane.lock:
            if lane.state is not LaneState.WEDGED:
                return
            lane.serve()
            took = (perf_counter_ns() - lane.since) / 1e9
        logger.warning(
            "lane %d: the wedged env.%s returned after %.3g s; the lane serves again "
            "(its late result was dropped)",
            lane.index,
            verb_of(job),
            took,
        )
