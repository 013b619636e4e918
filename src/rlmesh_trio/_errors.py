"""The package's error hierarchy, and the one place errors are mapped onto the wire.

Each server-side class (a :class:`MappedError`) carries its wire meaning (as h11
carries ``error_status_hint`` on the error itself): the gRPC status a unary call or a stream ends with (``grpc_status``), or the
``EnvError`` code and recoverability of an in-band Join reply (``env_code``,
``recoverable``). Two functions read them, and nothing else in the package decides a
status or a code for an exception:

* :func:`grpc_status` -- exception -> ``(status code, message)`` for the transport;
* :func:`env_error` -- a lane failure -> ``(EnvError code, message, recoverable)`` for
  the session (SPEC §9).

gRPC status codes are plain ints here (the numbers of the gRPC spec): only the transport
package imports grpclib.
"""

from __future__ import annotations

from typing import ClassVar

from ._proto.rlmesh.env.v1 import EnvErrorCode

# gRPC status codes (https://grpc.github.io/grpc/core/md_doc_statuscodes.html).
OK = 0
INVALID_ARGUMENT = 3
NOT_FOUND = 5
FAILED_PRECONDITION = 9
RESOURCE_EXHAUSTED = 8
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
UNAUTHENTICATED = 16


class RlmeshTrioError(Exception):
    """Base class of every error rlmesh-trio raises on purpose: the server's, the
    client's (:class:`rlmesh_trio.client.EndpointError`) and the fleet's
    (:class:`rlmesh_trio.fleet.FleetError`). It carries no wire meaning of its own."""


class MappedError(RlmeshTrioError):
    """An error of the server side, carrying its wire meaning: the gRPC status a call
    ends with when it escapes a handler (``grpc_status``), or the in-band ``EnvError``
    code and recoverability of a failed lane job (``env_code``, ``recoverable``).

    Kept off :class:`RlmeshTrioError` so the client's errors, which describe what a
    server *answered* (``EndpointError.is_recoverable``, ``RpcError.grpc_status``), do
    not also carry a server's defaults under the same names.
    """

    grpc_status: ClassVar[int] = INTERNAL
    env_code: ClassVar[EnvErrorCode] = EnvErrorCode.INTERNAL
    recoverable: ClassVar[bool] = False


# --------------------------------------------------------------------------- codec


class CodecError(MappedError, ValueError):
    """A value or a space could not be converted to or from its wire form."""


class UnsupportedSpaceError(CodecError):
    """A gymnasium space (or a SpaceSpec) that rlmesh-wire-v1 cannot express.

    The message names the path of the offending space (``$``, ``$.key``, ``$[1]``).
    """


class ActionError(CodecError):
    """A client-supplied action (or lane list) failed validation.

    ``str(error)`` is the exact text the reference server puts in its
    ``INVALID_ACTION`` reply (SPEC §9), e.g. ``$: value 5 not in range [0, 2)``.
    """

    env_code = EnvErrorCode.INVALID_ACTION
    recoverable = True


class PolicyViolation(MappedError):
    """A soft conformance violation turned into an error by the ``strict`` policy.

    ``str(error)`` is the violation's ``detail`` text (SPEC §3.7.8). ``kind`` says
    whether the action (``INVALID_ACTION``, recoverable) or the observation
    (``INTERNAL``, fatal) violated its space.
    """

    def __init__(self, detail: str, kind: str = "observation") -> None:
        super().__init__(detail)
        self.kind = kind


class ContractMismatchError(MappedError):
    """Two lanes of one endpoint do not serve the same env contract."""


# --------------------------------------------------------------------------- lanes


class LaneError(MappedError):
    """A job could not be delivered to a lane, or the lane died before answering."""


class LaneClosedError(LaneError):
    """The lane was closed in an orderly way (by the engine) and takes no more jobs."""


class LaneBrokenError(LaneError):
    """The lane's thread is gone or stopped before answering (crash, abandon)."""


class LaneTimeoutError(LaneError):
    """A lane job ran past its deadline (``lane_timeout_seconds`` or the request's
    ``timeout_ms``); ``str()`` is the reference's TIMEOUT text."""

    env_code = EnvErrorCode.TIMEOUT
    recoverable = True


class LaneWedgedError(LaneError):
    """A job for a lane whose env call overran a deadline and has not returned (policy
    ``error``): refused at once instead of waiting behind it. Names the lane."""

    env_code = EnvErrorCode.BUSY
    recoverable = True


class LaneNeedsResetError(LaneError):
    """A step on a lane rebuilt after a fault and not reset since."""

    env_code = EnvErrorCode.NOT_READY
    recoverable = True


class LaneDeadError(LaneError):
    """The lane is gone for good: a process lane lost under policy ``error``, or a lane
    given up after too many faults (names the lane and the cause). Fatal."""

    recoverable = False


class LaneRebuildFailedError(LaneDeadError):
    """Policy ``rebuild``/``truncate``: the lane could not be rebuilt (the factory raised,
    overran, or built a disagreeing env) and will be tried again after its backoff;
    names the lane, the attempt, the cause and when. ``CRASHED``, recoverable: the
    session goes on, and a reset of the lane once it serves again works."""

    env_code = EnvErrorCode.CRASHED
    recoverable = True


# --------------------------------------------------------------------------- wire


class WireError(MappedError):
    """Bytes from the network that are not a well-formed request."""


class DecodeError(WireError):
    """A protobuf message that does not decode; ``str()`` is prost's wording (SPEC §1.10).

    ``stack`` holds ``(message, field)`` pairs, innermost first, as prost prints them:
    ``failed to decode Protobuf message: HandshakeRequest.base: invalid varint``.
    """

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self.description = description
        self.stack: list[tuple[str, str]] = []
        self.field: int | None = None  # set while the failing field is not yet named

    def __str__(self) -> str:
        where = "".join(f"{message}.{field}: " for message, field in self.stack)
        return f"failed to decode Protobuf message: {where}{self.description}"


