"""Commands a lane executes, and what it sends back.

These small frozen dataclasses are the whole vocabulary between the session (which
decides what to run where) and the lane engine (which runs it on the lane's own
thread). A job carries an ``id``, not a callback: whoever posts it gives the engine the
``reply`` callable, and the :class:`LaneReply` names the job it answers. They carry wire-level data in (action leaves, seed, options) and wire-ready
data out (observation leaves, an info ``MetaMap``), because decoding and encoding run
on the lane thread, where the reference measures them too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import gymnasium as gym
    import outcome

    from ._codec import Candidate, SpaceCodec
    from ._proto.rlmesh.spaces.v1 import MetaMap


@dataclass(frozen=True, slots=True)
class Phases:
    """Where one job's time went, in nanoseconds (SPEC §8)."""

    queue_ns: int = 0
    """Time the job waited in the lane's mailbox before the lane picked it up."""
    decode_ns: int = 0
    """Wire action to env value (0 for reset/render)."""
    user_ns: int = 0
    """Time inside the env call (reset/step/render/close)."""
    encode_ns: int = 0
    """Env result to wire form (observation leaves, info MetaMap, PNG)."""


@dataclass(frozen=True, slots=True)
class LaneReply:
    """The answer to one job, handed to the ``reply`` callback it was posted with.

    ``job_id`` is the job's ``id`` (the session's token for the request it serves);
    ``lane`` the lane that answered.

    ``outcome`` holds the job's result or the exception it raised (with its
    traceback): an env exception, a :class:`~rlmesh_trio._errors.ActionError` from
    action validation, a ``ValueError``/``TypeError`` from encoding the env's result,
    a :class:`~rlmesh_trio._errors.PolicyViolation` under the strict policy, or a
    :class:`~rlmesh_trio._errors.LaneBrokenError` when the lane died before answering.
    """

    job_id: int
    lane: int
    outcome: outcome.Outcome[Any]
    phases: Phases
    fault: LaneFault | None = None
    """Set (fault policy ``rebuild``/``truncate`` only) when this job's lane lost its env:
    the job faulted or wedged and the lane is being rebuilt, or the job found the lane
    rebuilt and not reset since. The lane's episode, if any, is over."""


@dataclass(frozen=True, slots=True)
class LaneFault:
    """What happened to a lane, as ``rlmesh_trio.lane_fault`` reports it on the wire."""

    lane: int
    error: str
    """``"<Type>: <message>"`` of the env's exception, or of the timeout."""
    rebuilt: bool = True
    """The lane's env was (being) replaced by a fresh one from the factory."""

    def info(self) -> dict[str, Any]:
        """The value of ``rlmesh_trio.lane_fault`` in a truncated step's info."""
        return {"error": self.error, "lane": self.lane, "rebuilt": self.rebuilt}


ReplyFn = Callable[[LaneReply], None]
"""Called exactly once per posted job, from whatever thread finished it. Must not block."""


@dataclass(frozen=True, slots=True)
class ResetJob:
    """``env.reset(seed=seed, options=options)``; result: :class:`ResetResult`."""

    seed: int | None
    options: dict[str, Any] | None
    id: int = 0


@dataclass(frozen=True, slots=True)
class StepJob:
    """Decode this lane's row of the action, check it, ``env.step`` it; result: :class:`StepResult`.

    ``leaves`` is the request's whole action (``n`` lanes), this lane's row is ``row``.
    When ``validated`` is false the lane runs the full validation of SPEC §3.6 itself
    (the one-lane case); when true the session already validated all ``n`` rows before
    any lane was stepped, so a bad row in lane 2 cannot leave lane 0 half-stepped.
    """

    leaves: Sequence[bytes]
    n: int
    row: int
    validated: bool
    id: int = 0


@dataclass(frozen=True, slots=True)
class RenderJob:
    """``env.render()`` encoded as PNG; result: :class:`RenderResult`."""

    id: int = 0


@dataclass(frozen=True, slots=True)
class CallJob:
    """Run ``fn(env)`` on the lane thread; result: whatever ``fn`` returns.

    For diagnostics, tests and extensions; user time is the whole call.
    """

    fn: Callable[[gym.Env[Any, Any]], Any]
    id: int = 0


Job = ResetJob | StepJob | RenderJob | CallJob


@dataclass(frozen=True, slots=True)
class ResetResult:
    observation: list[bytes]
    """The observation as one-lane leaves (``SpaceCodec.encode``)."""
    info: MetaMap | None
    """None: the env gave no info (the reply then has none)."""
    obs_warning: Candidate | None
    """First soft conformance violation of the observation (policy ``warn``), else None."""


@dataclass(frozen=True, slots=True)
class StepResult:
    observation: list[bytes]
    reward: float
    terminated: bool
    truncated: bool
    info: MetaMap | None
    """None: the env gave no info (the reply then has none)."""
    action_warning: Candidate | None
    obs_warning: Candidate | None


@dataclass(frozen=True, slots=True)
class RenderResult:
    frame: bytes | None
    """PNG bytes of the env's RGB frame, or None when the env renders nothing."""


@dataclass(frozen=True)
class EnvContract:
    """What every lane of an endpoint serves (lane 0's, checked equal on all lanes)."""

    env_id: str
    """``env.spec.id``, or ``"UnknownEnv-v1"`` when the env has no spec."""
    action_space: gym.spaces.Space[Any]
    observation_space: gym.spaces.Space[Any]
    action_codec: SpaceCodec
    observation_codec: SpaceCodec
    metadata: MetaMap
    """``env.metadata`` through the meta codec (SPEC §4.8)."""
    render_mode: str
    """``env.render_mode``, ``""`` when None."""
