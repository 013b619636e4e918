"""The gRPC transport: grpclib on its own asyncio loop, in one dedicated thread.

DESIGN.md decision 2: a Trio task (:meth:`TransportService.run`) starts one thread that
runs an asyncio ``SelectorEventLoop`` with a grpclib HTTP/2 server on it, supervises it
and stops it. The hot path (bytes in, session, lane mailbox, lane reply, bytes out)
never passes through Trio's scheduler: lane threads hand their replies to this loop
with ``loop.call_soon_threadsafe``.

This is the only module that imports asyncio, grpclib (and its h2/hyperframe).

What it serves (SPEC §1):

* ``/rlmesh.env.v1.EnvService/Handshake`` and ``/Shutdown`` -- unary, answered by the
  :class:`~rlmesh_trio._session.Endpoint`;
* ``/rlmesh.env.v1.EnvService/Join`` -- the bidi stream, driven through a sans-IO
  :class:`~rlmesh_trio._session.Session`; one Join at a time per server;
* ``/grpc.health.v1.Health/Check`` -- SERVING for ``""`` and
  ``"rlmesh.env.v1.EnvService"`` while listening, NOT_SERVING while stopping (beyond the
  reference, which has no health service);
* anything else -- ``UNIMPLEMENTED``; a compressed request -- ``UNIMPLEMENTED``.

Messages cross grpclib as raw bytes: this module frames, size-checks and decodes them
itself, strictly (betterproto2 silently accepts truncated or garbled input, the
reference rejects it), so that an undecodable request gets the reference's answer.

grpclib is pinned (0.4.9); a few of its internals are used on purpose and tested:
``grpclib.server.Handler`` (subclassed to see request headers, refuse streams while
stopping and refuse compressed requests), ``grpclib.protocol.H2Protocol`` (subclassed
to track connections), the ``_stream`` of a ``grpclib.server.Stream`` (to read a
message's length prefix before its body) and ``_DispatchServerEvents``. h2 cannot send a
GOAWAY and keep serving the open streams (its state machine closes the connection), so
the GOAWAY frames are written next to it with hyperframe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import betterproto2
import h2.config
import h2.exceptions
import trio
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.const import Handler as MethodHandler
from grpclib.encoding.base import CodecBase
from grpclib.events import _DispatchServerEvents
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.metadata import encode_grpc_message
from grpclib.protocol import H2Protocol
from grpclib.server import Handler as GrpclibHandler
from grpclib.server import Stream
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame

from ._errors import InvalidRequestError
from ._fastwire import (
    WireDecodeError,
    decode_join_request,
    encode_join_response,
    read_string_field,
    read_varint,
)
from ._options import DEFAULT_CLOSE_TIMEOUT, DEFAULT_DRAIN_TIMEOUT, ServeOptions
from ._proto.rlmesh.env import v1 as env_v1
from ._session import Action, CancelTimer, EndStream, Send, Session, StartTimer

if TYPE_CHECKING:
    from grpclib.protocol import Stream as H2Stream

    from ._jobs import Job, LaneReply, ReplyFn

log = logging.getLogger("rlmesh_trio.service")

SERVICE_NAME = "rlmesh.env.v1.EnvService"
HANDSHAKE_PATH = f"/{SERVICE_NAME}/Handshake"
JOIN_PATH = f"/{SERVICE_NAME}/Join"
SHUTDOWN_PATH = f"/{SERVICE_NAME}/Shutdown"
HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"

ALREADY_JOINED = (
    "environment already has an active Join session; only one client may be connected at a time"
)
"""FAILED_PRECONDITION message for a second concurrent Join (SPEC §1.10, §7.1)."""

CUT_TIMEOUT = 1.0
"""Seconds the request handlers get to unwind once the connections were cut at stop."""

INFLIGHT_SLACK = 1.0
"""Seconds, beyond ``close_timeout_seconds``, a request in flight when the drain ends may
take to be answered (the lanes finish their current job within the close timeout)."""

THREAD_EXIT_TIMEOUT = 2.0
"""Seconds, beyond drain and cut, the transport thread gets to close its loop and exit."""

GOAWAY_GAP = 0.05
"""Seconds between the two GOAWAY frames of a stop (like the reference: first with
last-stream 2^31-1, then with the real last stream id)."""

_MAX_STREAM_ID = 2**31 - 1
_HEALTH_SERVING = 1
_HEALTH_NOT_SERVING = 2


# --------------------------------------------------------------------------- interfaces


class EndpointLike(Protocol):
    """What the service needs from :class:`~rlmesh_trio._session.Endpoint`."""

    def handshake(self, request: env_v1.HandshakeRequest) -> env_v1.HandshakeResponse: ...

    def shutdown(self, request: env_v1.ShutdownRequest) -> tuple[env_v1.ShutdownResponse, bool]: ...


class SessionLike(Protocol):
    """What the service needs from :class:`~rlmesh_trio._session.Session`."""

    def on_request(self, request: env_v1.JoinRequest) -> list[Action]: ...

    def on_lane_reply(self, token: int, reply: LaneReply) -> list[Action]: ...

    def on_timer(self, token: int) -> list[Action]: ...

    def on_stream_end(self) -> list[Action]: ...

    @property
    def busy(self) -> bool: ...

    @property
    def finished(self) -> bool: ...


class SessionFactory(Protocol):
    def __call__(
        self,
        endpoint: Any,
        *,
        post: Callable[[int, Job], None],
        reply_to: Callable[[int], ReplyFn],
    ) -> SessionLike: ...


# --------------------------------------------------------------------------- strict decoding


class DecodeError(Exception):
    """A protobuf message that does not decode; ``str()`` is prost's wording (SPEC §1.10)."""

    def __init__(self, description: str) -> None:
        super().__init__(description)
        self.description = description
        self.stack: list[tuple[str, str]] = []  # (message, field), innermost first

    def __str__(self) -> str:
        where = "".join(f"{message}.{field}: " for message, field in self.stack)
        return f"failed to decode Protobuf message: {where}{self.description}"


