"""The lane engine: N gymnasium envs as the lanes of one endpoint, supervised.

A lane is one Trio task (its supervisor, :mod:`._supervisor`) plus, at any time, one OS
thread that owns the lane's env (DESIGN.md decision 3; :mod:`._thread`): the thread builds
the env (so the env is created and only ever used on that thread), then loops on the
lane's mailbox, a ``queue.SimpleQueue`` that the transport thread posts into directly.
Every job runs its wire work on the lane thread (decode the action, call the env, encode
the result) and hands a :class:`~rlmesh_trio._jobs.LaneReply` to the ``reply`` callable
it was posted with.

Lanes are independent: no lock is shared between lanes, a job for lane 2 never waits for
lane 0, and one lane's slow env costs the others nothing.

A lane's state changes only through the transitions of :class:`~._lane.Lane`, checked
against one table (:mod:`._state`, docs/supervision.md). Where the env lives -- on the
thread, or in a child process the thread proxies for -- is the incarnation's business
(:mod:`._incarnation`): the engine speaks one protocol to both.

Supervision (docs/supervision.md). With ``on_fault="error"`` a lane behaves like the
reference's: an env that raises stays as the exception left it. With ``"rebuild"`` or
``"truncate"`` a lane whose env raised inside reset/step/render, or whose env call was
declared wedged (:mod:`._watchdog`: it overran ``lane_timeout`` or a request's deadline),
gets a fresh env from the factory on a FRESH thread (an *incarnation*); the old thread
closes its env itself when it gets control back. The mailbox outlives incarnations, so
queued jobs are served by the fresh env. A rebuild whose factory raises or builds an env
that disagrees with lane 0's contract is retried with backoff; until then the lane
refuses jobs with a fatal :class:`~rlmesh_trio._errors.LaneDeadError`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import outcome
import trio

from .._bridge import ToTrio
from .._errors import LaneBrokenError, LaneClosedError, LaneError
from .._jobs import EnvContract, Job, Phases, ReplyFn
from .._options import DEFAULT_CLOSE_TIMEOUT, FaultPolicy, Policy, Resolved, ServeOptions, resolve
from ._contract import EnvFacts, agree
from ._incarnation import spawner
from ._lane import LANE_THREAD_PREFIX, STOP, Incarnation, Lane, answer, stopped_error
from ._state import LaneState
from ._supervisor import REBUILD_BACKOFF, AbandonedLedger, GivenUpLanes, Supervisor
from ._thread import LaneThreads
from ._watchdog import Wedges
from ._work import LaneWork

if TYPE_CHECKING:
    from .._record._served import ServedRecording

__all__ = [
    "LANE_TEARDOWN_TIMEOUT",
    "LANE_THREAD_PREFIX",
    "LaneEngine",
    "LaneStatus",
]

LANE_TEARDOWN_TIMEOUT: float = DEFAULT_CLOSE_TIMEOUT
"""Default shared teardown deadline, in seconds, for all lanes together (the servers'
``close_timeout_seconds`` default)."""

logger = logging.getLogger("rlmesh_trio.lanes")

_CANNOT_SERVE = frozenset({LaneState.DEAD, LaneState.WEDGED, LaneState.STOPPED})
"""States in which a lane refuses every job (health counts the others as serving)."""


@dataclass(frozen=True)
class LaneStatus:
    """One lane's supervision state and counters (for metrics and the probe)."""

    lane: int
    state: str
    """``starting``, ``serving``, ``rebuilding``, ``wedged``, ``dead`` or ``stopped``."""
    faults: int
    """Env calls that raised."""
    wedges: int
    """Env calls declared wedged (past ``lane_timeout`` or a request's deadline)."""
    rebuilds: int
    """Fresh envs built after a fault or a wedge."""
    abandoned: int
    """Threads of this lane abandoned in a wedged env call and still running."""


