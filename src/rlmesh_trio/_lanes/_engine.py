"""The lane engine: N gymnasium envs as the lanes of one endpoint.

A lane is one Trio task plus one long-lived thread (DESIGN.md decision 3). The task calls
``trio.to_thread.run_sync(lane_main, ...)`` once for the lane's whole life; the thread builds
the lane's env (so the env is created and only ever used on that thread), then loops on its
mailbox, a ``queue.SimpleQueue`` that the transport thread posts into directly. Every job
runs its wire work on the lane thread (decode the action, call the env, encode the result)
and hands a :class:`~rlmesh_trio._jobs.LaneReply` to the ``reply`` callable the job was
posted with.

Lanes are independent: no lock is shared between lanes, a job for lane 2 never waits for
lane 0, and one lane's slow env costs the others nothing.

"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any, Final

import gymnasium as gym
import outcome
import trio

from .._bridge import ToTrio
from .._codec import Candidate, SpaceCodec, to_meta_map
from .._errors import (
    ContractMismatchError,
    LaneBrokenError,
    LaneClosedError,
    LaneError,
    PolicyViolation,
)
from .._jobs import (
    CallJob,
    EnvContract,
    Job,
    LaneReply,
    Phases,
    RenderJob,
    RenderResult,
    ReplyFn,
    ResetJob,
    ResetResult,
    StepJob,
    StepResult,
)
from .._options import DEFAULT_CLOSE_TIMEOUT, Policy
from .._png import encode_png
from ._contract import EnvFacts as _LaneFacts
from ._contract import contract_differences as _contract_differences
from ._contract import lane_facts as _lane_facts
from ._lane import _DECODE, _ENCODE, _STOP, _USER, _Lane, _Split, _Stop, _stopped

__all__ = [
    "LANE_TEARDOWN_TIMEOUT",
    "LANE_THREAD_PREFIX",
    "LaneEngine",
]

LANE_TEARDOWN_TIMEOUT: float = DEFAULT_CLOSE_TIMEOUT
"""Default shared teardown deadline, in seconds, for all lanes together (the servers'
``close_timeout_seconds`` default)."""

LANE_THREAD_PREFIX: Final = "rlmesh-trio-lane-"
"""Lane ``i``'s thread is named ``f"{LANE_THREAD_PREFIX}{i}"`` while it serves the lane."""

logger = logging.getLogger("rlmesh_trio.lanes")

_POLICIES: Final = ("warn", "strict", "off")


# --------------------------------------------------------------------------------------
# The engine