_WIRE_NAMES = {
    0: "Varint",
    1: "SixtyFourBit",
    2: "LengthDelimited",
    3: "StartGroup",
    4: "EndGroup",
    5: "ThirtyTwoBit",
}
_RECURSION_LIMIT = 100
_FIXED32 = frozenset(
    {betterproto2.TYPE_FLOAT, betterproto2.TYPE_FIXED32, betterproto2.TYPE_SFIXED32}
)
_FIXED64 = frozenset(
    {betterproto2.TYPE_DOUBLE, betterproto2.TYPE_FIXED64, betterproto2.TYPE_SFIXED64}
)
_LEN = frozenset({betterproto2.TYPE_STRING, betterproto2.TYPE_BYTES})
_NESTED = frozenset({betterproto2.TYPE_MESSAGE, betterproto2.TYPE_MAP})


@dataclass(frozen=True)
class _Rule:
    name: str
    wire: int  # wire type of one element
    packable: bool  # a repeated scalar: the packed (length-delimited) form is accepted too
    message: type[betterproto2.Message] | None  # nested message or map entry


_RULES: dict[type[betterproto2.Message], dict[int, _Rule]] = {}


def _rules(cls: type[betterproto2.Message]) -> dict[int, _Rule]:
    rules = _RULES.get(cls)
    if rules is None:
        meta = cast(Any, cls)._betterproto
        rules = {}
        for name, field in meta.meta_by_field_name.items():
            nested: type[betterproto2.Message] | None = None
            if field.proto_type in _NESTED:
                wire = 2
                nested = field.unwrap() if field.unwrap else meta.cls_by_field[name]
            elif field.proto_type in _LEN:
                wire = 2
            elif field.proto_type in _FIXED32:
                wire = 5
            elif field.proto_type in _FIXED64:
                wire = 1
            else:
                wire = 0
            rules[field.number] = _Rule(name, wire, bool(field.repeated) and wire != 2, nested)
        _RULES[cls] = rules
    return rules


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    try:
        return read_varint(data, pos, end)
    except WireDecodeError:
        raise DecodeError("invalid varint") from None


def _skip(data: bytes, pos: int, end: int, wire: int, number: int, depth: int) -> int:
    """Skip one unknown field's value; return the position after it."""
    if wire == 0:
        return _varint(data, pos, end)[1]
    if wire == 1 or wire == 5:
        size = 8 if wire == 1 else 4
        if end - pos < size:
            raise DecodeError("buffer underflow")
        return pos + size
    if wire == 2:
        length, pos = _varint(data, pos, end)
        if length > end - pos:
            raise DecodeError("buffer underflow")
        return pos + length
    if wire == 3:
        if depth >= _RECURSION_LIMIT:
            raise DecodeError("recursion limit reached")
        while True:
            key, pos = _varint(data, pos, end)
            inner_wire, inner_number = key & 7, key >> 3
            if inner_wire > 5:
                raise DecodeError(f"invalid wire type value: {inner_wire}")
            if inner_number == 0:
                raise DecodeError("invalid tag value: 0")
            if inner_wire == 4:
                if inner_number != number:
                    raise DecodeError("unexpected end group tag")
                return pos
            pos = _skip(data, pos, end, inner_wire, inner_number, depth + 1)
    raise DecodeError("unexpected end group tag")


def _check_packed(data: bytes, pos: int, end: int, wire: int) -> None:
    if wire == 0:
        while pos < end:
            pos = _varint(data, pos, end)[1]
        return
    size = 8 if wire == 1 else 4
    if (end - pos) % size:
        raise DecodeError("buffer underflow")


