"""The lane engine: N gymnasium envs as the lanes of one endpoint, supervised.

A lane is one Trio task (its supervisor) plus, at any time, one OS thread that owns the
lane's env (DESIGN.md decision 3): the thread builds the env (so the env is created and
only ever used on that thread), then loops on the lane's mailbox, a ``queue.SimpleQueue``
that the transport thread posts into directly. Every job runs its wire work on the lane
thread (decode the action, call the env, encode the result) and hands a
:class:`~rlmesh_trio._jobs.LaneReply` to the ``reply`` callable it was posted with.

Lanes are independent: no lock is shared between lanes, a job for lane 2 never waits for
lane 0, and one lane's slow env costs the others nothing.

Supervision (docs/supervision.md). With ``on_fault="error"`` a lane behaves like the
reference's: an env that raises stays as the exception left it. With ``"rebuild"`` or
``"truncate"`` a lane whose env raised inside reset/step/render, or whose env call was
declared wedged (it overran ``lane_timeout`` or a request's deadline), gets a fresh env
from the factory on a FRESH thread (an *incarnation*); the old thread closes its env
itself when it gets control back. The mailbox outlives incarnations, so queued jobs are
served by the fresh env. A rebuild whose factory raises or builds an env that disagrees
with lane 0's contract is retried with backoff; until then the lane refuses jobs with a
fatal :class:`~rlmesh_trio._errors.LaneDeadError`.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, Final

import gymnasium as gym
import outcome
import trio

from .._bridge import ToTrio
from .._codec import SpaceCodec
from .._errors import (
    ContractMismatchError,
    LaneBrokenError,
    LaneClosedError,
    LaneDeadError,
    LaneError,
    LaneNeedsResetError,
    LaneTimeoutError,
    LaneWedgedError,
)
from .._jobs import EnvContract, Job, LaneFault, LaneReply, Phases, ReplyFn, ResetJob, StepJob
from .._options import (
    DEFAULT_CLOSE_TIMEOUT,
    DEFAULT_MAX_ABANDONED_LANES,
    FaultPolicy,
    LaneIsolation,
    Policy,
)
from ._contract import EnvFacts as _LaneFacts
from ._contract import contract_differences as _contract_differences
from ._contract import lane_facts as _lane_facts
from ._lane import _STOP, LaneState, _Incarnation, _Item, _Lane, _Stop, _stopped
from ._process import CHILD_STOP_TIMEOUT, ChildLane, LaneProcessDiedError, check_picklable
from ._work import LaneWork, verb_of

__all__ = [
    "LANE_TEARDOWN_TIMEOUT",
    "LANE_THREAD_PREFIX",
    "LaneEngine",
    "LaneStatus",
]

LANE_TEARDOWN_TIMEOUT: float = DEFAULT_CLOSE_TIMEOUT
"""Default shared teardown deadline, in seconds, for all lanes together (the servers'
``close_timeout_seconds`` default)."""

LANE_THREAD_PREFIX: Final = "rlmesh-trio-lane-"
"""Lane ``i``'s serving thread is named ``f"{LANE_THREAD_PREFIX}{i}"``. A thread the lane
left behind is renamed ``...-<i>-retired`` (closing a faulted env) or ``...-<i>-abandoned``
(stuck in a wedged env call)."""

BUILD_TIMEOUT_FLOOR: Final = 30.0
"""Seconds a rebuild's factory call may take, at least, before the watchdog gives up on it."""

REBUILD_BACKOFF: Final = (0.5, 30.0)
"""First delay and cap, in seconds, between failed rebuild attempts (doubling)."""

logger = logging.getLogger("rlmesh_trio.lanes")

_POLICIES: Final = ("warn", "strict", "off")
_FAULT_POLICIES: Final = ("error", "rebuild", "truncate")


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


# --------------------------------------------------------------------------------------
# The engine


