"""What both drivers share: reply routing and results (the contract, the request
shaping and the connection settings are in :mod:`._contract`, :mod:`._codecs` and
:mod:`._settings`).

Sans-IO: a :class:`JoinStream` owns the :class:`GrpcConnection` and the table of pending
requests (by ``request_id``); the Trio driver and the blocking driver feed it bytes and
wait on its slots in their own way.
"""

from __future__ import annotations

import collections
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._wire._protobuf import DecodeError
from ._codecs import Codecs, malformed
from ._contract import Contract
from ._errors import (
    ConnectionLostError,
    EndpointClosedError,
    EndpointError,
    EnvError,
    ErrorCode,
    RpcError,
)
from ._grpc import Call, GrpcConnection
from ._messages import Reply, decode_reply

__all__ = [
    "MAX_COMPLETED",
    "JoinStream",
    "Slot",
    "call_failure",
    "check_options",
    "result_of",
    "shutdown_error",
]

MAX_COMPLETED = 65536
"""Episode records kept for :meth:`Endpoint.pop_completed_episodes` (older ones drop)."""


def call_failure(call: Call, what: str, *, shutting_down: bool = False) -> EndpointError:
    """Why ``call`` ended without (more) replies; ``shutting_down``: the server had sent
    a graceful GOAWAY before, so a call cut without a status was cut by its shutdown."""
    if call.status is not None and call.status != 0:
        return RpcError(call.status, call.status_message)
    why = call.lost if call.lost is not None else "the server ended the stream"
    if shutting_down:
        return ConnectionLostError(f"{what}: {SHUTTING_DOWN} ({why})")
    return ConnectionLostError(f"{what}: {why}")


SHUTTING_DOWN = "the server is shutting down (GOAWAY received)"
"""How a request cut by a server's shutdown is told (after a graceful GOAWAY)."""

_LANE_STOPPED = re.compile(r"lane \d+ (?:stopped before answering|is no longer running)")
"""What a rlmesh-trio server answers for a lane job its stop cut short (the lane wound
down before answering, or no longer takes jobs)."""


def _lanes_text(lanes: Sequence[int]) -> str:
    if not lanes:
        return "it"
    if len(lanes) == 1:
        return f"lane {lanes[0]}"
    if list(lanes) == list(range(lanes[0], lanes[0] + len(lanes))):
        return f"lanes {lanes[0]}-{lanes[-1]}"
    shown = ", ".join(str(lane) for lane in lanes[:8])
    return f"lanes {shown}" + (f", ... ({len(lanes)} lanes)" if len(lanes) > 8 else "")


def shutdown_error(slot: Slot, detail: str) -> ConnectionLostError:
    """The error of a request a shutting-down server did not answer: which lanes, what."""
    return ConnectionLostError(
        f"{SHUTTING_DOWN} before {_lanes_text(slot.lanes)} answered the {slot.verb} ({detail})"
    )


# ---------------------------------------------------------------------------- routing


class Slot:
    """One pending request: its reply or the error it ends with, and what it asked
    (``verb``, the ``lanes`` it addressed: empty for a session request) to say so."""

    __slots__ = ("error", "lanes", "reply", "verb", "wake")

    def __init__(
        self, wake: Callable[[], None], verb: str = "request", lanes: Sequence[int] = ()
    ) -> None:
        self.reply: Reply | None = None
        self.error: BaseException | None = None
        self.wake = wake
        self.verb = verb
        self.lanes = tuple(lanes)