def _check(cls: type[betterproto2.Message], data: bytes, pos: int, end: int, depth: int) -> None:
    """Raise DecodeError unless ``data[pos:end]`` is well-formed protobuf for ``cls``."""
    if depth > _RECURSION_LIMIT:
        raise DecodeError("recursion limit reached")
    rules = _rules(cls)
    while pos < end:
        key, pos = _varint(data, pos, end)
        wire, number = key & 7, key >> 3
        if wire > 5:
            raise DecodeError(f"invalid wire type value: {wire}")
        if number == 0:
            raise DecodeError("invalid tag value: 0")
        rule = rules.get(number)
        if rule is None:
            pos = _skip(data, pos, end, wire, number, depth)
            continue
        try:
            if wire != rule.wire and not (rule.packable and wire == 2):
                raise DecodeError(
                    f"invalid wire type: {_WIRE_NAMES[wire]} (expected {_WIRE_NAMES[rule.wire]})"
                )
            if wire == 2:
                length, pos = _varint(data, pos, end)
                if length > end - pos:
                    raise DecodeError("buffer underflow")
                stop = pos + length
                if rule.message is not None:
                    _check(rule.message, data, pos, stop, depth + 1)
                elif rule.packable:
                    _check_packed(data, pos, stop, rule.wire)
                pos = stop
            else:
                pos = _skip(data, pos, end, wire, number, depth)
        except DecodeError as exc:
            exc.stack.append((cls.__name__, rule.name))
            raise


_M = TypeVar("_M", bound=betterproto2.Message)


def decode_message(cls: type[_M], data: bytes) -> _M:
    """Decode ``data`` as ``cls``; raise :class:`DecodeError` for malformed input."""
    _check(cls, data, 0, len(data), 0)
    try:
        return cls.parse(data)
    except UnicodeDecodeError:
        raise DecodeError("invalid string value: data is not UTF-8 encoded") from None
    except Exception as exc:  # betterproto2 is lenient; anything it still rejects
        raise DecodeError(str(exc) or type(exc).__name__) from exc


# --------------------------------------------------------------------------- gRPC framing


class _BadFrame(Exception):
    """A gRPC length-prefixed message that cannot be read (truncated, bad flag)."""


class _Oversize(Exception):
    def __init__(self, length: int, limit: int) -> None:
        super().__init__(
            f"decoded message length too large: found {length} bytes, the limit is: {limit} bytes"
        )


async def _read_message(h2_stream: H2Stream, limit: int) -> bytes | None:
    """Read one length-prefixed message; None when the client half-closed.

    The prefix is read first so an over-size message is refused before its body is
    buffered.
    """
    try:
        prefix = await h2_stream.recv_data(5)
        if not prefix:
            return None
        if len(prefix) != 5:
            raise _BadFrame("truncated message prefix")
        if prefix[0] not in (0, 1):
            raise _BadFrame(f"invalid compression flag {prefix[0]}")
        if prefix[0]:
            raise _BadFrame("compressed message but no grpc-encoding was negotiated")
        length = int.from_bytes(prefix[1:5], "big")
        if length > limit:
            raise _Oversize(length, limit)
        data = await h2_stream.recv_data(length)
    except AssertionError as exc:  # grpclib's Buffer: EOF inside a message
        raise _BadFrame("truncated message") from exc
    if len(data) != length:
        raise _BadFrame("truncated message")
    return data


def _h2(stream: Stream[Any, Any]) -> H2Stream:
    return stream._stream


class _RawCodec(CodecBase):
    """Messages cross grpclib as bytes; this module encodes and decodes them itself."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        if not isinstance(message, bytes):
            raise TypeError(f"expected bytes, got {type(message).__name__}")
        return message

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


class _Mapping(dict[str, MethodHandler]):
    """grpclib's method table, answering unknown paths with our own UNIMPLEMENTED handler.

    grpclib's own answer omits ``content-type`` from the trailers-only response; the
    reference (and strict clients) have it.
    """

    def __init__(self, methods: dict[str, MethodHandler], fallback: MethodHandler) -> None:
        super().__init__(methods)
        self._fallback = fallback

    def get(self, key: str, default: Any = None) -> MethodHandler:
        return super().get(key, self._fallback)


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _ensure_nodelay(transport: asyncio.BaseTransport) -> None:
    """Pipelined lane requests stall ~40 ms per round on TCP without TCP_NODELAY."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        if not sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Handler(GrpclibHandler):
    """One per connection: grpclib's request dispatcher, with our admission checks."""

    def __init__(self, server: _LoopServer) -> None:
        super().__init__(server.mapping, server.codec, None, server.dispatch)
        self._server = server
        self.last_stream_id = 0

    def accept(
        self, stream: H2Stream, headers: list[tuple[str, str]], release_stream: Callable[[], Any]
    ) -> None:
        if self._server.closing:
            # After GOAWAY: "not processed, safe to retry elsewhere".
            stream.reset_nowait(ErrorCodes.REFUSED_STREAM)
            release_stream()
            return
        if stream.id is not None:
            self.last_stream_id = max(self.last_stream_id, stream.id)
        encoding = _header(headers, "grpc-encoding")
        if encoding is not None and encoding != "identity":
            task = self.loop.create_task(_refuse_compressed(stream, encoding, release_stream))
            self._tasks[stream] = task
            return
        super().accept(stream, headers, release_stream)


