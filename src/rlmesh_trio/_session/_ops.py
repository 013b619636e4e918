"""The records a session keeps of its requests: one waiting its turn, one whose lane jobs
are out. Plain data; :mod:`._join` (the session) and :mod:`._replies` (what it sends)
read and write them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .._jobs import Job, LaneReply
from .._proto.rlmesh.env import v1 as env_v1
from ._episodes import Ended

__all__ = ["Op", "Waiting"]


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
    lane_step: bool = False  # one lane's step, posted and answered by the straight line
    vector_step: bool = False  # a whole-vector step, posted by the straight line