class FrameError(WireError):
    """A gRPC length-prefixed message that cannot be read (truncated, bad flag)."""


class MessageTooLarge(WireError):
    """A message over the size limit (SPEC §1.8), refused before it is buffered."""

    grpc_status = RESOURCE_EXHAUSTED

    def __init__(self, length: int, limit: int, *, direction: str = "decoded") -> None:
        super().__init__(
            f"{direction} message length too large: found {length} bytes, "
            f"the limit is: {limit} bytes"
        )
        self.length = length
        self.limit = limit


UNEXPECTED_EOF = "Unexpected EOF decoding stream."
"""The reference's ``grpc-message`` for a unary request whose stream ends inside its
message (a truncated body)."""

MISSING_MESSAGE = "Missing request message."
"""The reference's ``grpc-message`` for a unary request without a message."""


class RequestTooLarge(MappedError):
    """A Handshake or Shutdown request over the size limit: the reference's answer
    (``OUT_OF_RANGE``, ``Error, decoded message length too large: ...``)."""

    grpc_status = OUT_OF_RANGE

    def __init__(self, exc: MessageTooLarge) -> None:
        super().__init__(f"Error, {exc}")


# --------------------------------------------------------------------------- requests


class InvalidRequestError(MappedError):
    """A unary request the server cannot serve (e.g. "handshake request missing base")."""

    grpc_status = INVALID_ARGUMENT


class AlreadyJoinedError(MappedError):
    """A second Join while one is active (SPEC §1.10, §7.1)."""

    grpc_status = FAILED_PRECONDITION

    def __init__(self) -> None:
        super().__init__(
            "environment already has an active Join session; "
            "only one client may be connected at a time"
        )


class ServerStoppingError(MappedError):
    """A new Join while the server drains."""

    grpc_status = UNAVAILABLE

    def __init__(self) -> None:
        super().__init__("server is shutting down")


class UnauthenticatedError(MappedError):
    """A request without the configured bearer token (the reference's native wording)."""

    grpc_status = UNAUTHENTICATED

    def __init__(self) -> None:
        super().__init__("invalid env token")


class UnknownMethodError(MappedError):
    """A path the server does not serve; answered with an empty message (SPEC §1.2)."""

    grpc_status = UNIMPLEMENTED

    def __init__(self) -> None:
        super().__init__("")


class CompressedRequestError(MappedError):
    """A request with a ``grpc-encoding`` other than identity (SPEC §1.7)."""

    grpc_status = UNIMPLEMENTED

    def __init__(self, encoding: str) -> None:
        super().__init__(f"Content is compressed with `{encoding}` which isn't supported")


class UnknownServiceError(MappedError):
    """A grpc.health.v1 Check for a service this server does not host."""

    grpc_status = NOT_FOUND

    def __init__(self, service: str) -> None:
        super().__init__(f"unknown service {service!r}")


# --------------------------------------------------------------------------- mapping

INTERNAL_SERVER_ERROR = "internal server error"


def grpc_status(exc: BaseException) -> tuple[int, str]:
    """The gRPC status and message a call ends with when ``exc`` escaped its handler.

    Our own errors carry their status; anything else is a bug of ours and gets a bare
    INTERNAL (its details go to the log, not to the client).
    """
    if isinstance(exc, MappedError):
        return exc.grpc_status, str(exc)
    return INTERNAL, INTERNAL_SERVER_ERROR


def env_error(verb: str, exc: BaseException) -> tuple[EnvErrorCode, str, bool]:
    """The EnvError (code, message, recoverable) for a failed ``verb`` job (SPEC §9).

    Our errors keep their own text (the reference's); an exception of the env (or of
    converting its result) becomes ``"<verb> failed: <Type>: <message>"``, fatal, the
    type by its qualified name (``Outer.Inner``) and the message by
    :func:`exception_text`, as the reference writes them.
    """
    if isinstance(exc, PolicyViolation):
        if exc.kind == "action":
            return EnvErrorCode.INVALID_ACTION, str(exc), True
        return EnvErrorCode.INTERNAL, str(exc), False
    if isinstance(exc, (ActionError, LaneError)):
        return exc.env_code, str(exc), exc.recoverable
    message = f"{verb} failed: {type(exc).__qualname__}: {exception_text(exc)}"
    return EnvErrorCode.INTERNAL, message, False


def not_instance(value: object, target: str) -> TypeError:
    """The reference's refusal of a value of the wrong type, in its words."""
    if value is None:
        return TypeError(f"'None' is not an instance of '{target}'")
    return TypeError(f"'{type(value).__qualname__}' object is not an instance of '{target}'")


STR_FAILED = "<exception str() failed>"
"""What stands for the message of an exception whose ``str()`` raises (the reference's
words)."""


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or :data:`STR_FAILED` when that raises: env code's exception is
    told, never allowed to fail the telling."""
    try:
        return str(exc)
    except Exception:
        return STR_FAILED


# ------------------------------------------------------------------- one line of it


def alone(exc: BaseException) -> BaseException:
    """The one exception of an exception group of one (a nursery's), else ``exc``."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple) and len(inner) == 1 and isinstance(inner[0], BaseException):
        return alone(inner[0])
    return exc


def first_line(exc: BaseException) -> str:
    """``Type: the first line of the message``, or ``Type`` alone when it has none (an
    exception group of one: its member's): how the CLI, the fleet's shard and retry
    records and its logs tell an error in one line."""
    exc = alone(exc)
    text = exception_text(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