async def _refuse_compressed(
    stream: H2Stream, encoding: str, release_stream: Callable[[], Any]
) -> None:
    """SPEC §1.7: trailers-only UNIMPLEMENTED, and we only accept identity."""
    message = f"Content is compressed with `{encoding}` which isn't supported"
    try:
        await stream.send_headers(
            [
                (":status", "200"),
                ("content-type", "application/grpc"),
                ("grpc-accept-encoding", "identity"),
                ("grpc-status", str(Status.UNIMPLEMENTED.value)),
                ("grpc-message", encode_grpc_message(message)),
            ],
            end_stream=True,
        )
        if stream.closable:
            stream.reset_nowait()
    except Exception:
        log.debug("could not refuse a compressed request", exc_info=True)
    finally:
        release_stream()


class _Protocol(H2Protocol):
    """One HTTP/2 connection; tracked so a stop can GOAWAY and cut every connection."""

    def __init__(self, server: _LoopServer) -> None:
        self.grpc_handler = _Handler(server)
        super().__init__(self.grpc_handler, server.config, server.h2_config)
        self._server = server
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._transport = cast(asyncio.Transport, transport)
        _ensure_nodelay(transport)
        self._server.protocols.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._server.protocols.discard(self)
        super().connection_lost(exc)

    def send_goaway(self, last_stream_id: int) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        self.connection.flush()  # whatever h2 has buffered goes first, whole frames only
        frame = GoAwayFrame(0, last_stream_id=last_stream_id, error_code=0)
        transport.write(frame.serialize())

    def cut(self) -> None:
        """Close the connection (buffered bytes still go out); cancels its handlers."""
        if self._transport is not None and not self._transport.is_closing():
            self.processor.close("server stopped")


# --------------------------------------------------------------------------- Join


