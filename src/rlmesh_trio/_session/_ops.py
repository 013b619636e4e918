"""The session's scheduler (SPEC §7.4): the records of its requests -- one waiting its turn
(:class:`Waiting`), one whose lane jobs are out (:class:`Op`) -- and :class:`OpBook`, which
keeps them: the queue, the ops in flight, the serial barrier, the lane jobs outstanding and
the job ids. Sans-IO; :mod:`._join` (the session) drives the book, :mod:`._replies` (what
it sends) reads the ops."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import betterproto2

from .._jobs import Job, LaneReply, StepJob
from .._proto.rlmesh.env import v1 as env_v1
from ._actions import Action, Post, StartTimer
from ._episodes import Ended
from ._plan import StepPlan

__all__ = ["Op", "OpBook", "Path", "Waiting", "new_op", "step_op"]

Path = Literal["general", "lane", "vector"]
"""How an op is answered: ``"general"``, each reply through the general path; a step
posted by a straight line (:mod:`._straight`), answered there when its results are clean:
``"lane"``, one lane's (or a one-lane endpoint's whole-vector step), ``"vector"``, a
whole-vector step of several lanes."""


@dataclass
class Waiting:
    """A request read from the stream and not dispatched yet."""

    request: env_v1.JoinRequest
    read_ns: int
    token: int
    timeout_ms: int
    timer_started: bool = False
    close_wait: bool = False  # a Close waiting for lane jobs, with its own bound


@dataclass(slots=True)
class Op:
    """A reset, step or render whose lane jobs are out."""

    token: int
    request_id: str
    verb: str  # "reset" | "step" | "render"
    lanes: list[int]
    serial: bool
    started_ns: int
    echo_indices: list[int] | None = None
    seeds: list[int | None] = field(default_factory=list)
    episode_ids: list[str] = field(default_factory=list)
    pre_decode_ns: int = 0
    jobs: Sequence[Job] = ()
    replies: list[LaneReply | None] = field(default_factory=list)
    remaining: int = 0  # lane replies still to come
    unsettled: int = 0  # positions without an answer (a synthesized one counts)
    timeout_ms: int = 0
    timer_started: bool = False  # the deadline started while the request waited
    timed_out: bool = False
    # lane position -> the episode this op's step ended on that lane (from the book)
    completions: dict[int, Ended] = field(default_factory=dict)
    path: Path = "general"


def new_op(entry: Waiting, verb: str, lanes: list[int], serial: bool, timeout_ms: int) -> Op:
    """The op of ``entry``'s reset or render, each of its ``lanes`` still to answer."""
    k = len(lanes)
    return Op(
        token=entry.token,
        request_id=entry.request.request_id,
        verb=verb,
        lanes=lanes,
        serial=serial,
        started_ns=entry.read_ns,
        timeout_ms=timeout_ms,
        timer_started=entry.timer_started,
        replies=[None] * k,
        remaining=k,
        unsettled=k,
    )


def step_op(
    token: int,
    rid: str,
    plan: StepPlan,
    timeout_ms: int,
    read_ns: int,
    timer_started: bool,
    path: Path,
) -> tuple[Op, list[StepJob]]:
    """A step's op and its jobs, one per lane of ``plan``, under one token (every step
    path's: the general one and both straight lines). A whole-vector step echoes no
    lanes and is serial (a barrier)."""
    lanes, leaves, k = plan.lanes, plan.leaves, len(plan.lanes)
    op = Op(
        token=token,
        request_id=rid,
        verb="step",
        lanes=lanes,
        serial=plan.whole,
        started_ns=read_ns,
        echo_indices=None if plan.whole else lanes,
        pre_decode_ns=plan.pre_decode_ns,
        timeout_ms=timeout_ms,
        timer_started=timer_started,
        replies=[None] * k,
        remaining=k,
        unsettled=k,
        path=path,
    )
    validated = plan.validate
    if k == 1:
        return op, [StepJob(leaves=leaves, n=1, row=0, validated=validated, id=token)]
    return op, [
        StepJob(leaves=leaves, n=k, row=row, validated=validated, id=token) for row in range(k)
    ]


