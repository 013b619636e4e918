"""The straight lines of a step: what the session posts and accepts without its request
queue and the general path of its ops (:mod:`._join`).

A step that nothing holds back -- no request queued, no serial one running -- is posted
at once: one lane's (``env_indices`` of one), or a whole-vector one (every lane, one job
each under one token, a barrier like any serial op). Its answer takes the straight line
back when every lane's result is clean: no fault, no error, no conformance warning;
anything else goes the general path, which answers it the same (a test compares the two,
byte for byte). Pure functions: the ops and jobs to post, and which replies are clean.
"""

from __future__ import annotations

from collections.abc import Sequence

import outcome

from .._jobs import LaneReply, StepJob, StepResult
from .._proto.rlmesh.env import v1 as env_v1
from ._ops import Op

__all__ = ["clean_step", "clean_steps", "lane_step_op", "vector_step_op"]


def lane_step_op(
    token: int, rid: str, body: env_v1.StepRequest, lane: int, serial: bool, read_ns: int
) -> tuple[Op, list[StepJob]]:
    """One lane's step and its job (the lane validates the action, SPEC §3.6). ``serial``:
    a whole-vector step of a one-lane endpoint (no lanes echoed; a barrier)."""
    assert body.action is not None
    op = Op(
        token=token,
        request_id=rid,
        verb="step",
        lanes=[lane],
        serial=serial,
        started_ns=read_ns,
        echo_indices=None if serial else [lane],
        timeout_ms=body.timeout_ms,
        replies=[None],
        remaining=1,
        unsettled=1,
        lane_step=True,
    )
    return op, [StepJob(leaves=list(body.action.leaves), n=1, row=0, validated=False, id=token)]


def vector_step_op(
    token: int,
    rid: str,
    leaves: list[bytes],
    timeout_ms: int,
    n: int,
    read_ns: int,
    pre_decode_ns: int,
) -> tuple[Op, list[StepJob]]:
    """A whole-vector step of ``n`` lanes whose ``leaves`` were validated, row by row,
    and its jobs: one per lane, under one token, serial."""
    lanes = list(range(n))
    op = Op(
        token=token,
        request_id=rid,
        verb="step",
        lanes=lanes,
        serial=True,
        started_ns=read_ns,
        timeout_ms=timeout_ms,
        pre_decode_ns=pre_decode_ns,
        replies=[None] * n,
        remaining=n,
        unsettled=n,
        vector_step=True,
    )
    return op, [StepJob(leaves=leaves, n=n, row=row, validated=True, id=token) for row in lanes]


def clean_step(reply: LaneReply) -> StepResult | None:
    """The step's result when the lane answered cleanly (no fault, no error, no
    warning); None sends the reply the general path."""
    if reply.fault is not None or type(reply.outcome) is not outcome.Value:
        return None
    result = reply.outcome.value
    if type(result) is not StepResult or (
        result.action_warning is not None or result.obs_warning is not None
    ):
        return None
    return result


def clean_steps(replies: Sequence[LaneReply], n: int) -> list[StepResult] | None:
    """Every lane's clean result, in lane order, when ``replies`` (``n`` of them, the
    caller checked) are one clean answer from each of ``n`` lanes; else None."""
    results: list[StepResult | None] = [None] * n
    for reply in replies:
        result = clean_step(reply)
        if result is None or results[reply.lane] is not None:
            return None
        results[reply.lane] = result
    return results  # type: ignore[return-value]  # n replies, no lane twice: all filled