class _JoinCall:
    """One Join stream: a reader and a writer task around one session."""

    def __init__(self, server: _LoopServer, stream: Stream[bytes, bytes]) -> None:
        self.server = server
        self.stream = stream
        self.loop = server.loop
        self.timers: dict[int, asyncio.TimerHandle] = {}
        self.inbox: deque[tuple[int, LaneReply]] = deque()  # lane replies, any thread
        self.drain_scheduled = False
        self.outbox: deque[bytes] = deque()
        self.wake_writer = asyncio.Event()
        self.end = asyncio.Event()  # no more requests: finish the stream
        self.attached = True  # sends and timers are still wanted
        self.flushing = False  # the writer exits once the outbox is empty
        self.send_failed = False
        self.sending = False  # the writer is inside a send
        self.session_ended = False  # EndStream performed or on_stream_end() called
        self.reader: asyncio.Task[None] | None = None
        self.status = Status.OK
        self.status_message: str | None = None
        self.session: SessionLike = server.session_factory(
            server.endpoint, post=server.post, reply_to=self.reply_to
        )

    # -- events into the session

    def reply_to(self, token: int) -> ReplyFn:
        inbox = self.inbox
        call_soon = self.loop.call_soon_threadsafe
        drain = self._drain_inbox

        def reply(lane_reply: LaneReply) -> None:  # any thread (a lane's)
            # Replies that arrive while a drain is already scheduled ride along with it:
            # one loop wake-up (a self-pipe write) serves several lanes under load.
            # deque.append is atomic; see _drain_inbox for why no reply is stranded.
            inbox.append((token, lane_reply))
            if not self.drain_scheduled:
                self.drain_scheduled = True
                try:
                    call_soon(drain)
                except RuntimeError:  # the loop is closed: the server is gone
                    log.debug("lane reply after the transport stopped; dropped")

        return reply

    def _drain_inbox(self) -> None:
        # Clear the flag *before* emptying the inbox: a reply appended after the loop
        # below finished then sees the flag down and schedules a new drain.
        self.drain_scheduled = False
        inbox = self.inbox
        while inbox:
            token, lane_reply = inbox.popleft()
            self._drive(self.session.on_lane_reply, token, lane_reply)

    def _on_timer(self, token: int) -> None:
        self.timers.pop(token, None)
        self._drive(self.session.on_timer, token)

    def _drive(self, event: Callable[..., list[Action]], *args: Any) -> None:
        try:
            actions = event(*args)
        except Exception:
            log.exception("the Join session failed on %s", getattr(event, "__name__", event))
            self.fail(Status.INTERNAL, "internal server error")
            return
        self.perform(actions)

    def perform(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                if self.attached and not self.flushing:
                    self._queue(action.response)
            elif isinstance(action, StartTimer):
                if self.attached:
                    old = self.timers.pop(action.token, None)
                    if old is not None:
                        old.cancel()
                    self.timers[action.token] = self.loop.call_later(
                        action.seconds, self._on_timer, action.token
                    )
            elif isinstance(action, CancelTimer):
                handle = self.timers.pop(action.token, None)
                if handle is not None:
                    handle.cancel()
            elif isinstance(action, EndStream):
                self.session_ended = True
                self.finish()
        self.server.join_activity(self)

    def _queue(self, response: env_v1.JoinResponse) -> None:
        data = encode_join_response(response)
        limit = self.server.max_message_bytes
        if len(data) > limit:
            log.error(
                "a JoinResponse of %d bytes exceeds the %d-byte message limit; ending the stream",
                len(data),
                limit,
            )
            self.fail(
                Status.RESOURCE_EXHAUSTED,
                f"encoded message length too large: found {len(data)} bytes, "
                f"the limit is: {limit} bytes",
            )
            return
        self.outbox.append(data)
        self.wake_writer.set()

    def finish(self) -> None:
        """Stop reading; flush what is queued, then end the stream (status as set)."""
        self.flushing = True
        self.wake_writer.set()
        self.end.set()

    def fail(self, status: Status, message: str) -> None:
        if self.status is Status.OK:
            self.status, self.status_message = status, message
        self.finish()

    # -- the stream

    def _end_session(self) -> None:
        if not self.session_ended:
            self.session_ended = True
            self._drive(self.session.on_stream_end)

    @property
    def idle(self) -> bool:
        """Nothing in flight: no request queued or running, nothing left to send."""
        return not (self.session.busy or self.outbox or self.sending)

    def stop_reading(self) -> None:
        """Read no more requests (server stopping); the stream stays open for replies."""
        if self.reader is not None:
            self.reader.cancel()

    def _reader_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return  # stop_reading() or the stream's end: not a reason to end it
        if task.exception() is not None:
            log.debug("Join reader failed: %r", task.exception())
        self.end.set()  # half-close, unreadable request, or a reader failure

    async def run(self) -> None:
        writer: asyncio.Task[None] | None = None
        try:
            # SPEC §1.3: the 0.1.0 clients wait for the response headers before sending.
            await self.stream.send_initial_metadata()
            if self.server.reading:
                self.reader = self.loop.create_task(self._read_loop())
                self.reader.add_done_callback(self._reader_done)
            writer = self.loop.create_task(self._write_loop())
            await self.end.wait()
            self.stop_reading()
            # Half-close, unreadable request or failed send: the session learns the stream
            # ended (SPEC §7.9); after EndStream it already knows.
            self._end_session()
            self.flushing = True
            self.wake_writer.set()
            await writer
            if not self.send_failed:
                await self.stream.send_trailing_metadata(
                    status=self.status, status_message=self.status_message
                )
                h2_stream = _h2(self.stream)
                if h2_stream.closable:
                    # The client has not half-closed: whatever it still sends is not read.
                    h2_stream.reset_nowait()
        except (ConnectionError, h2.exceptions.H2Error, StreamTerminatedError) as exc:
            log.debug("Join stream broke: %r", exc)
        finally:
            for task in (self.reader, writer):
                if task is not None:
                    task.cancel()
            self.attached = False
            for handle in self.timers.values():
                handle.cancel()
            self.timers.clear()
            self.outbox.clear()
            # Cancelled (client reset, disconnect, server cut): the session must know.
            self._end_session()
            self.server.join_activity(self)

    async def _read_loop(self) -> None:
        """Feed requests to the session; return when the stream must end."""
        h2_stream = _h2(self.stream)
        limit = self.server.max_message_bytes
        while not self.end.is_set():
            try:
                data = await _read_message(h2_stream, limit)
            except _Oversize as exc:
                log.warning("Join request refused (%s); ending the Join stream", exc)
                return
            except _BadFrame as exc:
                log.warning("unreadable Join request (%s); ending the Join stream", exc)
                return
            if data is None:
                return  # the client half-closed
            try:
                request = decode_join_request(data)
            except WireDecodeError as exc:
                log.warning("undecodable JoinRequest (%s); ending the Join stream", exc)
                return
            self._drive(self.session.on_request, request)

    async def _write_loop(self) -> None:
        """The one writer: sends in order; a slow send never blocks the reader."""
        try:
            while True:
                while self.outbox:
                    self.sending = True
                    try:
                        await self.stream.send_message(self.outbox.popleft())
                    finally:
                        self.sending = False
                    if not self.outbox:
                        self.server.join_activity(self)
                if self.flushing:
                    return
                self.wake_writer.clear()
                await self.wake_writer.wait()
        except (ConnectionError, h2.exceptions.H2Error, StreamTerminatedError) as exc:
            log.debug("Join send failed (%r); ending the stream", exc)
            self.send_failed = True
            self.attached = False
            self.outbox.clear()
            self.end.set()


# --------------------------------------------------------------------------- the loop side


class _LoopServer:
    """Everything that lives on the transport loop (not thread-safe: loop thread only)."""

    def __init__(self, service: TransportService, loop: asyncio.AbstractEventLoop) -> None:
        options = service.options
        self.loop = loop
        self.endpoint = service.endpoint
        self.post = service.post
        self.session_factory = service.session_factory
        self.max_message_bytes = options.max_message_bytes
        self.drain_timeout = service.drain_timeout
        self.inflight_timeout = service.inflight_timeout
        self.idle_timeout = options.idle_timeout_seconds
        self._on_drained = service.on_drained
        self.closing = False
        self.reading = True  # Join streams read requests (until the drain is over)
        self.stop_reason: str | None = None
        self._drain_joins = True
        self._stop_requested = asyncio.Event()
        self._changed = asyncio.Event()  # a unary call or a Join ended, or busy changed
        self.protocols: set[_Protocol] = set()
        self.join: _JoinCall | None = None
        self._busy: set[_JoinCall] = set()  # Join sessions with work in flight
        self._unary = 0
        self._idle_handle: asyncio.TimerHandle | None = None

        self.codec = _RawCodec()
        self.dispatch = _DispatchServerEvents()
        self.config = Configuration().__for_server__()
        # The same h2 settings grpclib's Server uses.
        self.h2_config = h2.config.H2Configuration(
            client_side=False,
            header_encoding="ascii",
            validate_inbound_headers=False,
            validate_outbound_headers=False,
            normalize_inbound_headers=False,
            normalize_outbound_headers=False,
        )
        unary = Cardinality.UNARY_UNARY
        self.mapping = _Mapping(
            {
                HANDSHAKE_PATH: MethodHandler(
                    self._unary_call(self._handshake), unary, bytes, bytes
                ),
                SHUTDOWN_PATH: MethodHandler(self._unary_call(self._shutdown), unary, bytes, bytes),
                JOIN_PATH: MethodHandler(self._join, Cardinality.STREAM_STREAM, bytes, bytes),
                HEALTH_CHECK_PATH: MethodHandler(
                    self._unary_call(self._health_check), unary, bytes, bytes
                ),
            },
            fallback=MethodHandler(self._unknown, Cardinality.STREAM_STREAM, bytes, bytes),
        )

    # -- lifecycle

    async def serve(self, sock: socket.socket, on_listening: Callable[[], None]) -> None:
        if sock.family == socket.AF_UNIX:
            server = await self.loop.create_unix_server(self._make_protocol, sock=sock)
        else:
            server = await self.loop.create_server(self._make_protocol, sock=sock)
        try:
            if not self._stop_requested.is_set():
                on_listening()
                self._arm_idle()
            await self._stop_requested.wait()
        finally:
            await self._stop(server)

    def _make_protocol(self) -> _Protocol:
        return _Protocol(self)

    def request_stop(self, reason: str, *, drain: bool = True) -> None:
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        self._drain_joins = drain
        log.info("transport stopping: %s", reason)
        self._stop_requested.set()

    async def _stop(self, server: asyncio.AbstractServer) -> None:
        """Stop in phases, every wait bounded.

        1. Close the listener, send GOAWAY (twice, like the reference).
        2. Drain (graceful stops only): open streams are served as usual, new requests
           included, until they all ended or ``drain_timeout`` passed.
        3. Read no more requests and tell the owner (``on_drained``: the lanes may start
           closing now); a request still in flight gets its reply if it completes within
           ``inflight_timeout`` (the lanes finish their current job while they close).
        4. Cut the connections (no trailers: clients see UNAVAILABLE) and let the
           handlers unwind.
        """
        self.closing = True
        self._cancel_idle()
        server.close()
        for proto in list(self.protocols):
            proto.send_goaway(_MAX_STREAM_ID)
        await asyncio.sleep(GOAWAY_GAP)
        for proto in list(self.protocols):
            proto.send_goaway(proto.grpc_handler.last_stream_id)
        if self._drain_joins:
            try:
                await asyncio.wait_for(self._until(self._streams_done), self.drain_timeout)
            except asyncio.TimeoutError:
                log.info(
                    "drain bound of %.3g s expired with %d stream(s) open",
                    self.drain_timeout,
                    self._unary + (self.join is not None),
                )
        self.reading = False
        if self.join is not None:
            self.join.stop_reading()
        self._notify_drained()
        try:
            await asyncio.wait_for(self._until(self._nothing_in_flight), self.inflight_timeout)
        except asyncio.TimeoutError:
            log.warning(
                "requests still in flight %.3g s after the drain; cutting them",
                self.inflight_timeout,
            )
        handlers = [proto.grpc_handler for proto in self.protocols]
        for proto in list(self.protocols):
            proto.cut()
        waits = [self.loop.create_task(handler.wait_closed()) for handler in handlers]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=CUT_TIMEOUT)
            for task in pending:
                task.cancel()
            if pending:
                log.warning("request handlers did not unwind within %.3g s", CUT_TIMEOUT)
        # Python >= 3.12: wait_closed() waits for every connection; they are cut, but bound it.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), CUT_TIMEOUT)

    def _streams_done(self) -> bool:
        return not self._unary and self.join is None

    def _nothing_in_flight(self) -> bool:
        return not self._unary and (self.join is None or self.join.idle)

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self._changed.clear()
            await self._changed.wait()

    def _notify_drained(self) -> None:
        if self._on_drained is not None:
            try:
                self._on_drained()
            except Exception:
                log.exception("the on_drained callback failed")

    # -- idle timer (SPEC §10.4)

    def join_activity(self, call: _JoinCall) -> None:
        """After every Join event: track busy sessions, re-arm the idle timer."""
        if call.session.busy:
            self._busy.add(call)
        else:
            self._busy.discard(call)
        self._changed.set()
        self._arm_idle()

    def _arm_idle(self) -> None:
        self._cancel_idle()
        if self.idle_timeout is None or self.closing or self._busy:
            return
        self._idle_handle = self.loop.call_later(self.idle_timeout, self._idle_expired)

    def _cancel_idle(self) -> None:
        if self._idle_handle is not None:
            self._idle_handle.cancel()
            self._idle_handle = None

    def _idle_expired(self) -> None:
        self._idle_handle = None
        if not self._busy:
            # An open but silent Join does not hold the server: cut it at once.
            self.request_stop(f"idle for {self.idle_timeout:g} s", drain=False)

    # -- handlers

    def _unary_call(
        self, handler: Callable[[Stream[bytes, bytes]], Awaitable[None]]
    ) -> Callable[[Stream[bytes, bytes]], Awaitable[None]]:
        async def counted(stream: Stream[bytes, bytes]) -> None:
            self._unary += 1
            try:
                await handler(stream)
            finally:
                self._unary -= 1
                self._changed.set()

        return counted

    async def _read_unary(self, stream: Stream[bytes, bytes]) -> bytes:
        try:
            data = await _read_message(_h2(stream), self.max_message_bytes)
        except _Oversize as exc:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from None
        except _BadFrame as exc:
            raise GRPCError(Status.INTERNAL, str(exc)) from None
        if data is None:
            raise GRPCError(Status.INTERNAL, "missing request message")
        return data

    async def _unary_request(self, stream: Stream[bytes, bytes], cls: type[_M]) -> _M:
        """Read and strictly decode a unary request; malformed input is gRPC INTERNAL."""
        data = await self._read_unary(stream)
        try:
            return decode_message(cls, data)
        except DecodeError as exc:
            raise GRPCError(Status.INTERNAL, str(exc)) from None

    async def _handshake(self, stream: Stream[bytes, bytes]) -> None:
        request = await self._unary_request(stream, env_v1.HandshakeRequest)
        try:
            response = self.endpoint.handshake(request)
        except InvalidRequestError as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
        await stream.send_message(bytes(response))
        await stream.send_trailing_metadata()

    async def _shutdown(self, stream: Stream[bytes, bytes]) -> None:
        request = await self._unary_request(stream, env_v1.ShutdownRequest)
        try:
            response, stop = self.endpoint.shutdown(request)
        except InvalidRequestError as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
        await stream.send_message(bytes(response))
        await stream.send_trailing_metadata()
        if stop:
            self.request_stop("remote shutdown accepted")

    async def _health_check(self, stream: Stream[bytes, bytes]) -> None:
        data = await self._read_unary(stream)
        try:
            # grpc.health.v1.HealthCheckRequest: field 1 is the service name.
            service = read_string_field(data)
        except WireDecodeError as exc:
            raise GRPCError(Status.INTERNAL, str(exc)) from None
        if service not in ("", SERVICE_NAME):
            raise GRPCError(Status.NOT_FOUND, f"unknown service {service!r}")
        status = _HEALTH_NOT_SERVING if self.closing else _HEALTH_SERVING
        await stream.send_message(bytes([0x08, status]))
        await stream.send_trailing_metadata()

    async def _unknown(self, stream: Stream[bytes, bytes]) -> None:
        await stream.send_trailing_metadata(status=Status.UNIMPLEMENTED)

    async def _join(self, stream: Stream[bytes, bytes]) -> None:
        if self.closing:
            await stream.send_trailing_metadata(
                status=Status.UNAVAILABLE, status_message="server is shutting down"
            )
            return
        if self.join is not None:
            await stream.send_trailing_metadata(
                status=Status.FAILED_PRECONDITION, status_message=ALREADY_JOINED
            )
            return
        try:
            call = _JoinCall(self, stream)
        except Exception:
            log.exception("could not start a Join session")
            raise GRPCError(Status.INTERNAL, "internal server error") from None
        self.join = call
        self._arm_idle()
        try:
            await call.run()
        finally:
            self.join = None
            self._changed.set()
            self._arm_idle()


