"""The Join protocol as a sans-IO state machine (SPEC §6, §7, §9).

INTERFACE SKELETON -- being implemented. The service drives it:

* ``Endpoint``: server-wide state shared by every Join of one server (contract,
  conformance ledger, editions, peer info); answers Handshake and Shutdown.
* ``Session``: one per Join stream. Feed it events, perform the actions it returns:

  - ``session.on_request(request)``  -- a JoinRequest was decoded
  - ``session.on_lane_reply(token, reply)`` -- a lane answered a job (call it on the
    transport loop; the ``ReplyFn`` given to the lane comes from ``reply_to(token)``)
  - ``session.on_timer(token)`` -- a ``StartTimer`` expired
  - ``session.on_stream_end()`` -- the client half-closed, cancelled or vanished

  Actions: ``Send(response)``, ``StartTimer(token, seconds)``, ``CancelTimer(token)``,
  ``EndStream()``. Lane jobs are posted by the session itself through the ``post``
  callable it was given (``LaneEngine.post``: thread-safe, never blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from ._jobs import EnvContract, Job, LaneReply, ReplyFn
from ._options import Policy
from ._proto.rlmesh.env import v1 as env_v1


@dataclass(frozen=True, slots=True)
class Send:
    response: env_v1.JoinResponse


@dataclass(frozen=True, slots=True)
class StartTimer:
    token: int
    seconds: float


@dataclass(frozen=True, slots=True)
class CancelTimer:
    token: int


@dataclass(frozen=True, slots=True)
class EndStream:
    """Finish the Join stream with grpc-status 0 after the sends before it."""


Action = Union[Send, StartTimer, CancelTimer, EndStream]


class Endpoint:
    """Server-wide state: one per server, shared by its successive Join sessions."""

    def __init__(
        self,
        contract: EnvContract,
        num_envs: int,
        *,
        policy: Policy = "warn",
        workflow_edition: str | None = None,
        allow_remote_shutdown: bool = False,
    ) -> None:
        raise NotImplementedError

    def handshake(self, request: env_v1.HandshakeRequest) -> env_v1.HandshakeResponse:
        """Answer a Handshake. Raises InvalidRequestError("handshake request missing base")."""
        raise NotImplementedError

    def shutdown(self, request: env_v1.ShutdownRequest) -> tuple[env_v1.ShutdownResponse, bool]:
        """Answer a Shutdown; the bool says whether the server must now stop.

        Raises InvalidRequestError("shutdown request missing base").
        """
        raise NotImplementedError


class Session:
    """One Join stream's state."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        post: Callable[[int, Job], None],
        reply_to: Callable[[int], ReplyFn],
    ) -> None:
        raise NotImplementedError

    def on_request(self, request: env_v1.JoinRequest) -> list[Action]:
        raise NotImplementedError

    def on_lane_reply(self, token: int, reply: LaneReply) -> list[Action]:
        raise NotImplementedError

    def on_timer(self, token: int) -> list[Action]:
        raise NotImplementedError

    def on_stream_end(self) -> list[Action]:
        raise NotImplementedError

    @property
    def busy(self) -> bool:
        """True while any request is in flight or queued (holds the idle timer)."""
        raise NotImplementedError

    @property
    def finished(self) -> bool:
        """True once the session has ended its stream (or the stream ended)."""
        raise NotImplementedError