class OpBook:
    """One Join's scheduler state, written only here (the session reads it).

    ``pending``: the requests read and not dispatched, in order; ``ops``: the requests whose
    lane jobs are out, by token (a timed-out one stays until its lanes answer); ``serial``:
    the serial op running, a barrier to every later request; ``outstanding``: lane jobs
    posted and not answered yet (timed-out ones too), a barrier to the next serial request;
    ``tokens``: the job ids, unique over the endpoint's sessions. An op is launched (its
    jobs posted), its lanes' replies delivered one by one, and it is completed by the
    general path or retired at once by a straight line.
    """

    __slots__ = ("ops", "outstanding", "pending", "serial", "tokens")

    def __init__(self, tokens: Iterator[int]) -> None:
        self.pending: deque[Waiting] = deque()
        self.ops: dict[int, Op] = {}
        self.serial: Op | None = None
        self.outstanding = 0
        self.tokens = tokens

    def wait(self, request: env_v1.JoinRequest, read_ns: int, timeout_ms: int) -> Waiting:
        """``request`` joins the queue, with a token of its own."""
        entry = Waiting(request, read_ns, next(self.tokens), timeout_ms)
        self.pending.append(entry)
        return entry

    def turn(self, close_timeout: float, actions: list[Action]) -> tuple[Waiting, str, Any] | None:
        """The request whose turn it is, off the queue, with its kind and body; None while
        none may go: the queue is empty, a serial op runs, or the head is serial and lane
        jobs are out (the barrier; a Close waits at most ``close_timeout``, its timer
        appended to ``actions``, since an env call may never return)."""
        if not self.pending or self.serial is not None:
            return None
        entry = self.pending[0]
        kind, body = betterproto2.which_one_of(entry.request, "kind")
        lane_scoped = kind in ("reset", "step") and bool(body.env_indices)  # type: ignore[union-attr]
        if not lane_scoped and self.outstanding:
            if kind == "close" and not entry.timer_started:
                entry.timer_started = entry.close_wait = True
                actions.append(StartTimer(entry.token, close_timeout))
            return None
        self.pending.popleft()
        return entry, kind, body

    def unqueue(self, token: int) -> Waiting | None:
        """The request waiting under ``token``, off the queue (its time ran out)."""
        for entry in self.pending:
            if entry.token == token:
                self.pending.remove(entry)
                return entry
        return None

    def launch(self, op: Op, jobs: Sequence[Job]) -> list[Action]:
        """``op`` in flight: its deadline started (unless it started while it waited), one
        job posted per lane; a lane that refuses answers at once."""
        self.ops[op.token] = op
        op.jobs = jobs
        if op.serial:
            self.serial = op
        actions: list[Action] = []
        if op.timeout_ms and not op.timer_started:
            actions.append(StartTimer(op.token, op.timeout_ms / 1000.0))
        for lane, job in zip(op.lanes, jobs, strict=True):
            self.outstanding += 1
            actions.append(Post(lane, job, op.serial))
        return actions

    def deliver(self, token: int) -> Op | None:
        """A lane answered job ``token``: its op (None once answered and gone), off the
        book with its last lane's reply."""
        self.outstanding -= 1
        op = self.ops.get(token)
        if op is None:
            return None
        op.remaining -= 1
        if op.remaining == 0:
            del self.ops[token]
        return op

    def release(self, op: Op) -> None:
        """``op`` is answered (or its deadline was): a serial one lifts its barrier; the
        env calls it posted still count as outstanding until they return."""
        if op.serial:
            self.serial = None

    def retire(self, op: Op, answered: int) -> None:
        """A straight line's op is answered by its ``answered`` lanes at once: off the
        book, its barrier lifted."""
        self.outstanding -= answered
        del self.ops[op.token]
        if op.serial:
            self.serial = None
        op.unsettled = op.remaining = 0

    def answered(self) -> bool:
        """No request waits and each one dispatched has its reply (a timed-out one was
        answered; its env call may still run)."""
        return not self.pending and all(op.timed_out for op in self.ops.values())

    def busy_lanes(self) -> list[int]:
        """The lanes whose env calls are still running, in order."""
        return sorted(
            {
                op.lanes[pos]
                for op in self.ops.values()
                for pos, r in enumerate(op.replies)
                if r is None
            }
        )

    def clear(self) -> None:
        """The stream ended: nothing waits, nothing is in flight (lane jobs still running
        stay outstanding: their replies are still delivered)."""
        self.pending.clear()
        self.ops.clear()
        self.serial = None