# --------------------------------------------------------------------------- the Trio side


class TransportService:
    """The gRPC side of one server, on its own thread and asyncio loop.

    ``listener`` is a bound, listening socket (TCP or unix) that the service takes over
    and closes. ``post`` is the lane engine's thread-safe ``post``; ``endpoint`` answers
    Handshake and Shutdown; each Join gets ``session_factory(endpoint, post=...,
    reply_to=...)``.

    Run it with ``await nursery.start(service.run)``. Stop it with :meth:`request_stop`
    (any thread), a Shutdown RPC the endpoint accepts, the idle timeout, or by cancelling
    ``run``. A stop drains for at most ``drain_timeout_seconds`` (skipped for the idle
    timeout), then calls ``on_drained()`` -- once, on the transport thread: no new request
    will be served, so the owner may start closing the lanes -- and gives a request still
    in flight up to ``close_timeout_seconds`` (+1 s) to be answered before the connections
    are cut. :attr:`stop_timeout` bounds the whole stop.
    """

    def __init__(
        self,
        endpoint: EndpointLike,
        *,
        post: Callable[[int, Job], None],
        listener: socket.socket,
        options: ServeOptions | None = None,
        session_factory: SessionFactory = Session,
        on_drained: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.post = post
        self.options = options if options is not None else ServeOptions()
        self.session_factory = session_factory
        self.on_drained = on_drained
        drain = self.options.drain_timeout_seconds
        self.drain_timeout = DEFAULT_DRAIN_TIMEOUT if drain is None else float(drain)
        if not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout_seconds must be >= 0, got {drain!r}")
        close = self.options.close_timeout_seconds
        close_timeout = DEFAULT_CLOSE_TIMEOUT if close is None else float(close)
        if not close_timeout >= 0:
            raise ValueError(f"close_timeout_seconds must be >= 0, got {close!r}")
        self.inflight_timeout = close_timeout + INFLIGHT_SLACK
        idle = self.options.idle_timeout_seconds
        if idle is not None and not idle > 0:
            raise ValueError(f"idle_timeout_seconds must be > 0 or None, got {idle!r}")
        self._listener = listener
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_server: _LoopServer | None = None
        self._early_stop: str | None = None
        self._error: BaseException | None = None
        self._stop_reason: str | None = None
        self._ran = False
        self.listening = False
        """True once :meth:`run` called ``task_status.started()``."""

    @property
    def stop_timeout(self) -> float:
        """Upper bound, in seconds, from a stop request until :meth:`run` has returned."""
        return (
            self.drain_timeout
            + self.inflight_timeout
            + GOAWAY_GAP
            + 2 * CUT_TIMEOUT
            + THREAD_EXIT_TIMEOUT
        )

    @property
    def stop_reason(self) -> str | None:
        """Why the transport stopped (None while it runs)."""
        return self._stop_reason

    def request_stop(self, reason: str = "stop requested") -> None:
        """Begin a graceful stop (GOAWAY, drain, cut); any thread, idempotent, no wait."""
        with self._lock:
            loop, server = self._loop, self._loop_server
            if loop is None or server is None:
                self._early_stop = self._early_stop or reason
                return
        with contextlib.suppress(RuntimeError):  # loop already closed: stopped anyway
            loop.call_soon_threadsafe(server.request_stop, reason)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until stopped. ``task_status.started()`` once the loop serves the socket.

        Raises the transport's startup error (e.g. the loop could not serve the socket) or
        a crash of its loop. On cancellation it requests a graceful stop and waits for the
        thread, shielded but bounded by :attr:`stop_timeout`; a thread still running then
        is abandoned (it is a daemon) and named in the log.
        """
        if self._ran:
            raise RuntimeError("TransportService.run() can only be called once")
        self._ran = True
        token = trio.lowlevel.current_trio_token()
        listening = trio.Event()
        stopped = trio.Event()
        changed = trio.Event()

        def notify(event: trio.Event) -> None:
            def set_both() -> None:
                event.set()
                changed.set()

            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(set_both)

        thread = threading.Thread(
            target=self._thread_main,
            args=(lambda: notify(listening), lambda: notify(stopped)),
            name="rlmesh-trio-transport",
            daemon=True,
        )
        thread.start()
        try:
            await changed.wait()
            if listening.is_set():
                self.listening = True
                task_status.started()
                await stopped.wait()
        finally:
            if not stopped.is_set():
                self.request_stop("cancelled")
                with trio.move_on_after(self.stop_timeout, shield=True):
                    await stopped.wait()
                if not stopped.is_set():
                    log.error(
                        "transport thread %r did not stop within %.3g s; abandoning it",
                        thread.name,
                        self.stop_timeout,
                    )
        # The thread has posted its last event and is returning.
        thread.join(timeout=THREAD_EXIT_TIMEOUT)
        if self._error is not None:
            raise self._error

    def _thread_main(
        self, on_listening: Callable[[], None], on_stopped: Callable[[], None]
    ) -> None:
        loop = asyncio.SelectorEventLoop()
        try:
            loop.run_until_complete(self._amain(loop, on_listening))
        except Exception as exc:
            self._error = exc
        finally:
            try:
                _close_loop(loop)
            except Exception:
                log.exception("closing the transport loop failed")
            finally:
                with contextlib.suppress(OSError):
                    self._listener.close()
                on_stopped()

    async def _amain(
        self, loop: asyncio.AbstractEventLoop, on_listening: Callable[[], None]
    ) -> None:
        server = _LoopServer(self, loop)
        with self._lock:
            self._loop, self._loop_server = loop, server
            early = self._early_stop
        if early is not None:
            server.request_stop(early)
        try:
            await server.serve(self._listener, on_listening)
        finally:
            self._stop_reason = server.stop_reason or "stopped"
            with self._lock:
                self._loop_server = None


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on the loop (bounded), then close it."""
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=CUT_TIMEOUT))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
