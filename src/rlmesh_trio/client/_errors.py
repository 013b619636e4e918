"""The client's one exception family: every failure carries a code, recoverability, text.

In-band env errors (``JoinResponse.error``, SPEC §9) keep the server's code, its
``is_recoverable`` flag and its message verbatim. Failures below the Join (the
connection, a gRPC status, the handshake) are mapped onto the same codes so one
``except EndpointError as e: if e.is_recoverable: ...`` covers them all. The family is
part of the package's one error root, :class:`rlmesh_trio.RlmeshTrioError`.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from .._errors import RlmeshTrioError

__all__ = [
    "ConnectionLostError",
    "EndpointClosedError",
    "EndpointError",
    "EnvError",
    "ErrorCode",
    "HandshakeError",
    "LaneBusyError",
    "LaneError",
    "RequestTimeoutError",
    "RpcError",
]


GRPC_STATUS_NAMES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)
"""The standard gRPC status codes, by number (https://grpc.github.io/grpc/core/md_doc_statuscodes.html)."""


def grpc_status_name(status: int) -> str:
    """``UNAUTHENTICATED`` for 16; ``gRPC status 17`` for a number outside the standard."""
    if 0 <= status < len(GRPC_STATUS_NAMES):
        return GRPC_STATUS_NAMES[status]
    return f"gRPC status {status}"


LANE_FAULT_KEY = "rlmesh_trio.lane_fault"
"""The key of a faulted lane's record, in a step's info (``truncate``) and in a CRASHED
error's ``debug_info`` (``rebuild``/``truncate``)."""


class ErrorCode(enum.IntEnum):
    """``rlmesh.env.v1.EnvErrorCode`` (SPEC §2.3), names without the prefix."""

    UNSPECIFIED = 0
    TIMEOUT = 1
    INVALID_ACTION = 2
    NOT_READY = 3
    BUSY = 4
    UNSUPPORTED = 5
    INTERNAL = 10
    CRASHED = 11
    CANCELLED = 12
    CLOSED = 13

    @classmethod
    def of(cls, value: int) -> ErrorCode:
        """The member for a wire value; an unknown value reads as UNSPECIFIED."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


class EndpointError(RlmeshTrioError):
    """Base of every error the client raises on purpose.

    ``code`` (:class:`ErrorCode`), ``is_recoverable`` (the session is still usable: retry
    or carry on) and ``message`` (the server's text where there is one).
    """

    def __init__(
        self, message: str, *, code: ErrorCode = ErrorCode.UNSPECIFIED, is_recoverable: bool = False
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.is_recoverable = is_recoverable

    def __str__(self) -> str:
        kind = "recoverable" if self.is_recoverable else "fatal"
        return f"{self.code.name} ({kind}): {self.message}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.code, self.is_recoverable, self.__dict__))


def _rebuild(
    cls: type[EndpointError],
    message: str,
    code: ErrorCode,
    recoverable: bool,
    state: dict[str, Any],
) -> EndpointError:
    error = EndpointError.__new__(cls)
    EndpointError.__init__(error, message, code=code, is_recoverable=recoverable)
    error.__dict__.update(state)
    return error


class EnvError(EndpointError):
    """The server's in-band ``EnvError`` for one request (SPEC §9), or an action the
    client could not even encode (``INVALID_ACTION``, recoverable, nothing sent).

    ``request_id`` is the request it answered. A non-recoverable one closes the endpoint.
    """

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode = ErrorCode.UNSPECIFIED,
        is_recoverable: bool = False,
        request_id: str = "",
        debug_info: str = "",
    ) -> None:
        super().__init__(message, code=code, is_recoverable=is_recoverable)
        self.request_id = request_id
        self.debug_info = debug_info

    @property
    def lane_faults(self) -> list[dict[str, Any]]:
        """The lanes a rlmesh-trio server under ``--on-lane-fault rebuild|truncate``
        names in this error (its ``debug_info``): one ``{"lane": i, "error": "<Type>:
        <message>", "rebuilt": bool}`` per faulted lane, which must be reset before it
        steps again (docs/supervision.md). Empty for any other error or server."""
        try:
            info = json.loads(self.debug_info) if self.debug_info.startswith("{") else None
        except ValueError:
            return []
        faults = info.get(LANE_FAULT_KEY) if isinstance(info, dict) else None
        if not isinstance(faults, list):
            return []
        return [f for f in faults if isinstance(f, dict) and isinstance(f.get("lane"), int)]


class LaneBusyError(EndpointError):
    """A lane was addressed while it has a request in flight, or a result that
    ``recv()`` has not returned yet (a lane never has two requests in flight).
    ``BUSY``, recoverable: nothing was sent."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=ErrorCode.BUSY, is_recoverable=True)


class LaneError(EnvError):
    """The server's recoverable :class:`EnvError` for one lane's request in a pool
    (``env_id``: the lane). The lane is idle again: send it again, or reset it."""

    def __init__(self, error: EnvError, env_id: int) -> None:
        super().__init__(
            error.message,
            code=error.code,
            is_recoverable=error.is_recoverable,
            request_id=error.request_id,
            debug_info=error.debug_info,
        )
        self.env_id = env_id

    def __str__(self) -> str:
        return f"lane {self.env_id}: {super().__str__()}"


def lane_crash(error: EndpointError) -> bool:
    """A recoverable error naming faulted lanes (rlmesh-trio's rebuild/truncate): the
    session goes on once those lanes are reset."""
    return isinstance(error, EnvError) and error.is_recoverable and bool(error.lane_faults)


class RpcError(EndpointError):
    """A call ended with a non-OK gRPC status: ``grpc_status`` (the number),
    ``grpc_status_name`` (``UNAUTHENTICATED``) and ``grpc_message`` (the server's text).

    ``str()`` and ``message`` read ``UNAUTHENTICATED: invalid env token`` (the name alone
    when the server sent no text), e.g. FAILED_PRECONDITION for a second Join. ``code``:
    ``CANCELLED`` for 1, ``TIMEOUT`` for 4, ``BUSY`` for 9, ``UNSUPPORTED`` for 12,
    ``CLOSED`` for 14, else ``UNSPECIFIED``; never recoverable.
    """

    _CODES = {
        1: ErrorCode.CANCELLED,
        4: ErrorCode.TIMEOUT,
        9: ErrorCode.BUSY,
        12: ErrorCode.UNSUPPORTED,
        14: ErrorCode.CLOSED,
    }

    def __init__(self, grpc_status: int, grpc_message: str) -> None:
        name = grpc_status_name(grpc_status)
        text = f"{name}: {grpc_message}" if grpc_message else name
        super().__init__(text, code=self._CODES.get(grpc_status, ErrorCode.UNSPECIFIED))
        self.grpc_status = grpc_status
        self.grpc_status_name = name
        self.grpc_message = grpc_message

    def __str__(self) -> str:
        return self.message


class RequestTimeoutError(EndpointError):
    """No reply within the client's own deadline for a call: its ``timeout_ms`` plus
    :data:`~rlmesh_trio.client._core.REPLY_GRACE` seconds (a server answers ``TIMEOUT``
    itself at ``timeout_ms``; this is for one that does not). ``TIMEOUT``, recoverable:
    the endpoint stays open, and the late reply, if it ever comes, is dropped."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=ErrorCode.TIMEOUT, is_recoverable=True)


class HandshakeError(EndpointError):
    """The server is not one this client can talk to (protocol generation, edition, no
    contract). Nothing was joined."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=ErrorCode.UNSUPPORTED)


class ConnectionLostError(EndpointError):
    """The connection could not be made, or went away (closed, reset, a Join stream cut
    without a status, no answer to a keep-alive PING): every pending call fails with it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=ErrorCode.CLOSED)


class EndpointClosedError(EndpointError):
    """A call on an endpoint that was closed (by :meth:`aclose`, or by a fatal error:
    then ``__cause__`` is that error)."""

    def __init__(self, message: str = "the endpoint is closed") -> None:
        super().__init__(message, code=ErrorCode.CLOSED)
