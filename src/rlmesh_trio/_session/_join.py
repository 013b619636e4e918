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

Its scheduler's state (the queue, the ops in flight, the barriers, the job ids) is an
:class:`~._ops.OpBook`, its episodes an :class:`~._episodes.EpisodeBook`.

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
from collections.abc import Callable, Sequence
from typing import Any

import betterproto2
import outcome

from .._codec import from_meta_map
from .._jobs import LaneFault, LaneReply, Phases, RenderJob, ResetJob, ResetResult, StepResult
from .._proto.rlmesh.env import v1 as env_v1
from ._actions import Action, CancelTimer, Done, EndStream, Report, Send, StartTimer, Wedged
from ._endpoint import Endpoint
from ._episodes import EpisodeBook
from ._faults import can_truncate, failure, truncated
from ._ops import Op, OpBook, Path, Waiting, new_op, step_op
from ._plan import Refusal, deadline_ms, plan_configure, plan_render, plan_reset, plan_step
from ._replies import Replies
from ._results import fold_phases
from ._straight import clean_step, clean_steps

_UNRECOGNIZED = (
    "empty or unrecognized Join request (a newer-edition arm this build does not implement?)"
)

Code = env_v1.EnvErrorCode


# --------------------------------------------------------------------------- session


class Session:
    """One Join stream's state (SPEC §7). Not thread-safe: transport loop only."""

    straight_line = True
    """A step that nothing holds back takes a straight line: one lane's (``Op.path``
    ``"lane"``, answered by :meth:`_lane_step_done`) or a whole-vector one
    (``"vector"``, :meth:`_vector_step_done`); False sends them through the general
    queue and op machinery (the tests compare the two)."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        wall_ns: Callable[[], int] = time.time_ns,
        observe: bool = False,
    ) -> None:
        self._endpoint = endpoint
        self._codec = endpoint.contract.action_codec
        self._observe = observe
        self._clock_ns = clock_ns
        self._replies = Replies(endpoint, clock_ns)
        self._n = endpoint.num_envs
        self._ops = OpBook(endpoint.tokens)  # tokens unique over the endpoint's sessions
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
        ops = self._ops
        if step is not None and self.straight_line and not ops.pending and ops.serial is None:
            # The hot path: one lane's step, which nothing holds back (no request is
            # queued, no serial one runs): posted at once, as _pump would post it. A
            # whole-vector step is one too once every lane job is answered (its barrier),
            # and stays serial; on a one-lane endpoint (rlmesh.run's at N = 1) it is
            # answered as one lane's.
            indices = step.env_indices
            if len(indices) == 1:
                rid, token = request.request_id, next(ops.tokens)
                return self._step(rid, step, self._clock_ns(), token, False, "lane")
            if not indices and not ops.outstanding:
                rid, token = request.request_id, next(ops.tokens)
                path: Path = "lane" if self._n == 1 else "vector"
                return self._step(rid, step, self._clock_ns(), token, False, path)
        timeout_ms = deadline_ms(request)
        entry = ops.wait(request, self._clock_ns(), timeout_ms)
        actions = self._pump()
        if timeout_ms and ops.pending and ops.pending[-1] is entry:
            # Held behind a serial request: its deadline runs from now all the same, so
            # a request queued behind a wedged env still gets its TIMEOUT reply in time.
            entry.timer_started = True
            actions.append(StartTimer(entry.token, timeout_ms / 1000.0))
        return actions

    def on_lane_reply(self, reply: LaneReply) -> list[Action]:
        op = self._ops.ops.get(reply.job_id)
        if op is not None and op.path == "lane" and self._straight(op):
            result = clean_step(reply)
            if result is not None:
                return self._then(self._lane_step_done(op, reply, result))
        return self._then(self._deliver(reply.job_id, reply))

    def on_lane_replies(self, replies: Sequence[LaneReply]) -> list[Action]:
        """Every lane of one job answered (``replies``, one per lane, in any order): a
        whole-vector step whose lanes all stepped cleanly completes on the straight line;
        anything else is each reply's :meth:`on_lane_reply` in turn."""
        op = self._ops.ops.get(replies[0].job_id) if replies else None
        if (
            op is not None
            and op.path == "vector"
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
        if self._ops.pending:
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
        if self._finished or not self._ops.answered():
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
        op = self._ops.ops.get(token)
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
        if self._truncate and can_truncate(op, missing, self._book):
            # Policy ``truncate``: the wedged lanes' steps are answered as truncations, the
            # others' as they answered; the request completes now.
            for pos in missing:
                fault = LaneFault(lane=op.lanes[pos], error=f"TimeoutError: {message}")
                self._settle(op, pos, truncated(op, pos, self._book, fault, Phases()))
            actions.append(Report("timeout", op.verb, op.request_id, lanes, Code.TIMEOUT, message))
            actions.extend(self._complete(op))
            actions.extend(self._pump())
            return actions
        report = Report(
            "timeout", op.verb, op.request_id, lanes or tuple(op.lanes), Code.TIMEOUT, message
        )
        actions += self._replies.errored(report, op.started_ns)
        if op.serial:
            # The reply is out, so the next request may be read; the barrier still waits
            # for the env call itself (``outstanding``) before another serial op runs.
            self._ops.release(op)
            actions.extend(self._pump())
        return actions

    def _expire_waiting(self, token: int) -> list[Action]:
        """A request still waiting for its turn ran out of time: answer, never run it."""
        entry = self._ops.unqueue(token)
        if entry is None:
            return []
        if entry.close_wait:
            return self._close_anyway(entry)
        verb = betterproto2.which_one_of(entry.request, "kind")[0]
        message = f"env.{verb} timed out after {entry.timeout_ms}ms"
        report = Report("timeout", verb, entry.request.request_id, (), Code.TIMEOUT, message)
        return self._replies.errored(report, entry.read_ns)

    def _close_anyway(self, entry: Waiting) -> list[Action]:
        """A Close waited ``close_timeout`` for lane jobs still running: answer it without
        them (their lanes are named in the log) and end the stream."""
        busy = self._ops.busy_lanes()
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
        ops = self._ops
        return bool(ops.pending or ops.ops or ops.outstanding)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def backlog(self) -> int:
        """Requests read and not answered yet (queued, in flight, or timed out and still
        running); the driver stops reading past a bound (back-pressure)."""
        ops = self._ops
        return len(ops.pending) + len(ops.ops)

    # ----------------------------------------------------------------- scheduling

    def _pump(self) -> list[Action]:
        """Dispatch every request whose turn it is (:meth:`~._ops.OpBook.turn`)."""
        actions: list[Action] = []
        ops, close_timeout = self._ops, self._endpoint.close_timeout
        while not self._finished and (turn := ops.turn(close_timeout, actions)) is not None:
            entry, kind, body = turn
            actions.extend(self._dispatch(entry, kind, body))
            if entry.timer_started and entry.token not in ops.ops:
                actions.append(CancelTimer(entry.token))  # answered at once after all
        return actions

    def _dispatch(self, entry: Waiting, kind: str, body: Any) -> list[Action]:
        rid, read_ns = entry.request.request_id, entry.read_ns
        if kind == "reset":
            return self._start_reset(entry, rid, body)
        if kind == "step":
            return self._step(rid, body, read_ns, entry.token, entry.timer_started, "general")
        if kind == "render":
            return self._start_render(entry, rid, body)
        if kind == "configure":
            return self._configure(rid, body, read_ns)
        if kind == "close":
            return self._close(rid, read_ns)
        return self._reject(kind or "unknown", rid, read_ns, Code.UNSUPPORTED, _UNRECOGNIZED)

    def _deliver(self, token: int, reply: LaneReply) -> list[Action]:
        """Record one lane's answer; complete the op when it was the last one."""
        op = self._ops.deliver(token)
        if op is None or self._finished:
            return []
        pos = op.lanes.index(reply.lane) if len(op.lanes) > 1 else 0
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
        """One lane's answer into ``op``; a successful one into the book, in lane order
        (SPEC §7.7)."""
        op.replies[pos] = reply
        op.unsettled -= 1
        if isinstance(reply.outcome, outcome.Value):
            result, lane = reply.outcome.value, op.lanes[pos]
            if isinstance(result, StepResult):
                ended = self._book.step(lane, result)
                if ended is not None:
                    op.completions[pos] = ended
            elif isinstance(result, ResetResult):
                self._book.reset(lane, op.episode_ids[pos], op.seeds[pos], result.observation)

    # ----------------------------------------------------------------- lane faults

    def _faulted(self, op: Op, pos: int, reply: LaneReply) -> LaneReply:
        """A lane lost its env (policy ``rebuild``/``truncate``): a step is answered as a
        truncation (``truncate``, when the lane's last observation is known); otherwise
        the error stands and the lane's episode is reported interrupted (SPEC §7.7)."""
        assert reply.fault is not None
        if not op.timed_out and self._truncate and can_truncate(op, [pos], self._book):
            return truncated(op, pos, self._book, reply.fault, reply.phases)
        self._book.fault(op.lanes[pos])
        return reply

    # ----------------------------------------------------------------- requests

    def _start_reset(self, entry: Waiting, rid: str, body: env_v1.ResetRequest) -> list[Action]:
        plan = plan_reset(body, self._n)
        if isinstance(plan, Refusal):
            return self._reject("reset", rid, entry.read_ns, plan.code, plan.message)
        t0 = self._clock_ns()
        options = from_meta_map(body.options) if body.options is not None else None
        op = new_op(entry, "reset", plan.lanes, plan.whole, body.timeout_ms)
        op.seeds, op.episode_ids = plan.seeds, plan.episode_ids
        op.pre_decode_ns = self._clock_ns() - t0
        jobs = [
            ResetJob(seed=seed, options=dict(options) if options is not None else None, id=op.token)
            for seed in plan.seeds
        ]
        return self._ops.launch(op, jobs)

    def _step(
        self,
        rid: str,
        body: env_v1.StepRequest,
        read_ns: int,
        token: int,
        timer_started: bool,
        path: Path,
    ) -> list[Action]:
        """A step, every path's: its validated plan (:func:`~._plan.plan_step`), then its
        op and jobs under ``token`` (:func:`~._ops.step_op`), posted."""
        plan = plan_step(body, self._n, self._codec, self._clock_ns)
        if isinstance(plan, Refusal):
            return self._reject("step", rid, read_ns, plan.code, plan.message)
        op, jobs = step_op(token, rid, plan, body.timeout_ms, read_ns, timer_started, path)
        return self._ops.launch(op, jobs)

    def _lane_step_done(self, op: Op, reply: LaneReply, result: StepResult) -> list[Action]:
        """A lane step's clean result, straight to its Send (what _deliver and _complete
        do for it); its episode accounts in the book, as _settle keeps the general
        path's."""
        self._ops.retire(op, 1)
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

    def _vector_step_done(
        self, op: Op, replies: Sequence[LaneReply], results: list[StepResult]
    ) -> list[Action]:
        """A whole-vector step whose lanes all answered cleanly (``results``, lane
        order), straight to its Send (what _deliver, _settle and _complete do for it)."""
        self._ops.retire(op, len(replies))
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

    def _sent(self, op: Op, response: env_v1.JoinResponse, phases: Phases) -> list[Action]:
        """A straight line's answer: its timer cancelled, the Send, the metrics' Done."""
        actions: list[Action] = [CancelTimer(op.token)] if op.timeout_ms else []
        actions.append(Send(response))
        if self._observe:
            total = response.endpoint_total_ns or 0
            actions.append(Done(op.verb, tuple(op.lanes), total, phases.user_ns))
        return actions

    def _start_render(self, entry: Waiting, rid: str, body: env_v1.RenderRequest) -> list[Action]:
        plan = plan_render(body, self._n)
        if isinstance(plan, Refusal):
            return self._reject("render", rid, entry.read_ns, plan.code, plan.message)
        op = new_op(entry, "render", [plan.lane], True, body.timeout_ms)
        return self._ops.launch(op, [RenderJob(id=op.token)])

    def _configure(self, rid: str, body: env_v1.ConfigureEnvRequest, read_ns: int) -> list[Action]:
        refusal = plan_configure(body, self._endpoint.edition)
        if refusal is not None:  # fatal: the stream ends
            code, message = refusal.code, refusal.message
            return self._reject("configure", rid, read_ns, code, message, False) + self._end()
        return [Send(self._replies.configured(rid, read_ns))]

    def _close(self, rid: str, read_ns: int) -> list[Action]:
        return [Send(self._replies.closed(rid, read_ns, self._book.close())), *self._end()]

    # ----------------------------------------------------------------- results

    def _complete(self, op: Op) -> list[Action]:
        self._ops.release(op)
        replies = [r for r in op.replies if r is not None]
        for reply in replies:
            if isinstance(reply.outcome, outcome.Error):
                error = reply.outcome.error
                f = failure(op, reply, error, supervised=self._supervised)
                lanes = (reply.lane,)
                report = Report(f.kind, op.verb, op.request_id, lanes, f.code, f.message, error)
                actions = self._replies.errored(report, op.started_ns, f.recoverable, f.debug)
                if not f.recoverable and op.serial:
                    actions.extend(self._end())
                return actions
        response, phases = self._replies.completed(op, replies, self._book)
        if not self._observe:
            return [Send(response)]
        total = response.endpoint_total_ns or 0
        return [Send(response), Done(op.verb, tuple(op.lanes), total, phases.user_ns)]

    # ----------------------------------------------------------------- helpers

    def _reject(
        self, verb: str, rid: str, read_ns: int, code: Code, message: str, recoverable: bool = True
    ) -> list[Action]:
        """Request ``verb`` refused before any lane ran it: the error reply, and a report."""
        report = Report("rejected", verb, rid, (), code, message)
        return self._replies.errored(report, read_ns, recoverable)

    def _end(self) -> list[Action]:
        self._finish()
        return [EndStream()]

    def _finish(self) -> None:
        self._finished = True
        self._ops.clear()
        self._book.drop()
