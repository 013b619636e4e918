"""The Join protocol as a sans-IO state machine (SPEC §7, §9).

Nothing here does I/O, starts a thread, holds a callback or reads a clock it was not
given. :class:`Session` is one per Join stream; the transport's Join driver feeds it
events and performs the actions it returns, in order:

- ``session.on_request(request)`` -- a JoinRequest was decoded;
- ``session.on_lane_reply(reply)`` -- a lane answered a job (``reply.job_id`` names it);
- ``session.on_lane_replies(replies)`` -- every lane of one job answered (a whole-vector
  op's replies, gathered; the same as each one's ``on_lane_reply`` in turn);
- ``session.on_timer(token)`` -- a :class:`StartTimer` expired;
- ``session.on_half_close()`` -- the client sent its last request (END_STREAM): every
  request read is still answered, then the session ends the stream (:class:`EndStream`);
- ``session.on_stream_end()`` -- the stream ended: cancelled, vanished, or after any
  other end.

Actions: :class:`Post` (queue this job on that lane; if the lane refuses it, feed the
refusal back as a lane reply), :class:`Send`, :class:`Report` (for the log and the
metrics), :class:`Done` (for the metrics, with ``observe=True``), :class:`StartTimer`,
:class:`CancelTimer`, :class:`EndStream`.

Request classes (SPEC §7.4): a reset or step with ``env_indices`` is *lane-scoped*: it
is posted at once, lanes run concurrently, replies go out when each request completes
(out of order), and requests for one lane queue in that lane's mailbox. Everything else
is *serial*: it waits until every posted lane job has finished (a barrier), runs alone,
and no later request is looked at until it has been answered.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import betterproto2
import outcome

from .._codec import from_meta_map
from .._errors import ActionError
from .._jobs import (
    Job,
    LaneFault,
    LaneReply,
    Phases,
    RenderJob,
    ResetJob,
    ResetResult,
    StepJob,
    StepResult,
)
from .._proto.rlmesh.env import v1 as env_v1
from ._actions import (
    Action,
    CancelTimer,
    Done,
    EndStream,
    Post,
    Report,
    Send,
    StartTimer,
    Wedged,
)
from ._endpoint import Endpoint
from ._episodes import EpisodeBook
from ._faults import failure, truncation
from ._ops import Op, Waiting
from ._plan import Refusal, deadline_ms, plan_configure, plan_render, plan_reset, plan_step
from ._replies import Replies
from ._results import fold_phases
from ._straight import clean_step, clean_steps, lane_step_op, vector_step_op

_UNRECOGNIZED = (
    "empty or unrecognized Join request (a newer-edition arm this build does not implement?)"
)

Code = env_v1.EnvErrorCode


# --------------------------------------------------------------------------- session


class Session:
    """One Join stream's state (SPEC §7). Not thread-safe: transport loop only."""

    straight_line = True
    """One lane's step takes the straight line (:meth:`_lane_step`, :meth:`_lane_step_done`)
    when nothing holds it back, and so does a whole-vector step (:meth:`_vector_step`,
    :meth:`_vector_step_done`); False sends them through the general queue and op
    machinery (the tests compare the two)."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        wall_ns: Callable[[], int] = time.time_ns,
        observe: bool = False,
    ) -> None:
        self._endpoint = endpoint
        self._observe = observe
        self._clock_ns = clock_ns
        self._replies = Replies(endpoint, clock_ns)
        self._n = endpoint.num_envs
        self._pending: deque[Waiting] = deque()
        self._entry: Waiting | None = None  # the request being dispatched right now
        self._verb = ""  # its kind, for reports
        self._ops: dict[int, Op] = {}
        self._serial: Op | None = None
        self._outstanding = 0  # lane jobs posted and not answered yet (timed-out ones too)
        self._tokens = endpoint.tokens  # unique over the endpoint's sessions
        self._finished = False
        self._half_closed = False  # no more requests will come: end once all are answered
        self._truncate = endpoint.on_lane_fault == "truncate"
        # Policy ``rebuild``/``truncate``: a faulted lane's error is CRASHED, recoverable.
        self._supervised = endpoint.on_lane_fault != "error"
        # Policy ``truncate``: the book keeps each lane's last observation, for a faulted
        # step's answer.
        self._book = EpisodeBook(self._n, wall_ns, keep_observations=self._truncate)

    # ----------------------------------------------------------------- events

    def on_request(self, request: env_v1.JoinRequest) -> list[Action]:
        if self._finished:
            return []
        step = request.step
        if (
            step is not None
            and self.straight_line
            and not self._pending
            and self._serial is None
            and step.action is not None
        ):
            # The hot path: one lane's step, which nothing holds back (no request is
            # queued, no serial one runs): posted at once, as _pump would post it. A
            # whole-vector step of a one-lane endpoint (rlmesh.run's at N = 1) is one too,
            # once every lane job is answered (its barrier), and stays serial.
            indices = step.env_indices
            if len(indices) == 1 and indices[0] < self._n:
                return self._lane_step(request.request_id, step, indices[0], serial=False)
            if not indices and not self._outstanding:
                if self._n == 1:
                    return self._lane_step(request.request_id, step, 0, serial=True)
                return self._vector_step(request.request_id, step)
        timeout_ms = deadline_ms(request)
        entry = Waiting(request, self._clock_ns(), next(self._tokens), timeout_ms)
        self._pending.append(entry)
        actions = self._pump()
        if timeout_ms and self._pending and self._pending[-1] is entry:
            # Held behind a serial request: its deadline runs from now all the same, so
            # a request queued behind a wedged env still gets its TIMEOUT reply in time.
            entry.timer_started = True
            actions.append(StartTimer(entry.token, timeout_ms / 1000.0))
        return actions

    def on_lane_reply(self, reply: LaneReply) -> list[Action]:
        op = self._ops.get(reply.job_id)
        if op is not None and op.lane_step and self._straight(op):
            result = clean_step(reply)
            if result is not None:
                return self._then(self._lane_step_done(op, reply, result))
        return self._then(self._deliver(reply.job_id, reply))

    def on_lane_replies(self, replies: Sequence[LaneReply]) -> list[Action]:
        """Every lane of one job answered (``replies``, one per lane, in any order): a
        whole-vector step whose lanes all stepped cleanly completes on the straight line;
        anything else is each reply's :meth:`on_lane_reply` in turn."""
        op = self._ops.get(replies[0].job_id) if replies else None
        if (
            op is not None
            and op.vector_step
            and self._straight(op)
            and len(replies) == op.unsettled == len(op.lanes)
        ):
            results = clean_steps(replies, len(op.lanes))
            if results is not None:
                return self._then(self._vector_step_done(op, replies, results))
        actions = []
        for reply in replies:
            actions += self.on_lane_reply(reply)
        return actions

    def _straight(self, op: Op) -> bool:
        """Whether ``op``'s answer may take the straight line (its results permitting)."""
        return self.straight_line and not op.timed_out and not self._finished

    def _then(self, actions: list[Action]) -> list[Action]:
        """After a lane's answer: what waited behind it, and the end once all is answered."""
        if self._pending:
            actions.extend(self._pump())
        if self._half_closed:
            actions.extend(self._end_if_answered())
        return actions

    def on_half_close(self) -> list[Action]:
        """The client half-closed: answer what was read, then end the stream (what the
        reference does: queued and in-flight requests are answered, then the trailers).
        Episodes are dropped at that end as on any end without Close (SPEC 7.9)."""
        if self._finished:
            return []
        self._half_closed = True
        return self._end_if_answered()

    def _end_if_answered(self) -> list[Action]:
        """EndStream once no request waits and every dispatched one has its reply (a
        timed-out one was answered; its env call may still run, as after a Close)."""
        if self._finished or self._pending:
            return []
        if any(not op.timed_out for op in self._ops.values()):
            return []
        return self._end()

    def on_timer(self, token: int) -> list[Action]:
        actions = self._on_timer(token)
        if self._half_closed:
            actions.extend(self._end_if_answered())
        return actions

    def _on_timer(self, token: int) -> list[Action]:
        if self._finished:
            return []
        op = self._ops.get(token)
        if op is None:
            return self._expire_waiting(token)
        if op.timed_out:
            return []
        op.timed_out = True
        message = f"env.{op.verb} timed out after {op.timeout_ms}ms"
        missing = [pos for pos, reply in enumerate(op.replies) if reply is None]
        lanes = tuple(op.lanes[pos] for pos in missing)
        seconds = op.timeout_ms / 1000.0
        actions: list[Action] = [Wedged(op.lanes[pos], op.jobs[pos], seconds) for pos in missing]
        if self._can_truncate(op, missing):
            # Policy ``truncate``: the wedged lanes' steps are answered as truncations, the
            # others' as they answered; the request completes now.
            for pos in missing:
                fault = LaneFault(lane=op.lanes[pos], error=f"TimeoutError: {message}")
                self._settle(op, pos, self._truncation(op, pos, fault, Phases()))
            actions.append(Report("timeout", op.verb, op.request_id, lanes, Code.TIMEOUT, message))
            actions.extend(self._complete(op))
            actions.extend(self._pump())
            return actions
        actions += [
            self._replies.error(
                op.request_id, op.started_ns, Code.TIMEOUT, message, recoverable=True
            ),
            Report(
                "timeout", op.verb, op.request_id, lanes or tuple(op.lanes), Code.TIMEOUT, message
            ),
        ]
        if op.serial:
            # The reply is out, so the next request may be read; the barrier still waits
            # for the env call itself (``_outstanding``) before another serial op runs.
            self._serial = None
            actions.extend(self._pump())
        return actions

    def _expire_waiting(self, token: int) -> list[Action]:
        """A request still waiting for its turn ran out of time: answer, never run it."""
        for entry in self._pending:
            if entry.token == token:
                if entry.close_wait:
                    return self._close_anyway(entry)
                self._pending.remove(entry)
                verb = betterproto2.which_one_of(entry.request, "kind")[0]
                message = f"env.{verb} timed out after {entry.timeout_ms}ms"
                rid = entry.request.request_id
                return [
                    self._replies.error(
                        rid, entry.read_ns, Code.TIMEOUT, message, recoverable=True
                    ),
                    Report("timeout", verb, rid, (), Code.TIMEOUT, message),
                ]
        return []

    def _close_anyway(self, entry: Waiting) -> list[Action]:
        """A Close waited ``close_timeout`` for lane jobs still running: answer it without
        them (their lanes are named in the log) and end the stream."""
        busy = sorted(
            {
                op.lanes[pos]
                for op in self._ops.values()
                for pos, r in enumerate(op.replies)
                if r is None
            }
        )
        self._pending.remove(entry)
        names = ", ".join(str(lane) for lane in busy) or "-"
        message = (
            f"close waited {self._endpoint.close_timeout:.3g} s for env calls still running "
            f"on lanes {names}; answering it without them"
        )
        rid = entry.request.request_id
        report = Report("timeout", "close", rid, tuple(busy), Code.TIMEOUT, message)
        return [report, *self._close(rid, entry.read_ns)]

    def on_stream_end(self) -> list[Action]:
        """The stream ended without Close: drop the episode records (SPEC §7.9)."""
        self._finish()
        return []

    @property
    def busy(self) -> bool:
        """True while any request is queued or in flight, or a lane job is outstanding."""
        return bool(self._pending or self._ops or self._outstanding)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def backlog(self) -> int:
        """Requests read and not answered yet (queued, in flight, or timed out and still
        running); the driver stops reading past a bound (back-pressure)."""
        return len(self._pending) + len(self._ops)

    # ----------------------------------------------------------------- scheduling

    def _pump(self) -> list[Action]:
        actions: list[Action] = []
        while self._pending and not self._finished and self._serial is None:
            entry = self._pending[0]
            kind, body = betterproto2.which_one_of(entry.request, "kind")
            lane_scoped = kind in ("reset", "step") and bool(body.env_indices)  # type: ignore[union-attr]
            if not lane_scoped and self._outstanding:
                # Serial barrier: wait for every lane job to finish. A Close waits at most
                # ``close_timeout`` (an env call may never return).
                if kind == "close" and not entry.timer_started:
                    entry.timer_started = entry.close_wait = True
                    actions.append(StartTimer(entry.token, self._endpoint.close_timeout))
                break
            self._pending.popleft()
            self._entry = entry
            actions.extend(self._dispatch(entry.request, kind, body, entry.read_ns))
            self._entry = None
            if entry.timer_started and entry.token not in self._ops:
                actions.append(CancelTimer(entry.token))  # answered at once after all
        return actions

    def _dispatch(
        self, request: env_v1.JoinRequest, kind: str, body: Any, read_ns: int
    ) -> list[Action]:
        rid = request.request_id
        self._verb = kind or "unknown"
        if kind == "reset":
            return self._start_reset(rid, body, read_ns)
        if kind == "step":
            return self._start_step(rid, body, read_ns)
        if kind == "render":
            return self._start_render(rid, body, read_ns)
        if kind == "configure":
            return self._configure(rid, body, read_ns)
        if kind == "close":
            return self._close(rid, read_ns)
        return self._reject(rid, read_ns, Code.UNSUPPORTED, _UNRECOGNIZED, True)

    def _new_op(
        self, rid: str, verb: str, lanes: list[int], serial: bool, read_ns: int, timeout_ms: int
    ) -> Op:
        entry = self._entry
        assert entry is not None  # only called while _pump dispatches a request
        op = Op(
            token=entry.token,
            request_id=rid,
            verb=verb,
            lanes=lanes,
            serial=serial,
            started_ns=read_ns,
            timeout_ms=timeout_ms,
            timer_started=entry.timer_started,
        )
        op.replies = [None] * len(lanes)
        op.remaining = op.unsettled = len(lanes)
        return op

    def _launch(self, op: Op, jobs: Sequence[Job]) -> list[Action]:
        """Post one job per lane of ``op``; a lane that refuses answers at once."""
        self._ops[op.token] = op
        op.jobs = jobs
        if op.serial:
            self._serial = op
        actions: list[Action] = []
        if op.timeout_ms and not op.timer_started:
            actions.append(StartTimer(op.token, op.timeout_ms / 1000.0))
        for lane, job in zip(op.lanes, jobs, strict=True):
            self._outstanding += 1
            actions.append(Post(lane, job, op.serial))
        return actions

    def _deliver(self, token: int, reply: LaneReply) -> list[Action]:
        """Record one lane's answer; complete the op when it was the last one."""
        self._outstanding -= 1
        op = self._ops.get(token)
        if op is None or self._finished:
            return []
        pos = op.lanes.index(reply.lane) if len(op.lanes) > 1 else 0
        op.remaining -= 1
        if op.remaining == 0:
            del self._ops[token]
        if op.replies[pos] is not None:
            return []  # answered already (a wedged lane's step answered as a truncation)
        actions: list[Action] = []
        if reply.fault is not None:
            original = reply
            reply = self._faulted(op, pos, reply)
            if reply is not original and isinstance(original.outcome, outcome.Error):
                error, lanes = original.outcome.error, (reply.lane,)
                message = f"answered as a truncation: {reply.fault.error if reply.fault else ''}"
                verb, rid = op.verb, op.request_id
                actions.append(Report("truncated", verb, rid, lanes, Code.INTERNAL, message, error))
        self._settle(op, pos, reply)
        if op.unsettled == 0 and not op.timed_out:
            if op.timeout_ms:
                actions.append(CancelTimer(token))
            actions.extend(self._complete(op))
        return actions

    def _settle(self, op: Op, pos: int, reply: LaneReply) -> None:
        op.replies[pos] = reply
        op.unsettled -= 1
        if isinstance(reply.outcome, outcome.Value):
            self._account(op, pos, reply.outcome.value)

    # ----------------------------------------------------------------- lane faults

    def _faulted(self, op: Op, pos: int, reply: LaneReply) -> LaneReply:
        """A lane lost its env (policy ``rebuild``/``truncate``): a step is answered as a
        truncation (``truncate``, when the lane's last observation is known); otherwise
        the error stands and the lane's episode is reported interrupted (SPEC §7.7)."""
        assert reply.fault is not None
        if not op.timed_out and self._can_truncate(op, [pos]):
            return self._truncation(op, pos, reply.fault, reply.phases)
        self._book.fault(op.lanes[pos])
        return reply

    def _can_truncate(self, op: Op, positions: Sequence[int]) -> bool:
        if not self._truncate or op.verb != "step":
            return False
        book = self._book
        return all(book.last_observation(op.lanes[pos]) is not None for pos in positions)

    def _truncation(self, op: Op, pos: int, fault: LaneFault, phases: Phases) -> LaneReply:
        """The lane's step answered as a truncation of its last observation."""
        lane = op.lanes[pos]
        observation = self._book.last_observation(lane)
        assert observation is not None
        return truncation(op.token, lane, observation, fault, phases)

    # ----------------------------------------------------------------- requests

    def _start_reset(self, rid: str, body: env_v1.ResetRequest, read_ns: int) -> list[Action]:
        plan = plan_reset(body, self._n)
        if isinstance(plan, Refusal):
            return self._reject(rid, read_ns, plan.code, plan.message, True)
        t0 = self._clock_ns()
        options = from_meta_map(body.options) if body.options is not None else None
        op = self._new_op(rid, "reset", plan.lanes, plan.whole, read_ns, body.timeout_ms)
        op.seeds, op.episode_ids = plan.seeds, plan.episode_ids
        op.pre_decode_ns = self._clock_ns() - t0
        jobs = [
            ResetJob(seed=seed, options=dict(options) if options is not None else None, id=op.token)
            for seed in plan.seeds
        ]
        return self._launch(op, jobs)

    def _lane_step(
        self, rid: str, body: env_v1.StepRequest, lane: int, *, serial: bool
    ) -> list[Action]:
        """One lane's step, straight to its Post (:func:`~._straight.lane_step_op`)."""
        self._verb = "step"
        op, jobs = lane_step_op(next(self._tokens), rid, body, lane, serial, self._clock_ns())
        return self._launch(op, jobs)

    def _lane_step_done(self, op: Op, reply: LaneReply, result: StepResult) -> list[Action]:
        """A lane step's clean result, straight to its Send (what _deliver and _complete
        do for it); its episode accounts in the book, as _account keeps the general
        path's."""
        self._retire(op, 1)
        op.replies[0] = reply
        book = self._book
        ended = book.step(op.lanes[0], result)
        completed = book.take_interrupted()
        if ended is not None:
            completed.append(ended.record(result.info))
        phases = reply.phases
        return self._sent(
            op, self._replies.lane_step_response(op, result, phases, completed), phases
        )

    def _vector_step(self, rid: str, body: env_v1.StepRequest) -> list[Action]:
        """A whole-vector step of several lanes, straight to its Posts (what _pump and
        _start_step do for it, without the queue): every row validated, then one job per
        lane under one token (:func:`~._straight.vector_step_op`)."""
        read_ns = self._clock_ns()
        token = next(self._tokens)  # taken before the check, as the general path does
        self._verb = "step"
        assert body.action is not None
        leaves = list(body.action.leaves)
        t0 = self._clock_ns()
        try:
            self._endpoint.contract.action_codec.validate_action(leaves, self._n)
        except ActionError as exc:
            return self._reject(rid, read_ns, Code.INVALID_ACTION, str(exc), True)
        pre_decode_ns = self._clock_ns() - t0
        op, jobs = vector_step_op(
            token, rid, leaves, body.timeout_ms, self._n, read_ns, pre_decode_ns
        )
        return self._launch(op, jobs)

    def _vector_step_done(
        self, op: Op, replies: Sequence[LaneReply], results: list[StepResult]
    ) -> list[Action]:
        """A whole-vector step whose lanes all answered cleanly (``results``, lane
        order), straight to its Send (what _deliver, _settle and _complete do for it)."""
        self._retire(op, len(replies))
        ordered = op.replies
        for reply in replies:
            ordered[reply.lane] = reply
        book = self._book
        completions = op.completions
        for lane, result in enumerate(results):
            ended = book.step(lane, result)
            if ended is not None:
                completions[lane] = ended
        phases, skew = fold_phases([reply.phases for reply in ordered if reply is not None])
        interrupted = book.take_interrupted()
        response = self._replies.step_response(op, results, phases, skew, interrupted)
        return self._sent(op, response, phases)

    def _retire(self, op: Op, answered: int) -> None:
        """A straight line's op is answered: off the books, its barrier lifted."""
        self._outstanding -= answered
        del self._ops[op.token]
        if op.serial:
            self._serial = None
        op.unsettled = op.remaining = 0

    def _sent(self, op: Op, response: env_v1.JoinResponse, phases: Phases) -> list[Action]:
        """A straight line's answer: its timer cancelled, the Send, the metrics' Done."""
        actions: list[Action] = [CancelTimer(op.token)] if op.timeout_ms else []
        actions.append(Send(response))
        if self._observe:
            total = response.endpoint_total_ns or 0
            actions.append(Done(op.verb, tuple(op.lanes), total, phases.user_ns))
        return actions

    def _start_step(self, rid: str, body: env_v1.StepRequest, read_ns: int) -> list[Action]:
        plan = plan_step(body, self._n)
        if isinstance(plan, Refusal):
            return self._reject(rid, read_ns, plan.code, plan.message, True)
        lanes, leaves, k = plan.lanes, plan.leaves, len(plan.lanes)
        op = self._new_op(rid, "step", lanes, plan.whole, read_ns, body.timeout_ms)
        op.echo_indices = None if plan.whole else lanes
        if plan.validate:
            # Every row before any lane steps; one-lane requests validate on the lane thread.
            t0 = self._clock_ns()
            try:
                self._endpoint.contract.action_codec.validate_action(leaves, k)
            except ActionError as exc:
                return self._reject(rid, read_ns, Code.INVALID_ACTION, str(exc), True)
            op.pre_decode_ns = self._clock_ns() - t0
        jobs = [
            StepJob(leaves=leaves, n=k, row=row, validated=plan.validate, id=op.token)
            for row in range(k)
        ]
        return self._launch(op, jobs)

    def _start_render(self, rid: str, body: env_v1.RenderRequest, read_ns: int) -> list[Action]:
        plan = plan_render(body, self._n)
        if isinstance(plan, Refusal):
            return self._reject(rid, read_ns, plan.code, plan.message, True)
        op = self._new_op(rid, "render", [plan.lane], True, read_ns, body.timeout_ms)
        return self._launch(op, [RenderJob(id=op.token)])

    def _configure(self, rid: str, body: env_v1.ConfigureEnvRequest, read_ns: int) -> list[Action]:
        refusal = plan_configure(body, self._endpoint.edition)
        if refusal is not None:  # fatal: the stream ends
            actions = self._reject(rid, read_ns, refusal.code, refusal.message, False)
            return actions + self._end()
        response = env_v1.JoinResponse(
            request_id=rid,
            configure=env_v1.ConfigureEnvResponse(),
            endpoint_total_ns=self._replies.elapsed(read_ns),
        )
        return [Send(response)]

    def _close(self, rid: str, read_ns: int) -> list[Action]:
        final = self._book.close()
        response = env_v1.JoinResponse(
            request_id=rid,
            close=env_v1.CloseEnvsResponse(final_episodes=final),
            endpoint_total_ns=self._replies.elapsed(read_ns),
        )
        return [Send(response), *self._end()]

    # ----------------------------------------------------------------- results

    def _account(self, op: Op, pos: int, result: object) -> None:
        """One lane's successful result into the book, in lane order (SPEC §7.7)."""
        lane = op.lanes[pos]
        if isinstance(result, StepResult):
            ended = self._book.step(lane, result)
            if ended is not None:
                op.completions[pos] = ended
        elif isinstance(result, ResetResult):
            self._book.reset(lane, op.episode_ids[pos], op.seeds[pos], result.observation)

    def _complete(self, op: Op) -> list[Action]:
        if op.serial:
            self._serial = None
        replies = [r for r in op.replies if r is not None]
        for reply in replies:
            if isinstance(reply.outcome, outcome.Error):
                error = reply.outcome.error
                f = failure(op, reply, error, supervised=self._supervised)
                rid = op.request_id
                actions: list[Action] = [
                    self._replies.error(
                        rid, op.started_ns, f.code, f.message, f.recoverable, f.debug
                    ),
                    Report(f.kind, op.verb, rid, (reply.lane,), f.code, f.message, error),
                ]
                if not f.recoverable and op.serial:
                    actions.extend(self._end())
                return actions
        results = [r.outcome.unwrap() for r in replies]
        phases, skew = fold_phases([r.phases for r in replies])
        if op.verb == "render":
            response = self._replies.render_response(op, results[0], phases)
        elif op.verb == "reset":
            response = self._replies.reset_response(op, results, phases, skew)
        else:
            interrupted = self._book.take_interrupted()
            response = self._replies.step_response(op, results, phases, skew, interrupted)
        if not self._observe:
            return [Send(response)]
        total = response.endpoint_total_ns or 0
        return [Send(response), Done(op.verb, tuple(op.lanes), total, phases.user_ns)]

    # ----------------------------------------------------------------- helpers

    def _reject(
        self,
        rid: str,
        read_ns: int,
        code: env_v1.EnvErrorCode,
        message: str,
        recoverable: bool,
    ) -> list[Action]:
        """A request refused before any lane ran it: the error reply, and a report."""
        verb = self._verb
        return [
            self._replies.error(rid, read_ns, code, message, recoverable),
            Report("rejected", verb, rid, (), code, message),
        ]

    def _end(self) -> list[Action]:
        self._finish()
        return [EndStream()]

    def _finish(self) -> None:
        self._finished = True
        self._pending.clear()
        self._ops.clear()
        self._serial = None
        self._book.drop()