class LaneEngine:
    """Runs ``num_envs`` gymnasium envs, each on its own long-lived lane thread.

    Lifecycle: construct, then ``await nursery.start(engine.run)``; post jobs with
    :meth:`post` from any thread; stop with :meth:`close` (any thread) or by cancelling
    ``run``. Jobs posted before ``run`` started wait in their mailbox until their lane has
    built its env and the contract is agreed.

    Threads: lane ``i`` runs on one thread named ``rlmesh-trio-lane-<i>`` for its whole
    life (one ``trio.to_thread.run_sync`` call, with the engine's own
    ``CapacityLimiter(num_envs)`` so the lanes never wait for Trio's default limiter).
    Trio runs it on a worker of its thread cache and renames the worker back to its
    default ``Trio thread N`` name before it tells the lane task that the lane returned;
    so once :meth:`run` has returned no thread carries a lane name, except the thread of
    a lane that was abandoned. Idle cache workers are daemon threads that exit on their
    own after Trio's idle timeout (10 s); they hold no env.
    """

    def __init__(
        self,
        make_env: Callable[[], gym.Env[Any, Any]],
        num_envs: int = 1,
        *,
        policy: Policy = "warn",
        teardown_timeout: float = LANE_TEARDOWN_TIMEOUT,
    ) -> None:
        if not callable(make_env):
            raise TypeError(f"make_env must be callable, got {type(make_env).__name__}")
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"num_envs must be an integer >= 1, got {num_envs!r}")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        if not teardown_timeout >= 0:
            raise ValueError(f"teardown_timeout must be >= 0, got {teardown_timeout!r}")
        self.num_envs: int = num_envs
        self._make_env = make_env
        self._policy: Policy = policy
        self._soft = policy != "off"
        self._strict = policy == "strict"
        self._teardown_timeout = float(teardown_timeout)
        self._lanes = [_Lane(i) for i in range(num_envs)]
        self._contract: EnvContract | None = None
        self._action_codec: SpaceCodec | None = None
        self._observation_codec: SpaceCodec | None = None
        # Startup handshake between the lane threads and run():
        self._go = threading.Event()  # run() decided: serve (contract set) or wind down
        self._facts: list[outcome.Outcome[_LaneFacts] | None] = [None] * num_envs
        self._startup_done = trio.Event()
        self._close_event = trio.Event()
        self._close_requested = False
        self._to_trio_bridge: ToTrio | None = None
        self._run_called = False
        self._deadline_cap = math.inf

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
        limiter = trio.CapacityLimiter(self.num_envs)
        async with trio.open_nursery() as nursery:
            for lane in self._lanes:
                lane.scope = trio.CancelScope(shield=True)
                nursery.start_soon(
                    self._lane_task, lane, limiter, name=f"{LANE_THREAD_PREFIX}{lane.index}"
                )
            try:
                await self._startup_done.wait()
                failure = self._decide_startup()
                if failure is None and not self._close_requested:
                    task_status.started(self)
                    await self._close_event.wait()
            finally:
                self._begin_teardown()
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
        self._action_codec = action_codec
        self._observation_codec = observation_codec
        self._contract = EnvContract(
            env_id=lane0.env_id,
            action_space=lane0.action_space,
            observation_space=lane0.observation_space,
            action_codec=action_codec,
            observation_codec=observation_codec,
            metadata=lane0.metadata,
            render_mode=lane0.render_mode,
        )
        for lane in self._lanes:
            # Every lane thread is alive (waiting for ``_go``): up from now on, so that
            # ``alive()`` is true as soon as ``started`` is.
            lane.running = True
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

    async def _lane_task(self, lane: _Lane, limiter: trio.CapacityLimiter) -> None:
        assert lane.scope is not None
        try:
            with lane.scope:
                await trio.to_thread.run_sync(
                    self._lane_main,
                    lane,
                    thread_name=f"{LANE_THREAD_PREFIX}{lane.index}",
                    abandon_on_cancel=True,
                    limiter=limiter,
                )
        except Exception as exc:
            # Only an engine bug gets here (job and callback errors are caught on the lane
            # thread); the thread's ``finally`` already answered its pending jobs and closed
            # its env. The other lanes keep running; a lane that dies during startup fails
            # the startup with its exception.
            logger.exception("lane %d died", lane.index)
            self._lane_reported(lane.index, outcome.Error(exc))
            return
        if lane.scope.cancelled_caught:
            logger.warning(
                "lane %d did not stop within the %.3g s teardown deadline; "
                "abandoning its thread %r",
                lane.index,
                self._teardown_timeout,
                f"{LANE_THREAD_PREFIX}{lane.index}",
            )
            self._fail_pending(lane)

    def _lane_reported(self, index: int, result: outcome.Outcome[_LaneFacts]) -> None:
        """Trio thread: lane ``index`` built its env (or failed to)."""
        if self._facts[index] is not None:
            return
        self._facts[index] = result
        if isinstance(result, outcome.Error) or all(f is not None for f in self._facts):
            self._startup_done.set()

    def _wake_run(self) -> None:
        """Trio thread: close() was called."""
        self._close_event.set()
        self._startup_done.set()

    def _to_trio(self, fn: Callable[..., None], *args: Any) -> None:
        """Any thread: run ``fn`` on the Trio thread (dropped once the run is over)."""
        bridge = self._to_trio_bridge
        if bridge is not None:
            bridge(fn, *args)

    # ---- the thread side --------------------------------------------------------------

    def _lane_main(self, lane: _Lane) -> None:
        """The lane thread's whole life: build the env, serve the mailbox, close the env."""
        env: gym.Env[Any, Any] | None = None
        try:
            if lane.stopping:  # closed (or startup failed elsewhere) before we built
                return
            try:
                env = self._make_env()
                facts = _lane_facts(env)
            except Exception as exc:
                self._to_trio(self._lane_reported, lane.index, outcome.Error(exc))
                return
            self._to_trio(self._lane_reported, lane.index, outcome.Value(facts))
            del facts
            self._go.wait()  # set by run() once it decided; not a poll
            if self._contract is None:
                return
            self._serve(lane, env)
        finally:
            lane.running = False
            self._fail_pending(lane)
            if env is not None:
                try:
                    env.close()
                except Exception:
                    logger.exception("lane %d: env.close() raised", lane.index)
                env = None

    def _serve(self, lane: _Lane, env: gym.Env[Any, Any]) -> None:
        get = lane.mailbox.get
        lock = lane.lock
        index = lane.index
        while True:
            item = get()
            picked = perf_counter_ns()
            with lock:
                stop = lane.stopping or isinstance(item, _Stop)
                if not stop:
                    assert not isinstance(item, _Stop)
                    lane.current = item
            if stop:
                if not isinstance(item, _Stop):
                    _answer(index, item, outcome.Error(_stopped(index)), Phases())
                return
            assert not isinstance(item, _Stop)
            posted, job, _reply = item
            result, phases = self._execute(env, job, picked - posted)
            with lock:
                if lane.current is not item:
                    return  # abandoned meanwhile: the job was already answered as stopped
                lane.current = None
            _answer(index, item, result, phases)
            del job, result, item, _reply

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
        if current is not None:
            _answer(lane.index, current, outcome.Error(_stopped(lane.index)), Phases())
        while True:
            try:
                item = lane.mailbox.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, _Stop):
                _answer(lane.index, item, outcome.Error(_stopped(lane.index)), Phases())
        # No job can follow (``accepting`` is false); a fresh sentinel makes sure a lane
        # thread that comes back from being abandoned finds its way out of ``get()``.
        lane.mailbox.put(_STOP)

    # ---- the wire work of one job (lane thread) ---------------------------------------

    def _execute(
        self, env: gym.Env[Any, Any], job: Job, queue_ns: int
    ) -> tuple[outcome.Outcome[Any], Phases]:
        result: outcome.Outcome[Any]
        if isinstance(job, StepJob):
            split = _Split(_DECODE)
            result = outcome.capture(self._step, env, job, split)
        elif isinstance(job, ResetJob):
            split = _Split(_USER)
            result = outcome.capture(self._reset, env, job, split)
        elif isinstance(job, CallJob):
            split = _Split(_USER)
            result = outcome.capture(job.fn, env)
        elif isinstance(job, RenderJob):
            split = _Split(_USER)
            result = outcome.capture(self._render, env, split)
        else:
            split = _Split(_USER)
            result = outcome.Error(TypeError(f"not a lane job: {type(job).__name__}"))
        return result, split.phases(queue_ns)

    def _encode_observation(self, observation: Any) -> tuple[list[bytes], Candidate | None]:
        codec = self._observation_codec
        assert codec is not None
        leaves, candidate = codec.encode_observation(observation, soft_checks=self._soft)
        if candidate is not None and self._strict:
            raise PolicyViolation(candidate.detail, candidate.kind)
        return leaves, candidate

    def _reset(self, env: gym.Env[Any, Any], job: ResetJob, split: _Split) -> ResetResult:
        observation, info = env.reset(seed=job.seed, options=job.options)
        split.enter(_ENCODE)
        leaves, candidate = self._encode_observation(observation)
        return ResetResult(observation=leaves, info=to_meta_map(info), obs_warning=candidate)

    def _step(self, env: gym.Env[Any, Any], job: StepJob, split: _Split) -> StepResult:
        codec = self._action_codec
        assert codec is not None
        if not job.validated:
            codec.validate_action(job.leaves, job.n)
        action, action_candidate = codec.decode_action(
            job.leaves, job.n, job.row, soft_checks=self._soft
        )
        if action_candidate is not None and self._strict:
            raise PolicyViolation(action_candidate.detail, action_candidate.kind)
        split.enter(_USER)
        observation, reward, terminated, truncated, info = env.step(action)
        split.enter(_ENCODE)
        leaves, obs_candidate = self._encode_observation(observation)
        return StepResult(
            observation=leaves,
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated),
            info=to_meta_map(info),
            action_warning=action_candidate,
            obs_warning=obs_candidate,
        )

    def _render(self, env: gym.Env[Any, Any], split: _Split) -> RenderResult:
        frame = env.render()
        split.enter(_ENCODE)
        if frame is None:
            return RenderResult(frame=None)
        return RenderResult(frame=encode_png(frame))

    # ---- any thread -------------------------------------------------------------------

    def post(self, lane: int, job: Job, reply: ReplyFn) -> None:
        """Queue ``job`` on lane ``lane``. Thread-safe, never blocks, arrival order per lane.

        ``reply(LaneReply(job.id, lane, ...))`` is called exactly once: by the lane
        thread with the result, or
        with ``LaneBrokenError("lane <i> stopped before answering")`` if the lane winds down
        or is abandoned first. Raises ``LaneError("lane <i> out of range for <n> lanes")``
        for a bad index; ``LaneClosedError("lane <i> is no longer running")`` once the
        engine was closed, ``LaneBrokenError`` (same text) when the lane's thread is gone
        otherwise (then ``reply`` is never called).
        """
        record = self._lane(lane)
        item = (perf_counter_ns(), job, reply)
        with record.lock:
            if not record.accepting:
                # "closed" (the engine was closed: orderly) and "broken" (the lane's
                # thread died or was abandoned) are kept apart, as Trio does.
                cls = LaneClosedError if self._close_requested else LaneBrokenError
                raise cls(f"lane {lane} is no longer running")
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
            if not already:
                lane.mailbox.put(_STOP)
        self._to_trio(self._wake_run)

    def alive(self, lane: int) -> bool:
        """Whether lane ``lane``'s thread is serving its mailbox and takes jobs.

        False before the lane is up, once it is closing and after its thread is gone.
        Raises ``LaneError`` for a bad index.
        """
        record = self._lane(lane)
        return record.running and record.accepting

    def _lane(self, lane: int) -> _Lane:
        if not 0 <= lane < self.num_envs:
            raise LaneError(f"lane {lane} out of range for {self.num_envs} lanes")
        return self._lanes[lane]


def _answer(
    index: int, item: tuple[int, Job, ReplyFn], result: outcome.Outcome[Any], phases: Phases
) -> None:
    """Hand one answer to the job's reply callback; a callback error must not kill the lane."""
    _posted, job, reply = item
    try:
        reply(LaneReply(job.id, index, result, phases))
    except Exception:
        logger.exception("lane %d: the reply callback of a %s raised", index, type(job).__name__)