class LaneEngine:
    """Runs ``num_envs`` gymnasium envs, each on its own long-lived lane thread.

    ``options`` are the server's resolved options (:func:`~rlmesh_trio._options.resolve`,
    which validated them; the engine reads ``policy``, ``close_timeout`` -- its teardown
    deadline --, ``on_lane_fault``, ``lane_timeout``, ``max_abandoned_lanes``,
    ``max_given_up_lanes``, ``min_serving_lanes`` and ``lane_isolation``); None: the
    defaults. ``rebuild_backoff`` is the first delay and the cap, in seconds, between
    failed rebuild attempts.

    Lifecycle: construct, then ``await nursery.start(engine.run)``; post jobs with
    :meth:`post` from any thread; stop with :meth:`close` (any thread) or by cancelling
    ``run``. Jobs posted before ``run`` started wait in their mailbox until their lane has
    built its env and the contract is agreed.

    Threads: lane ``i`` serves on a thread named ``rlmesh-trio-lane-<i>`` that the engine
    starts itself (a plain daemon ``threading.Thread``, never one of Trio's cached
    workers: a rebuilt lane must get a thread no env ever ran on). Once :meth:`run` has
    returned, no lane thread is left except one that was abandoned (wedged at teardown or
    in an env call the supervisor gave up on): it is a daemon and never blocks exit.
    """

    def __init__(
        self,
        make_env: Callable[[], gym.Env[Any, Any]],
        num_envs: int = 1,
        options: Resolved | None = None,
        *,
        rebuild_backoff: tuple[float, float] = REBUILD_BACKOFF,
        recording: ServedRecording | None = None,
    ) -> None:
        if not callable(make_env):
            raise TypeError(f"make_env must be callable, got {type(make_env).__name__}")
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"num_envs must be an integer >= 1, got {num_envs!r}")
        if options is None:
            options = resolve(ServeOptions(validation_policy="warn"), environ={})
        self.num_envs: int = num_envs
        self._policy: Policy = options.policy
        self._on_fault: FaultPolicy = options.on_lane_fault
        rebuilds = options.on_lane_fault != "error"
        self._lane_timeout = options.lane_timeout
        self._teardown_timeout = options.close_timeout
        spawn = spawner(options.lane_isolation, make_env, options.policy)
        self._lanes = [Lane(i, spawn) for i in range(num_envs)]
        self._ledger = AbandonedLedger(options.max_abandoned_lanes)
        if options.min_serving_lanes > num_envs:
            raise ValueError(
                f"min_serving_lanes={options.min_serving_lanes} is more than the "
                f"{num_envs} lanes served"
            )
        self._min_serving = options.min_serving_lanes
        self._given_up = GivenUpLanes(self._lanes, options.max_given_up_lanes)
        self._supervisor = Supervisor(
            start=self._start_thread,
            ledger=self._ledger,
            given_up=self._given_up,
            rebuilds=rebuilds,
            retire_timeout=self._teardown_timeout,
            backoff=rebuild_backoff,
        )
        self._threads = LaneThreads(
            rebuilds=rebuilds,
            truncate=options.on_lane_fault == "truncate",
            close_timeout=self._teardown_timeout,
            to_trio=self._to_trio,
            report=self._lane_reported,
            exited=self._exited,
            wake=self._wake_lane,
            rebuild_delay=self._supervisor.rebuild_delay,
            gave_up=self._given_up.added,
        )
        self._wedges = Wedges(
            self._lanes,
            rebuilds=rebuilds,
            ledger=self._ledger,
            wake=lambda index: self._to_trio(self._wake_lane, index),
            rebuild_failed=self._threads.rebuild_failed,
        )
        self._contract: EnvContract | None = None
        self._recording = recording
        # Startup handshake between the lane threads and run():
        self._facts: list[outcome.Outcome[EnvFacts] | None] = [None] * num_envs
        self._startup_done = trio.Event()
        self._close_event = trio.Event()
        self._close_requested = False
        self._to_trio_bridge: ToTrio | None = None
        self._run_called = False
        self._deadline_cap = math.inf
        self._wakeups: list[trio.MemorySendChannel[None]] = []

    # ---- construction helpers ---------------------------------------------------------

    @staticmethod
    def factory(
        env: str | Callable[..., gym.Env[Any, Any]], **kwargs: Any
    ) -> Callable[[], gym.Env[Any, Any]]:
        """A zero-argument env factory.

        ``env`` is a gymnasium id (``"CartPole-v1"`` → ``gym.make("CartPole-v1", **kwargs)``)
        or a callable called as ``env(**kwargs)`` (an env class, a function). Nothing is
        built here: the lane threads call the factory, each on its own thread.
        """
        if isinstance(env, str):
            return functools.partial(gym.make, env, **kwargs)
        if callable(env):
            return functools.partial(env, **kwargs)
        raise TypeError(
            f"env must be a gymnasium id or a callable returning an env, got {type(env).__name__}"
        )

    @property
    def contract(self) -> EnvContract:
        """What every lane serves (lane 0's, checked equal on all lanes).

        Available once :meth:`run` has called ``task_status.started``; raises
        ``RuntimeError`` before.
        """
        if self._contract is None:
            raise RuntimeError("the lane engine has not started: no env contract yet")
        return self._contract

    @property
    def recording(self) -> ServedRecording | None:
        """The recorders the lanes feed (issue 33), or None."""
        return self._recording

    @property
    def policy(self) -> Policy:
        """The conformance policy the lanes apply (SPEC §3.7.8)."""
        return self._policy

    @property
    def on_fault(self) -> FaultPolicy:
        """What a lane does when its env raises or wedges."""
        return self._on_fault

    @property
    def abandoned(self) -> int:
        """Lane threads abandoned in a wedged env call and still running (all lanes)."""
        return self._ledger.count

    @property
    def serving(self) -> int:
        """Lanes that can serve a job now or soon: not dead, wedged or stopped (a lane
        being rebuilt or still starting queues its jobs). Any thread."""
        return sum(lane.state not in _CANNOT_SERVE for lane in self._lanes)

    @property
    def given_up(self) -> int:
        """Lanes given up for good: dead, never rebuilt again in this process. Any thread."""
        return self._given_up.count

    @property
    def healthy(self) -> bool:
        """False once more lanes are given up for good than ``max_given_up_lanes``
        tolerates (default 0: any), more lane threads are abandoned than
        ``max_abandoned_lanes`` tolerates, or fewer lanes can serve than
        ``min_serving_lanes``: the process should be restarted (health reports
        NOT_SERVING). A lane down only for a while (rebuilding, dead until its next
        rebuild attempt, wedged) counts against ``min_serving_lanes`` alone."""
        return self._given_up.healthy and self._ledger.healthy and self.serving >= self._min_serving

    def status(self) -> list[LaneStatus]:
        """Every lane's state and counters, in lane order. Any thread."""
        return [
            LaneStatus(
                lane=lane.index,
                state=lane.state.value,
                faults=lane.faults,
                wedges=lane.wedges,
                rebuilds=lane.rebuilds,
                abandoned=lane.abandoned,
            )
            for lane in self._lanes
        ]

    # ---- the Trio side ----------------------------------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[LaneEngine] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the lanes until :meth:`close` or cancellation, then tear them down.

        ``task_status.started(self)`` is called once every lane has built its env and all
        lanes agree on the env contract (:attr:`contract` is then set). If a ``make_env()``
        call raises, or a lane's contract differs from lane 0's
        (:class:`~rlmesh_trio._errors.ContractMismatchError`), or the env's spaces or
        metadata cannot be served (a codec error), that exception is raised out of ``run``
        — so at the caller's ``await nursery.start(engine.run)`` — after the lanes already
        built have been torn down. If :meth:`close` is called before startup completed,
        ``run`` tears down and returns without calling ``started``.

        Teardown (after :meth:`close`, on cancellation, or after a startup failure): every
        mailbox is closed at once; each lane finishes the job it is running, answers its
        still-queued jobs with ``LaneBrokenError("lane <i> stopped before answering")``,
        calls ``env.close()`` on its own thread and exits. All lanes wind down concurrently
        under ONE shared deadline of ``teardown_timeout`` seconds; a lane still stuck then
        (in a job, or in an ``env.close()`` that never returns) is abandoned: its pending
        jobs are answered as stopped, it is named in a warning on the ``rlmesh_trio.lanes``
        logger, and its daemon thread is left to finish on its own (it closes its env if it
        ever gets there, and never blocks process exit). So ``run`` returns at most
        ``teardown_timeout`` seconds (plus scheduling) after teardown began, also when it
        was cancelled.

        ``env.close()`` order: the lanes close their envs concurrently, each as soon as its
        current job is done, NOT one after the other in lane order — a sequential order
        under one shared deadline would let one wedged lane keep every later lane from
        closing its env at all, and would make the teardown time the sum of the close times.

        Why the lane tasks are shielded: an outer cancellation must not abandon healthy
        lanes before they closed their envs, so each lane task runs in a shielded cancel
        scope; teardown (which every exit path of ``run`` goes through, in a ``finally``)
        gives all of those scopes the shared deadline, so no shield outlives the bound.
        """
        if self._run_called:
            raise RuntimeError("LaneEngine.run() can only be called once")
        self._run_called = True
        self._to_trio_bridge = ToTrio()
        if self._close_requested:  # close() came before run(): it could not wake us
            self._wake_run()
        failure: BaseException | None = None
        async with trio.open_nursery() as nursery:
            for lane in self._lanes:
                lane.supervised()
                send, receive = trio.open_memory_channel[None](math.inf)
                self._wakeups.append(send)
                nursery.start_soon(
                    self._supervisor.run, lane, receive, name=f"{LANE_THREAD_PREFIX}{lane.index}"
                )
            try:
                await self._startup_done.wait()
                failure = self._decide_startup()
                if failure is None and not self._close_requested:
                    if self._lane_timeout is not None:
                        nursery.start_soon(self._wedges.watchdog, self._lane_timeout)
                    task_status.started(self)
                    await self._close_event.wait()
            finally:
                self._begin_teardown()
                nursery.cancel_scope.cancel()  # the watchdog; the lane tasks are shielded
        if failure is not None:
            raise failure

    def _decide_startup(self) -> BaseException | None:
        """After all lanes reported (or one failed, or close): agree on the contract.

        Returns the exception ``run`` must raise, or None. Sets ``_go`` only on success;
        the failure paths leave it to ``_begin_teardown``.
        """
        for result in self._facts:
            if isinstance(result, outcome.Error):
                return result.error  # also after a close(): a failure is never dropped
        if self._close_requested:
            return None
        facts: list[EnvFacts] = []
        for result in self._facts:
            assert isinstance(result, outcome.Value)
            facts.append(result.value)
        try:
            self._contract = agree(facts)
        except Exception as exc:  # a lane disagrees, or a space the codec cannot serve
            return exc
        contract = self._contract
        if self._recording is not None:
            try:  # the dataset's and the video's startup errors (an id taken, no rgb_array)
                self._threads.recorders = self._recording.start(contract, self.num_envs)
            except Exception as exc:
                return exc  # before ``work``: the lanes' threads never serve
        self._threads.work = LaneWork(
            contract.action_codec, contract.observation_codec, self._policy
        )
        self._threads.facts0 = facts[0]
        self._facts = []  # lanes 1.. keep no space objects alive through the engine
        for lane in self._lanes:
            # Every lane thread is alive (waiting for ``_go``): up from now on, so that
            # ``alive()`` is true as soon as ``started`` is.
            with lane.lock:
                lane.serve()
        self._threads.go.set()
        return None

    def _begin_teardown(self) -> None:
        """Close every mailbox and give every lane scope the one shared deadline."""
        self.close()
        self._threads.go.set()  # lanes waiting for the startup decision: wind down
        deadline = min(trio.current_time() + self._teardown_timeout, self._deadline_cap)
        for lane in self._lanes:
            lane.limit(deadline)
        for wakeup in self._wakeups:
            wakeup.send_nowait(None)

    def limit_teardown(self, deadline: float) -> None:
        """Trio thread: the teardown ends by ``deadline`` (Trio time) at the latest.

        For an owner with a stop bound of its own: the lanes' shared deadline is then the
        earlier of ``teardown_timeout`` after the teardown began and ``deadline``, also
        when the teardown is already under way.
        """
        self._deadline_cap = min(self._deadline_cap, deadline)
        for lane in self._lanes:
            if lane.scope is not None and lane.scope.deadline != math.inf:  # under way
                lane.limit(self._deadline_cap)

    def _start_thread(self, lane: Lane, inc: Incarnation) -> None:
        self._threads.start(lane, inc)

    def _lane_reported(self, index: int, result: outcome.Outcome[EnvFacts]) -> None:
        """Trio thread: lane ``index`` built its env (or failed to)."""
        if not self._facts or self._facts[index] is not None:
            return
        self._facts[index] = result
        if isinstance(result, outcome.Error) or all(f is not None for f in self._facts):
            self._startup_done.set()

    def _wake_run(self) -> None:
        """Trio thread: close() was called."""
        self._close_event.set()
        self._startup_done.set()

    def _wake_lane(self, index: int) -> None:
        """Trio thread: something lane ``index``'s supervisor waits for happened."""
        if index < len(self._wakeups):
            self._wakeups[index].send_nowait(None)

    def _exited(self, lane: Lane, inc: Incarnation) -> None:
        """Trio thread: an incarnation's thread ran its last act."""
        inc.exited.set()
        self._wake_lane(lane.index)

    def _to_trio(self, fn: Callable[..., None], *args: Any) -> None:
        """Any thread: run ``fn`` on the Trio thread (dropped once the run is over)."""
        bridge = self._to_trio_bridge
        if bridge is not None:
            bridge(fn, *args)

    # ---- any thread -------------------------------------------------------------------

    def wedged(self, lane: int, job: Job, seconds: float) -> None:
        """A request's deadline of ``seconds`` expired while ``job`` was queued on or run
        by ``lane``. Any thread; never blocks.

        The lane is wedged if ``job`` is the one running, or if the job running has run
        for longer than that deadline; otherwise ``job`` is merely queued behind a busy
        lane and nothing happens. What a wedge does: :meth:`._watchdog.Wedges.wedge`.
        """
        self._wedges.request_deadline(self._lane(lane), job, seconds)

    def post(self, lane: int, job: Job, reply: ReplyFn) -> None:
        """Queue ``job`` on lane ``lane``. Thread-safe, never blocks, arrival order per lane.

        ``reply(LaneReply(job.id, lane, ...))`` is called exactly once: by the lane
        thread with the result, or
        with ``LaneBrokenError("lane <i> stopped before answering")`` if the lane winds down
        or is abandoned first. Raises ``LaneError("lane <i> out of range for <n> lanes")``
        for a bad index; ``LaneClosedError("lane <i> is no longer running")`` once the
        engine was closed, ``LaneBrokenError`` (same text) when the lane's thread is gone
        otherwise; :class:`LaneWedgedError` or :class:`LaneDeadError` while the lane is
        wedged (policy ``error``) or could not be rebuilt (then ``reply`` is never called).
        """
        record = self._lane(lane)
        item = (perf_counter_ns(), job, reply)
        with record.lock:
            if not record.accepting:
                # "closed" (the engine was closed: orderly) and "broken" (the lane's
                # thread died or was abandoned) are kept apart, as Trio does.
                cls = LaneClosedError if self._close_requested else LaneBrokenError
                raise cls(f"lane {lane} is no longer running")
            refusal = record.refusal
            if refusal is not None:
                # A fresh instance each time: re-raising one object would grow its traceback.
                raise type(refusal)(str(refusal))
            if record.presend is not None:  # a process lane waiting for its next job
                record.post_ahead(job)
            record.mailbox.put(item)

    def close(self) -> None:
        """Close every mailbox at once; :meth:`run` then tears down. Idempotent, any thread.

        Does not wait. Jobs posted afterwards are refused; jobs still queued are answered
        as stopped; each lane finishes the job it is running.
        """
        self._close_requested = True
        for lane in self._lanes:
            with lane.lock:
                already = lane.close_mailbox()
                queued = lane.take_queued() if lane.state is LaneState.DEAD else []
            for item in queued:
                answer(lane.index, item, outcome.Error(stopped_error(lane.index)), Phases())
            if not already:
                lane.mailbox.put(STOP)
            self._to_trio(self._wake_lane, lane.index)
        self._to_trio(self._wake_run)

    def alive(self, lane: int) -> bool:
        """Whether lane ``lane``'s thread is serving its mailbox and takes jobs.

        False before the lane is up, once it is closing and after its thread is gone.
        Raises ``LaneError`` for a bad index.
        """
        record = self._lane(lane)
        return record.running and record.accepting and record.refusal is None

    def _lane(self, lane: int) -> Lane:
        if not 0 <= lane < self.num_envs:
            raise LaneError(f"lane {lane} out of range for {self.num_envs} lanes")
        return self._lanes[lane]
