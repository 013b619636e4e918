"""What a request asks of the lanes, or why it is refused before any lane runs it (SPEC
§7.2, §7.4-§7.6, §7.10, §7.11). Pure functions of the request and the number of lanes (a
step's also of the action codec, which checks its rows, and of the clock that times it):
the session turns a plan into jobs, a :class:`Refusal` into its error reply.

The texts and their order (which check speaks first) are the reference's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._codec import SpaceCodec
from .._errors import ActionError
from .._proto.rlmesh.env import v1 as env_v1
from ._edition import edition_matches, rust_debug_str

__all__ = [
    "Refusal",
    "RenderPlan",
    "ResetPlan",
    "StepPlan",
    "check_indices",
    "deadline_ms",
    "plan_configure",
    "plan_render",
    "plan_reset",
    "plan_step",
]

Code = env_v1.EnvErrorCode


@dataclass(frozen=True, slots=True)
class Refusal:
    """The request is refused before any lane runs it (a recoverable EnvError)."""

    code: env_v1.EnvErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class ResetPlan:
    """Reset ``lanes`` (in the reply's order); ``whole``: no ``env_indices``, a serial
    request. ``seeds`` and ``episode_ids`` are positional, one per lane (SPEC §7.6)."""

    lanes: list[int]
    whole: bool
    seeds: list[int | None]
    episode_ids: list[str]


@dataclass(slots=True)
class StepPlan:
    """Step ``lanes`` (in the reply's order) with the rows of ``leaves``; ``whole``: no
    ``env_indices``, a serial request. ``validate``: several rows, checked before any lane
    steps (a bad row must not leave the others half-stepped), which took
    ``pre_decode_ns``; one row is checked on its lane. Not frozen, as the other plans
    are, only because it is made for every step (a frozen dataclass's ``__init__`` pays a
    call per field); nothing changes it."""

    lanes: list[int]
    whole: bool
    leaves: list[bytes]
    validate: bool
    pre_decode_ns: int = 0


@dataclass(frozen=True, slots=True)
class RenderPlan:
    """Render ``lane``; one past the lanes is the lane engine's to refuse, as the
    reference's does (a fatal INTERNAL)."""

    lane: int


def deadline_ms(request: env_v1.JoinRequest) -> int:
    """The request's ``timeout_ms`` (0: none); only a reset, step or render has one
    (SPEC §7.11)."""
    # ``is not None``, not truthiness: betterproto2's __bool__ walks every field, and an
    # all-default message (``reset {}``) is falsy although it is set.
    body: env_v1.ResetRequest | env_v1.StepRequest | env_v1.RenderRequest | None
    if request.reset is not None:
        body = request.reset
    elif request.step is not None:
        body = request.step
    else:
        body = request.render
    return body.timeout_ms if body is not None else 0


def check_indices(prefix: str, indices: Sequence[int], num_envs: int) -> str | None:
    """Why ``indices`` name no set of lanes (past the lanes, or twice), or None."""
    seen: set[int] = set()
    for i in indices:
        if i >= num_envs:
            return f"{prefix}: env_index {i} out of range for num_envs {num_envs}"
        if i in seen:
            return f"{prefix}: duplicate env_index {i}"
        seen.add(i)
    return None


def plan_reset(body: env_v1.ResetRequest, num_envs: int) -> ResetPlan | Refusal:
    """A reset's lanes, seeds and episode ids; a partial reset's lists checked first,
    then its indices (the reference's order)."""
    # len() is the full length also of a list the decoder clipped (wire.Clipped).
    count = len(body.env_indices)
    if count:
        problem = None
        if body.seeds and len(body.seeds) != count:
            problem = (
                f"partial reset: seeds length {len(body.seeds)} does not match env_indices "
                f"length {count} (provide one seed per reset lane, or none)"
            )
        elif body.episode_ids and len(body.episode_ids) != count:
            problem = (
                f"partial reset: episode_ids length {len(body.episode_ids)} does not match "
                f"env_indices length {count} (provide one episode id per reset lane, "
                "or none)"
            )
        else:
            problem = check_indices("partial reset", body.env_indices, num_envs)
        if problem is not None:
            return Refusal(Code.INVALID_ACTION, problem)
        lanes = list(body.env_indices)
    else:
        lanes = list(range(num_envs))
    k = len(lanes)
    seeds = [body.seeds[i] if i < len(body.seeds) else None for i in range(k)]
    ids = [body.episode_ids[i] if i < len(body.episode_ids) else "" for i in range(k)]
    return ResetPlan(lanes=lanes, whole=not count, seeds=seeds, episode_ids=ids)


def plan_step(
    body: env_v1.StepRequest, num_envs: int, codec: SpaceCodec, clock_ns: Callable[[], int]
) -> StepPlan | Refusal:
    """A step's lanes and action rows, validated: a subset step's indices checked, then
    the action's presence, then -- several rows -- every row by ``codec`` (timed by
    ``clock_ns``). Every step path of the session takes its plan from here."""
    indices = list(body.env_indices)
    if indices:
        if len(indices) > 1 or indices[0] >= num_envs:  # one lane in range: nothing to check
            problem = check_indices("subset step", indices, num_envs)
            if problem is not None:
                return Refusal(Code.INVALID_ACTION, problem)
        lanes = indices
    else:
        lanes = list(range(num_envs))
    k = len(lanes)
    if body.action is None:
        return Refusal(Code.INVALID_ACTION, f"expected {k} actions, got 0")
    leaves = list(body.action.leaves)
    if k == 1:
        return StepPlan(lanes, not indices, leaves, False)
    t0 = clock_ns()
    try:
        codec.validate_action(leaves, k)
    except ActionError as exc:
        return Refusal(Code.INVALID_ACTION, str(exc))
    return StepPlan(lanes, not indices, leaves, True, clock_ns() - t0)


def plan_render(body: env_v1.RenderRequest, num_envs: int) -> RenderPlan | Refusal:
    """The lane a render asks for: at most one index, and only lane 0 renders
    (single-env render, SPEC §7.10)."""
    indices = list(body.env_indices)
    if len(indices) > 1:
        return Refusal(Code.UNSUPPORTED, "render requests support at most one env_index")
    lane = indices[0] if indices else 0
    # An index past the lanes fails like the reference, as a fatal INTERNAL from the lane
    # engine ("lane 3 out of range for 2 lanes"); only an existing lane other than 0 is
    # the recoverable "single-env render" refusal.
    if 0 < lane < num_envs:
        return Refusal(
            Code.INVALID_ACTION, f"single-env render only supports env_index 0, got {lane}"
        )
    return RenderPlan(lane)


def plan_configure(body: env_v1.ConfigureEnvRequest, implemented: str) -> Refusal | None:
    """Why a configure pins an edition this build does not implement, or None (SPEC
    §7.2; the session ends the stream after this refusal)."""
    edition = body.selected_workflow_edition
    if edition_matches(edition, implemented):
        return None
    return Refusal(
        Code.INVALID_ACTION,
        f"runtime pinned this env to workflow edition {rust_debug_str(edition)}, which "
        f'this env build does not implement (implements ["{implemented}"])',
    )
