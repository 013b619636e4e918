"""What a Session asks its driver to do (sans-IO actions), performed in order:
:class:`Post` (queue a job on a lane; a refusal comes back as a lane reply), :class:`Send`,
:class:`Report` (for the log and the metrics), :class:`Done` (for the metrics, with
``observe=True``), :class:`StartTimer`, :class:`CancelTimer`, :class:`Wedged` (tell the lanes a job overran its request's
deadline), :class:`EndStream`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._jobs import Job
from .._proto.rlmesh.env import v1 as env_v1


@dataclass(frozen=True, slots=True)
class Post:
    """Queue ``job`` on lane ``lane``; its answer comes back through ``on_lane_reply``.

    ``barrier``: the job is a serial op's (a whole-vector one): nothing else goes to its
    lanes until every one of them answered, so the driver may hold the answers and hand
    them over together (``on_lane_replies``). Without it a lane's answers must reach the
    session one by one, in the lane's order: a lane-scoped op on several lanes does not
    hold back the next request's jobs on those lanes."""

    lane: int
    job: Job
    barrier: bool = False


@dataclass(frozen=True, slots=True)
class Report:
    """Tell the operator (the driver logs it; nothing goes on the wire).

    ``kind`` is ``"fault"`` for an env failure (``error`` is the exception, with its
    traceback), ``"truncated"`` for an env failure answered as a truncation (policy
    ``truncate``; ``error`` as for a fault), ``"rejected"`` for a request refused as
    invalid or unsupported, ``"refused"`` for a job a lane did not take (it is dead,
    wedged or stopped: no env code ran, so there is no traceback to show), or
    ``"timeout"`` for a request whose deadline expired.
    """

    kind: str
    verb: str
    request_id: str
    lanes: tuple[int, ...]
    code: env_v1.EnvErrorCode
    message: str
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Done:
    """A reset/step/render completed on ``lanes`` (emitted only for ``observe=True``, for
    metrics): the server time and the env time of the request."""

    verb: str
    lanes: tuple[int, ...]
    total_ns: int
    user_ns: int


@dataclass(frozen=True, slots=True)
class Send:
    """Send this JoinResponse (in the order the actions were returned)."""

    response: env_v1.JoinResponse


@dataclass(frozen=True, slots=True)
class StartTimer:
    """Call ``on_timer(token)`` after ``seconds``, unless cancelled first."""

    token: int
    seconds: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    token: int


@dataclass(frozen=True, slots=True)
class Wedged:
    """``job`` on ``lane`` overran its request's deadline of ``seconds`` (the request was
    answered): the lane engine decides whether the lane is wedged (docs/supervision.md)."""

    lane: int
    job: Job
    seconds: float


@dataclass(frozen=True, slots=True)
class EndStream:
    """Finish the Join stream with grpc-status 0 after the sends before it."""


Action = Post | Send | Report | Done | StartTimer | CancelTimer | Wedged | EndStream