class LaneEngine:
    """Runs ``num_envs`` gymnasium envs, each on its own long-lived lane thread.

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
        *,
        policy: Policy = "warn",
        teardown_timeout: float = LANE_TEARDOWN_TIMEOUT,
        on_fault: FaultPolicy = "error",
        lane_timeout: float | None = None,
        max_abandoned: int = DEFAULT_MAX_ABANDONED_LANES,
        rebuild_backoff: tuple[float, float] = REBUILD_BACKOFF,
        isolation: LaneIsolation = "thread",
    ) -> None:
        if not callable(make_env):
            raise TypeError(f"make_env must be callable, got {type(make_env).__name__}")
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"num_envs must be an integer >= 1, got {num_envs!r}")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        if on_fault not in _FAULT_POLICIES:
            raise ValueError(f"on_fault must be one of {_FAULT_POLICIES}, got {on_fault!r}")
        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")
        if isolation == "process":
            if sys.platform == "win32":
                raise ValueError("lane_isolation='process' needs a POSIX system")
            check_picklable(make_env)
        if not teardown_timeout >= 0:
            raise ValueError(f"teardown_timeout must be >= 0, got {teardown_timeout!r}")
        if lane_timeout is not None and not 0 < lane_timeout < math.inf:
            raise ValueError(f"lane_timeout must be > 0 or None, got {lane_timeout!r}")
        self.num_envs: int = num_envs
        self._make_env = make_env
        self._policy: Policy = policy
        self._on_fault: FaultPolicy = on_fault
        self._supervised = on_fault != "error"
        self._truncate = on_fault == "truncate"
        self._lane_timeout = lane_timeout
        self._max_abandoned = max_abandoned
        self._backoff = rebuild_backoff
        self._isolation: LaneIsolation = isolation
        self._teardown_timeout = float(teardown_timeout)
        self._lanes = [_Lane(i) for i in range(num_envs)]
        self._contract: EnvContract | None = None
        self._work: LaneWork | None = None
        self._facts0: _LaneFacts | None = None
        # Startup handshake between the lane threads and run():
        self._go = threading.Event()  # run() decided: serve (contract set) or wind down
        self._facts: list[outcome.Outcome[_LaneFacts] | None] = [None] * num_envs
        self._startup_done = trio.Event()
        self._close_event = trio.Event()
        self._close_requested = False
        self._to_trio_bridge: ToTrio | None = None
        self._run_called = False
        self._deadline_cap = math.inf
        self._wakeups: list[trio.MemorySendChannel[None]] = []
        self._abandoned_lock = threading.Lock()
        self._abandoned = 0

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
        return self._abandoned

    @property
    def healthy(self) -> bool:
        """False once more lane threads are abandoned than ``max_abandoned`` tolerates:
        the process should be restarted (health reports NOT_SERVING)."""
        return self._abandoned <= self._max_abandoned

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
                lane.scope = trio.CancelScope(shield=True)
                send, receive = trio.open_memory_channel[None](math.inf)
                self._wakeups.append(send)
                nursery.start_soon(
                    self._lane_task, lane, receive, name=f"{LANE_THREAD_PREFIX}{lane.index}"
                )
            try:
                await self._startup_done.wait()
                failure = self._decide_startup()
                if failure is None and not self._close_requested:
                    if self._lane_timeout is not None:
                        nursery.start_soon(self._watchdog, self._lane_timeout)
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
        facts: list[_LaneFacts] = []
        for result in self._facts:
            assert isinstance(result, outcome.Value)
            facts.append(result.value)
        lane0 = facts[0]
        for index, other in enumerate(facts[1:], start=1):
            diffs = _contract_differences(lane0, other)
            if diffs:
                return ContractMismatchError(
                    f"lane {index} disagrees with lane 0 on the env contract: {'; '.join(diffs)}"
                )
        try:
            action_codec = SpaceCodec(lane0.action_space)
            observation_codec = SpaceCodec(lane0.observation_space)
        except Exception as exc:
            return exc
        self._work = LaneWork(action_codec, observation_codec, self._policy)
        self._facts0 = lane0
        self._contract = EnvContract(
            env_id=lane0.env_id,
            action_space=lane0.action_space,
            observation_space=lane0.observation_space,
            action_codec=action_codec,
            observation_codec=observation_codec,
            metadata=lane0.metadata,
            render_mode=lane0.render_mode,
        )
        self._facts = []  # lanes 1.. keep no space objects alive through the engine
        for lane in self._lanes:
            # Every lane thread is alive (waiting for ``_go``): up from now on, so that
            # ``alive()`` is true as soon as ``started`` is.
            with lane.lock:
                lane.running = True
                if lane.state is LaneState.STARTING:
                    lane.state = LaneState.SERVING
        self._go.set()
        return None

    def _begin_teardown(self) -> None:
        """Close every mailbox and give every lane scope the one shared deadline."""
        self.close()
        self._go.set()  # lanes waiting for the startup decision: wind down
        deadline = min(trio.current_time() + self._teardown_timeout, self._deadline_cap)
        for lane in self._lanes:
            assert lane.scope is not None
            lane.scope.deadline = min(lane.scope.deadline, deadline)
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
            if lane.scope is not None and lane.scope.deadline != math.inf:
                lane.scope.deadline = min(lane.scope.deadline, self._deadline_cap)

    async def _lane_task(self, lane: _Lane, wakeups: trio.MemoryReceiveChannel[None]) -> None:
        """The lane's supervisor: start incarnations, back off failed rebuilds, retire
        and abandon old threads; return when the lane stopped (within the teardown
        deadline: the scope is shielded, and teardown gives it the shared deadline)."""
        assert lane.scope is not None
        threads: list[_Incarnation] = []  # started and not exited yet
        retire_by: dict[int, float] = {}  # id(detached incarnation) -> abandon it then
        retry_at = math.inf
        with lane.scope:
            while True:
                now = trio.current_time()
                for inc in list(threads):
                    if inc.exited.is_set():
                        threads.remove(inc)
                        retire_by.pop(id(inc), None)
                        self._retired(lane, inc)
                    elif inc.detached and not inc.abandoned:
                        by = retire_by.setdefault(id(inc), now + self._teardown_timeout)
                        if now >= by:
                            self._abandon_retired(lane, inc)
                            retire_by.pop(id(inc), None)
                current = lane.incarnation
                if lane.stopping:
                    if current.thread is None or current.exited.is_set():
                        break
                elif lane.state is LaneState.DEAD and not self._supervised:
                    pass  # a lost process lane (policy error): refuses until the stop
                elif lane.state is LaneState.DEAD:
                    if retry_at == math.inf:
                        retry_at = now + self._rebuild_delay(lane.attempt)
                    elif now >= retry_at:
                        retry_at = math.inf
                        self._next_attempt(lane)
                        continue
                elif current.thread is None:
                    self._start_thread(lane, current)
                    threads.append(current)
                elif current.exited.is_set():
                    break  # startup ended (failure or close before the decision)
                with trio.move_on_at(min(retry_at, *retire_by.values(), math.inf)):
                    await wakeups.receive()
            # The lane stopped: wait (within the teardown deadline) for threads still
            # closing a faulted env; abandoned ones are not waited for.
            for inc in threads:
                if not inc.abandoned:
                    await inc.exited.wait()
        for inc in threads:  # no child outlives the teardown
            if inc.child is not None and not inc.exited.is_set():
                inc.child.kill()
        if lane.scope.cancelled_caught:
            current = lane.incarnation
            if current.thread is not None and not current.exited.is_set():
                logger.warning(
                    "lane %d did not stop within the %.3g s teardown deadline; "
                    "abandoning its thread %r",
                    lane.index,
                    self._teardown_timeout,
                    current.thread.name,
                )
        # Jobs still queued (e.g. posted while a rebuild was pending when the stop came,
        # so no thread took them) are answered as stopped; idempotent otherwise.
        self._fail_pending(lane)
        with lane.lock:
            lane.state = LaneState.STOPPED

    def _start_thread(self, lane: _Lane, inc: _Incarnation) -> None:
        thread = threading.Thread(
            target=self._lane_main,
            args=(lane, inc),
            name=f"{LANE_THREAD_PREFIX}{lane.index}",
            daemon=True,
        )
        inc.thread = thread
        thread.start()

    def _rebuild_delay(self, attempt: int) -> float:
        first, cap = self._backoff
        return float(min(first * 2 ** max(attempt - 1, 0), cap))

    def _next_attempt(self, lane: _Lane) -> None:
        """Trio thread: a DEAD lane's backoff is over: try the factory again."""
        with lane.lock:
            if lane.stopping or lane.state is not LaneState.DEAD:
                return
            lane.state = LaneState.REBUILDING
            lane.refusal = None
            lane.attempt += 1
            lane.since = perf_counter_ns()
            lane.incarnation = _Incarnation(lane.incarnation.number + 1)

    def _retired(self, lane: _Lane, old: _Incarnation) -> None:
        if old.abandoned:
            with self._abandoned_lock:
                self._abandoned -= 1
            with lane.lock:
                lane.abandoned -= 1
            logger.info(
                "lane %d: abandoned thread %r finished on its own and exited",
                lane.index,
                old.thread.name if old.thread is not None else "?",
            )

    def _abandon_retired(self, lane: _Lane, old: _Incarnation) -> None:
        """A detached thread did not finish closing its env in time: count it abandoned."""
        old.abandoned = True
        self._count_abandoned(lane, old, "-abandoned")
        logger.warning(
            "lane %d: the faulted env's close() has not returned after %.3g s; "
            "abandoning thread %r (%d abandoned lane threads in this process)",
            lane.index,
            self._teardown_timeout,
            old.thread.name if old.thread is not None else "?",
            self._abandoned,
        )

    def _count_abandoned(self, lane: _Lane, old: _Incarnation, suffix: str) -> None:
        with self._abandoned_lock:
            self._abandoned += 1
            over = self._abandoned > self._max_abandoned
        with lane.lock:
            lane.abandoned += 1
        if old.thread is not None:
            old.thread.name = f"{LANE_THREAD_PREFIX}{lane.index}{suffix}"
        if over:
            logger.error(
                "%d lane threads are abandoned, more than the %d tolerated: health now "
                "reports NOT_SERVING; restart this server",
                self._abandoned,
                self._max_abandoned,
            )

    def _lane_reported(self, index: int, result: outcome.Outcome[_LaneFacts]) -> None:
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

    def _exited(self, lane: _Lane, inc: _Incarnation) -> None:
        """Trio thread: an incarnation's thread ran its last act."""
        inc.exited.set()
        self._wake_lane(lane.index)

    def _to_trio(self, fn: Callable[..., None], *args: Any) -> None:
        """Any thread: run ``fn`` on the Trio thread (dropped once the run is over)."""
        bridge = self._to_trio_bridge
        if bridge is not None:
            bridge(fn, *args)

    async def _watchdog(self, seconds: float) -> None:
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
                    self._wedge(lane, item, error, min_age_ns=limit_ns, answer=True)
                else:
                    self._build_overran(lane, build_seconds)
            await trio.sleep(max(next_ns - now, 1_000_000) / 1e9)

    # ---- the thread side --------------------------------------------------------------

    def _lane_main(self, lane: _Lane, inc: _Incarnation) -> None:
        """One incarnation's whole life: build the env, serve the mailbox, close the env.

        With process isolation this thread is the env's proxy: the env lives in a child
        process (:class:`~rlmesh_trio._lanes._process.ChildLane`) and this thread only
        routes the jobs' bytes to it.
        """
        env: gym.Env[Any, Any] | None = None
        child: ChildLane | None = None
        try:
            if lane.stopping:  # closed (or startup failed elsewhere) before we built
                return
            try:
                if self._isolation == "process":
                    child = ChildLane(self._make_env, self._policy, lane.index, inc.number)
                    inc.child = child
                    facts = child.build()
                else:
                    env = self._make_env()
                    facts = _lane_facts(env)
            except Exception as exc:
                if inc.number == 0:
                    self._to_trio(self._lane_reported, lane.index, outcome.Error(exc))
                else:
                    self._rebuild_failed(lane, inc, exc)
                return
            if inc.number == 0:
                self._to_trio(self._lane_reported, lane.index, outcome.Value(facts))
                del facts
                self._go.wait()  # set by run() once it decided; not a poll
                if self._contract is None:
                    return
            else:
                assert self._facts0 is not None
                diffs = _contract_differences(self._facts0, facts)
                del facts
                if diffs:
                    mismatch = ContractMismatchError(
                        f"the rebuilt env disagrees with lane 0 on the env contract: "
                        f"{'; '.join(diffs)}"
                    )
                    self._rebuild_failed(lane, inc, mismatch)
                    return
                if not self._rebuilt(lane, inc):
                    return
            if child is not None:
                self._serve(lane, inc, child.execute)
            else:
                assert env is not None and self._work is not None
                self._serve(lane, inc, functools.partial(self._work.execute, env))
        except Exception:
            # Only an engine bug gets here (job and callback errors are caught per job):
            # the lane stops (its jobs are answered below); the other lanes go on.
            logger.exception("lane %d died", lane.index)
        finally:
            with lane.lock:
                mine = lane.incarnation is inc and not inc.detached
                dead = lane.state is LaneState.DEAD
                if mine:
                    lane.running = False
            if mine and not dead:
                self._fail_pending(lane)
            if env is not None:
                try:
                    env.close()
                except Exception:
                    logger.exception("lane %d: env.close() raised", lane.index)
                env = None
            if child is not None:
                child.close(min(CHILD_STOP_TIMEOUT, self._teardown_timeout))
            self._to_trio(self._exited, lane, inc)

    def _rebuilt(self, lane: _Lane, inc: _Incarnation) -> bool:
        """Lane thread: a fresh env agrees with the contract; serve (unless superseded)."""
        with lane.lock:
            if inc.detached or lane.stopping:
                return False
            lane.state = LaneState.SERVING
            lane.rebuilds += 1
            lane.running = True
            attempt, lane.attempt = lane.attempt, 0
            took = (perf_counter_ns() - lane.since) / 1e9
        logger.info("lane %d rebuilt (attempt %d, %.3f s)", lane.index, attempt, took)
        return True

    def _rebuild_failed(self, lane: _Lane, inc: _Incarnation, exc: BaseException) -> None:
        """Lane thread: the factory raised or built a disagreeing env. Refuse jobs (fatal)
        until the supervisor's next attempt; answer the ones waiting for this one."""
        with lane.lock:
            if inc.detached or lane.stopping:
                return
            cause = f"{type(exc).__name__}: {exc}"
            lane.last_cause = cause
            lane.state = LaneState.DEAD
            refusal = LaneDeadError(
                f"lane {lane.index} could not be rebuilt (attempt {lane.attempt}): {cause}"
            )
            lane.refusal = refusal
            waiting = self._take_queued(lane)
        delay = self._rebuild_delay(lane.attempt)
        logger.error(
            "lane %d: rebuild attempt %d failed (%s); next attempt in %.3g s",
            lane.index,
            lane.attempt,
            cause,
            delay,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        for item in waiting:
            _answer(lane.index, item, outcome.Error(refusal), Phases())

    def _build_overran(self, lane: _Lane, seconds: float) -> None:
        """Trio thread (watchdog): a rebuild's factory call overran ``lane_timeout``."""
        with lane.lock:
            inc = lane.incarnation
            if lane.state is not LaneState.REBUILDING or lane.current is not None:
                return
            if inc.thread is None or lane.stopping:
                return
            inc.detached = True
            inc.abandoned = inc.child is None
            lane.incarnation = _Incarnation(inc.number + 1)
        if inc.child is not None:
            inc.child.kill()
        else:
            self._count_abandoned(lane, inc, "-abandoned")
        exc = TimeoutError(f"the env factory did not return within {seconds:.3g} s")
        # The new (never started) incarnation records the failure, as its own would.
        self._rebuild_failed(lane, lane.incarnation, exc)
        self._wake_lane(lane.index)

    def _take_queued(self, lane: _Lane) -> list[_Item]:
        """Under the lane lock: every job waiting in the mailbox (and the retry slot)."""
        items: list[_Item] = []
        if lane.retry is not None:
            items.append(lane.retry[0])
            lane.retry = None
        stop = False
        while True:
            try:
                item = lane.mailbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Stop):
                stop = True
            else:
                items.append(item)
        if stop:
            lane.mailbox.put(_STOP)
        return items

    def _serve(
        self,
        lane: _Lane,
        inc: _Incarnation,
        execute: Callable[[Job, int], tuple[outcome.Outcome[Any], Phases, bool]],
    ) -> None:
        get = lane.mailbox.get
        lock = lane.lock
        index = lane.index
        supervised = self._supervised
        fresh = inc.number > 0  # a rebuilt env: the client has not reset it yet
        while True:
            retried = 0
            item: _Item | _Stop
            if lane.retry is not None:  # only ever set before this incarnation started
                with lock:
                    pending, lane.retry = lane.retry, None
                if pending is None:
                    continue
                item, retried = pending
            else:
                item = get()
            picked = perf_counter_ns()
            with lock:
                stop = lane.stopping or isinstance(item, _Stop)
                if not stop:
                    assert not isinstance(item, _Stop)
                    lane.current = item
                    lane.since = picked
            if stop:
                if not isinstance(item, _Stop):
                    _answer(index, item, outcome.Error(_stopped(index)), Phases())
                return
            assert not isinstance(item, _Stop)
            posted, job, _reply = item
            if fresh and isinstance(job, StepJob):
                self._refuse_unreset(lane, item)
                continue
            result, phases, faulted = execute(job, picked - posted)
            detach = False
            with lock:
                taken = lane.current is not item
                if not taken:
                    lane.current = None
                    if lane.state is LaneState.WEDGED:
                        lane.state = LaneState.SERVING
                        lane.refusal = None
                    if faulted:
                        lane.faults += 1
                        if supervised and not lane.stopping:
                            detach = True
                            self._detach(lane, inc)
                            if self._truncate and isinstance(job, ResetJob) and not retried:
                                lane.retry = (item, 1)
            if taken:
                # The job was answered for us: the lane stopped or abandoned us, or (policy
                # ``error``) declared the call wedged and now gets it back.
                if inc.detached or lane.stopping:
                    return
                self._unwedged(lane, job)
                continue
            if detach:
                assert isinstance(result, outcome.Error)
                self._faulted(lane, item, result, phases, retry=lane.retry is not None)
                return  # the ``finally`` of _lane_main closes the faulted env, here
            if isinstance(result, outcome.Error) and isinstance(result.error, LaneProcessDiedError):
                # Policy ``error``: nothing rebuilds the lane; it refuses from now on.
                _answer(index, item, result, phases)
                self._lane_lost(lane, str(result.error))
                return
            if fresh and isinstance(job, ResetJob) and isinstance(result, outcome.Value):
                fresh = False
            _answer(index, item, result, phases)
            del job, result, item, _reply

    def _lane_lost(self, lane: _Lane, cause: str) -> None:
        """Lane thread, policy ``error``: the lane's child process died; refuse its jobs."""
        reason = cause.split(": ", 1)[-1]
        with lane.lock:
            lane.state = LaneState.DEAD
            lane.last_cause = reason
            refusal = LaneDeadError(
                f"lane {lane.index} is gone: {reason} (--on-lane-fault rebuild would rebuild it)"
            )
            lane.refusal = refusal
            waiting = self._take_queued(lane)
        logger.error("lane %d: %s; the lane is lost (policy error)", lane.index, reason)
        for item in waiting:
            _answer(lane.index, item, outcome.Error(refusal), Phases())

    def _detach(self, lane: _Lane, inc: _Incarnation) -> None:
        """Under the lane lock: the lane moves on from ``inc`` to a fresh incarnation."""
        inc.detached = True
        lane.incarnation = _Incarnation(inc.number + 1)
        lane.state = LaneState.REBUILDING
        lane.refusal = None
        lane.attempt += 1
        lane.since = perf_counter_ns()

    def _faulted(
        self,
        lane: _Lane,
        item: _Item,
        result: outcome.Error,
        phases: Phases,
        *,
        retry: bool,
    ) -> None:
        """Lane thread, supervised: the env raised; answer, and hand over to a fresh env."""
        error = result.error
        verb = verb_of(item[1])
        cause = f"{type(error).__name__}: {error}"
        with lane.lock:
            lane.last_cause = cause
        logger.warning(
            "lane %d: env.%s raised (%s); rebuilding the lane on a fresh thread%s",
            lane.index,
            verb,
            cause,
            " and retrying the reset there" if retry else "",
        )
        if not retry:
            _answer(lane.index, item, result, phases, LaneFault(lane=lane.index, error=cause))
        threading.current_thread().name = f"{LANE_THREAD_PREFIX}{lane.index}-retired"
        self._to_trio(self._wake_lane, lane.index)

    def _refuse_unreset(self, lane: _Lane, item: _Item) -> None:
        """Lane thread: a step on a rebuilt env nobody reset yet is refused, not run."""
        with lane.lock:
            if lane.current is item:
                lane.current = None
        cause = lane.last_cause or "a fault"
        error = LaneNeedsResetError(
            f"step failed: lane {lane.index} was rebuilt after a fault ({cause}); "
            "reset it before stepping"
        )
        fault = LaneFault(lane=lane.index, error=cause)
        _answer(lane.index, item, outcome.Error(error), Phases(), fault)

    def _unwedged(self, lane: _Lane, job: Job) -> None:
        """Lane thread, policy ``error``: a call declared wedged returned after all."""
        with lane.lock:
            if lane.state is not LaneState.WEDGED:
                return
            lane.state = LaneState.SERVING
            lane.refusal = None
            took = (perf_counter_ns() - lane.since) / 1e9
        logger.warning(
            "lane %d: the wedged env.%s returned after %.3g s; the lane serves again "
            "(its late result was dropped)",
            lane.index,
            verb_of(job),
            took,
        )

    def _fail_pending(self, lane: _Lane) -> None:
        """Any thread: stop taking jobs; answer the running and the queued ones as stopped.

        Safe to run concurrently from the lane thread and the Trio thread (an abandoned
        lane that later comes back): each job is taken out of ``current`` or the mailbox by
        exactly one caller, under the lane lock or by the queue itself.
        """
        with lane.lock:
            lane.accepting = False
            lane.stopping = True
            current, lane.current = lane.current, None
            queued = self._take_queued(lane)
        if current is not None:
            _answer(lane.index, current, outcome.Error(_stopped(lane.index)), Phases())
        for item in queued:
            _answer(lane.index, item, outcome.Error(_stopped(lane.index)), Phases())
        # No job can follow (``accepting`` is false); a fresh sentinel makes sure a lane
        # thread that comes back from being abandoned finds its way out of ``get()``.
        lane.mailbox.put(_STOP)

    # ---- wedged lanes (any thread) ----------------------------------------------------

    def wedged(self, lane: int, job: Job, seconds: float) -> None:
        """A request's deadline of ``seconds`` expired while ``job`` was queued on or run
        by ``lane``. Any thread; never blocks.

        The lane is wedged if ``job`` is the one running, or if the job running has run
        for longer than that deadline; otherwise ``job`` is merely queued behind a busy
        lane and nothing happens. See :meth:`_wedge` for what a wedge does.
        """
        record = self._lane(lane)
        item = record.current
        if item is None:
            return
        verb = verb_of(item[1])
        error = LaneTimeoutError(f"env.{verb} timed out after {round(seconds * 1000)}ms")
        min_age_ns = 0 if item[1] is job else int(seconds * 1e9)
        self._wedge(record, item, error, min_age_ns=min_age_ns, answer=False)

    def _wedge(
        self,
        lane: _Lane,
        item: _Item,
        error: LaneTimeoutError,
        *,
        min_age_ns: int,
        answer: bool,
    ) -> None:
        """``item``'s env call overran a deadline.

        ``rebuild``/``truncate``: ``item`` is answered now with ``error``; the thread is
        abandoned with its env (a Python thread cannot be killed) and a fresh incarnation
        takes the lane; queued jobs wait for it.

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
            lane.wedges += 1
            inc = lane.incarnation
            queued: list[_Item] = []
            if self._supervised:
                lane.current = None
                self._detach(lane, inc)
                inc.abandoned = inc.child is None
            else:
                lane.state = LaneState.WEDGED
                refusal = LaneWedgedError(
                    f"lane {lane.index} is wedged: its env.{verb} overran a deadline after "
                    f"{age / 1e9:.3g} s and has not returned"
                )
                lane.refusal = refusal
                if answer:
                    lane.current = None
                    queued = self._take_queued(lane)
        name = inc.thread.name if inc.thread is not None else "?"
        if self._supervised:
            if inc.child is not None:
                inc.child.kill()  # a process can be killed: nothing is abandoned
                logger.warning(
                    "lane %d: env.%s has run for %.3g s (%s); killed its process %s and "
                    "rebuilding the lane in a fresh one",
                    lane.index,
                    verb,
                    age / 1e9,
                    error,
                    inc.child.pid,
                )
            else:
                self._count_abandoned(lane, inc, "-abandoned")
                logger.warning(
                    "lane %d: env.%s has run for %.3g s (%s); abandoning thread %r with its "
                    "env and rebuilding the lane on a fresh thread (%d abandoned lane "
                    "threads in this process)",
                    lane.index,
                    verb,
                    age / 1e9,
                    error,
                    name,
                    self._abandoned,
                )
            fault = LaneFault(lane=lane.index, error=f"TimeoutError: {error}")
            _answer(lane.index, item, outcome.Error(error), Phases(), fault)
            self._to_trio(self._wake_lane, lane.index)
            return
        logger.warning(
            "lane %d: env.%s has run for %.3g s (%s) on thread %r; the lane refuses jobs "
            "until it returns",
            lane.index,
            verb,
            age / 1e9,
            error,
            name,
        )
        if answer:
            _answer(lane.index, item, outcome.Error(error), Phases())
        for waiting in queued:
            _answer(lane.index, waiting, outcome.Error(refusal), Phases())

    # ---- any thread -------------------------------------------------------------------

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
            record.mailbox.put(item)

    def close(self) -> None:
        """Close every mailbox at once; :meth:`run` then tears down. Idempotent, any thread.

        Does not wait. Jobs posted afterwards are refused; jobs still queued are answered
        as stopped; each lane finishes the job it is running.
        """
        self._close_requested = True
        for lane in self._lanes:
            with lane.lock:
                already = lane.stopping
                lane.accepting = False
                lane.stopping = True
                queued = self._take_queued(lane) if lane.state is LaneState.DEAD else []
            for item in queued:
                _answer(lane.index, item, outcome.Error(_stopped(lane.index)), Phases())
            if not already:
                lane.mailbox.put(_STOP)
            self._to_trio(self._wake_lane, lane.index)
        self._to_trio(self._wake_run)

    def alive(self, lane: int) -> bool:
        """Whether lane ``lane``'s thread is serving its mailbox and takes jobs.

        False before the lane is up, once it is closing and after its thread is gone.
        Raises ``LaneError`` for a bad index.
        """
        record = self._lane(lane)
        return record.running and record.accepting and record.refusal is None

    def _lane(self, lane: int) -> _Lane:
        if not 0 <= lane < self.num_envs:
            raise LaneError(f"lane {lane} out of range for {self.num_envs} lanes")
        return self._lanes[lane]


def _answer(
    index: int,
    item: _Item,
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