class JoinStream:
    """The client's side of one Join stream: request ids, pending slots, failure (the
    server's side is the transport's ``JoinCall``, its states ``JoinState``)."""

    def __init__(self, conn: GrpcConnection, join: Call, contract: Contract) -> None:
        self.conn = conn
        self.join = join
        self.contract = contract
        self.codecs = Codecs(contract)
        self.pending: dict[str, Slot] = {}
        self.failure: EndpointError | None = None
        """Set once the endpoint is unusable; new requests raise EndpointClosedError from it."""
        self.closing = False
        self.abandoned: set[str] = set()
        """Request ids given up by their callers whose replies have not come yet."""
        self._ids = itertools.count(1)
        self.completed: collections.deque[Any] = collections.deque(maxlen=MAX_COMPLETED)
        """Episodes reported by step replies, not yet popped (the most recent ones)."""

    def next_id(self) -> str:
        return f"rt-{next(self._ids)}"

    def check_open(self, *, closing: bool = False) -> None:
        """Raise EndpointClosedError unless the endpoint takes requests. ``closing``: the
        session's Close, which a fatal env error does not stop: the stream is still open
        when the error was lane-scoped, and ending it frees the server at once."""
        failure = self.failure
        if failure is not None and not (closing and isinstance(failure, EnvError)):
            raise EndpointClosedError(f"the endpoint is closed: {failure}") from failure
        if self.closing:
            raise EndpointClosedError()

    def submit(
        self,
        payload: bytes,
        request_id: str,
        wake: Callable[[], None],
        *,
        verb: str = "request",
        lanes: Sequence[int] | None = (),
    ) -> Slot:
        """Queue a request (whole, on the Join stream) and register its slot. ``verb``
        and ``lanes`` (None: every lane; empty: a session request) name it in errors."""
        self.check_open(closing=verb == "close")
        slot = Slot(wake, verb, range(self.contract.num_envs) if lanes is None else lanes)
        self.pending[request_id] = slot
        try:
            self.conn.send(self.join, payload)
        except ConnectionError as exc:
            del self.pending[request_id]
            self.fail(ConnectionLostError(str(exc)))
            raise self.failure from None  # type: ignore[misc]
        return slot

    def submit_many(self, requests: Sequence[tuple[bytes, str, Callable[[], None]]]) -> list[Slot]:
        """Queue requests back to back (``(payload, request_id, wake)`` each) and
        register their slots: all of them, or none."""
        if len(requests) == 1:
            return [self.submit(*requests[0])]
        self.check_open()
        slots = [Slot(wake) for _, _, wake in requests]
        for (_, request_id, _), slot in zip(requests, slots, strict=True):
            self.pending[request_id] = slot
        try:
            self.conn.send_many(self.join, [payload for payload, _, _ in requests])
        except (ConnectionError, ValueError) as exc:
            for _, request_id, _ in requests:
                del self.pending[request_id]
            if isinstance(exc, ValueError):
                raise
            self.fail(ConnectionLostError(str(exc)))
            raise self.failure from None  # type: ignore[misc]
        return slots

    def abandon(self, request_id: str) -> None:
        """A waiter gave up (cancelled, or past its deadline): its reply, if it comes, is
        dropped."""
        if self.pending.pop(request_id, None) is not None:
            self.abandoned.add(request_id)

    def process(self) -> None:
        """Route every reply that arrived; fail everyone if the stream or connection ended."""
        join = self.join
        while join.messages:
            data = join.messages.popleft()
            try:
                reply = decode_reply(data)
            except DecodeError as exc:
                self.fail(malformed(f"undecodable JoinResponse: {exc}"))
                self.conn.cancel(join)
                return
            slot = self.pending.pop(reply.request_id, None)
            if slot is None:
                if reply.request_id in self.abandoned:
                    self.abandoned.discard(reply.request_id)
                    continue  # the late reply of an abandoned (cancelled) request
                if self.failure is not None:
                    continue  # pending requests were failed already
                self.fail(malformed(f"a reply to request_id {reply.request_id!r}, never sent"))
                self.conn.cancel(join)
                return
            if reply.kind == "error":
                error = EnvError(
                    reply.error_message,
                    code=ErrorCode.of(reply.error_code),
                    is_recoverable=reply.error_recoverable,
                    request_id=reply.request_id,
                    debug_info=reply.error_debug,
                )
                if self._cut_by_shutdown(error):
                    lost = shutdown_error(slot, f"the server said: {error.message}")
                    lost.__cause__ = error
                    slot.error = lost
                    slot.wake()
                    self.fail(
                        ConnectionLostError(f"{SHUTTING_DOWN}: {error.message}"),
                        detail="the server's stop cut the requests in flight short",
                    )
                    continue
                slot.error = error
                slot.wake()
                if not error.is_recoverable:
                    self.fail(error)
                continue
            slot.reply = reply
            slot.wake()
        if join.ended or self.conn.lost is not None:
            self.fail(call_failure(join, "the Join stream ended"))

    def _cut_by_shutdown(self, error: EnvError) -> bool:
        """A rlmesh-trio server that sent a graceful GOAWAY answers the lane jobs its stop
        cut short with a fatal INTERNAL "lane <i> stopped before answering": that is
        the shutdown, not a fault of the env."""
        return (
            self.conn.shutting_down
            and not error.is_recoverable
            and error.code == ErrorCode.INTERNAL
            and _LANE_STOPPED.fullmatch(error.message) is not None
        )

    def fail(self, error: EndpointError, *, detail: str | None = None) -> None:
        """Make the endpoint unusable; every pending request fails. A connection lost
        after the server's graceful GOAWAY is told as its shutdown, to each request
        with the lanes it was waiting for (and ``detail``, else why it was lost)."""
        shutdown = isinstance(error, ConnectionLostError) and self.conn.shutting_down
        if shutdown and not error.message.startswith(SHUTTING_DOWN):
            error = ConnectionLostError(f"{SHUTTING_DOWN}: {error.message}")
        if self.failure is None:
            self.failure = error
        pending, self.pending = self.pending, {}
        for slot in pending.values():
            if slot.error is None and slot.reply is None:
                if shutdown:
                    why = error.message.removeprefix(SHUTTING_DOWN).removeprefix(": ")
                    slot.error = shutdown_error(slot, detail or why)
                elif isinstance(error, EnvError):
                    closed = EndpointClosedError(
                        f"the endpoint was closed by a fatal error: {error}"
                    )
                    closed.__cause__ = error
                    slot.error = closed
                else:
                    slot.error = error
                slot.wake()


def result_of(slot: Slot, expect: str) -> Reply:
    if slot.error is not None:
        raise slot.error
    reply = slot.reply
    assert reply is not None
    if reply.kind != expect:
        raise malformed(f"expected a {expect} reply, got {reply.kind or 'an empty one'!r}")
    return reply


def check_options(options: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping, not {type(options).__name__}")
    return options
