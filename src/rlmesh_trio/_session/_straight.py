"""The straight lines of a step: what the session accepts without the general path of
its ops (:mod:`._join`).

A step that nothing holds back -- no request queued, no serial one running -- is posted
at once, from the same plan and op as any step (:func:`~._ops.step_op`), marked by its
``Op.path``: one lane's (``"lane"``: ``env_indices`` of one, or a one-lane endpoint's
whole-vector step), or a whole-vector one (``"vector"``: every lane, one job each under
one token, a barrier like any serial op). Its answer takes the straight line back when
every lane's result is clean: no fault, no error, no conformance warning; anything else
goes the general path, which answers it the same (a test compares the two, byte for
byte). Pure functions: which replies are clean.
"""

from __future__ import annotations

from collections.abc import Sequence

import outcome

from .._jobs import LaneReply, StepResult

__all__ = ["clean_step", "clean_steps"]


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
