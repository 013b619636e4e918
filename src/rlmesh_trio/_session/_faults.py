"""What a session answers for a lane job that failed (SPEC §9, docs/supervision.md): the
error reply's code, text and debug info, what the log calls it, and -- policy
``truncate`` -- a faulted step answered as a truncation. Pure functions of the request's
record and its lanes' replies."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import outcome

from .._codec import to_meta_map
from .._errors import (
    LaneClosedError,
    LaneDeadError,
    LaneNeedsResetError,
    LaneWedgedError,
    env_error,
)
from .._jobs import LaneFault, LaneReply, Phases, StepResult
from .._proto.rlmesh.env import v1 as env_v1
from ._episodes import EpisodeBook
from ._ops import Op
from ._results import LANE_FAULT_KEY

__all__ = [
    "Failure",
    "can_truncate",
    "crash_debug",
    "crash_message",
    "failure",
    "truncated",
    "truncation",
]

Code = env_v1.EnvErrorCode


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed request's EnvError, and ``kind``, what the log's Report calls it:
    ``"rejected"`` (an invalid action), ``"refused"`` (the lane took no job: no env code
    ran) or ``"fault"``."""

    code: env_v1.EnvErrorCode
    message: str
    recoverable: bool
    debug: str
    kind: str


def failure(op: Op, reply: LaneReply, error: BaseException, *, supervised: bool) -> Failure:
    """The answer to ``op`` when lane ``reply.lane`` failed with ``error``. ``supervised``
    (policy ``rebuild``/``truncate``): a faulted lane's error is CRASHED, recoverable."""
    code, message, recoverable = env_error(op.verb, error)
    debug = ""
    if supervised and reply.fault is not None:
        if not isinstance(error, LaneNeedsResetError):
            code, recoverable = Code.CRASHED, True
            message = crash_message(op, reply.lane, message)
        debug = crash_debug(op)
    elif code == Code.CRASHED:
        debug = crash_debug(op)
    if code == Code.INVALID_ACTION:
        kind = "rejected"
    elif isinstance(error, (LaneDeadError, LaneWedgedError, LaneClosedError)):
        kind = "refused"
    else:
        kind = "fault"
    return Failure(code, message, recoverable, debug, kind)


def crash_message(op: Op, lane: int, base: str) -> str:
    """Policy ``rebuild``/``truncate``: a faulted lane's request (docs/supervision.md):
    ``base`` (what policy ``error`` answers) and that the lane needs a reset."""
    others = op.verb == "step" and len(op.lanes) > 1
    return (
        f"{base} (lane {lane} faulted and was rebuilt: reset it to go on"
        f"{'; the other lanes of this request stepped, their results are dropped' if others else ''})"
    )


def crash_debug(op: Op) -> str:
    """``EnvError.debug_info`` of a CRASHED reply: every faulted lane of ``op``, as
    ``{"rlmesh_trio.lane_fault": [{"error": ..., "lane": i, "rebuilt": true}, ...]}``
    (a lane still being rebuilt: ``"rebuilt": false``), so that a client can tell
    which lanes need a reset."""
    faults: list[dict[str, Any]] = []
    for reply in op.replies:
        if reply is None or not isinstance(reply.outcome, outcome.Error):
            continue
        if reply.fault is not None:
            faults.append(reply.fault.info())
        elif env_error(op.verb, reply.outcome.error)[0] == Code.CRASHED:
            cause = str(reply.outcome.error)
            faults.append({"error": cause, "lane": reply.lane, "rebuilt": False})
    return json.dumps({LANE_FAULT_KEY: faults}, sort_keys=True)


def truncation(
    token: int, lane: int, observation: list[bytes], fault: LaneFault, phases: Phases
) -> LaneReply:
    """Lane ``lane``'s step answered as a truncation: its last observation, reward 0, and
    ``rlmesh_trio.lane_fault`` in its info (so in the episode's ``final_info``)."""
    result = StepResult(
        observation=observation,
        reward=0.0,
        terminated=False,
        truncated=True,
        info=to_meta_map({LANE_FAULT_KEY: fault.info()}),
        action_warning=None,
        obs_warning=None,
    )
    return LaneReply(token, lane, outcome.Value(result), phases, fault)


def can_truncate(op: Op, positions: Sequence[int], book: EpisodeBook) -> bool:
    """Policy ``truncate``: whether ``op``'s lanes at ``positions`` may be answered as
    truncations (a step, each lane's last observation known)."""
    if op.verb != "step":
        return False
    return all(book.last_observation(op.lanes[pos]) is not None for pos in positions)


def truncated(op: Op, pos: int, book: EpisodeBook, fault: LaneFault, phases: Phases) -> LaneReply:
    """The step of ``op``'s lane at ``pos`` answered as a truncation of its last
    observation (:func:`can_truncate` said it may be)."""
    lane = op.lanes[pos]
    observation = book.last_observation(lane)
    assert observation is not None
    return truncation(op.token, lane, observation, fault, phases)
