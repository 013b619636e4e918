"""Every use of a grpclib (or h2) private, listed here, in this file and (the direct DATA
path over h2's internals) :mod:`._h2frames`: a grpclib or h2 upgrade is two files to read.

grpclib is pinned (0.4.9); each use below is covered by the transport tests:

* ``grpclib.server.Handler`` is subclassed (:class:`Dispatcher`) to see request headers
  before dispatch: refuse streams while stopping, refuse compressed requests, remember
  the last stream id for GOAWAY.
* ``grpclib.protocol.H2Protocol`` is subclassed (:class:`Connection`) to track
  connections, write GOAWAY frames, cut connections, and answer an HTTP/2 protocol error
  with the GOAWAY h2 prepared (grpclib closes without sending it; this reads the h2
  connection inside grpclib's ``Connection._connection``). An over-long frame is refused
  on its header by the frame gate (:mod:`._flood`), which needs no private.
* ``grpclib.server.Stream._stream`` (the h2-level stream) is read directly, so a message's
  length prefix is read before its body and a big body is copied into one buffer as it
  arrives instead of being joined from thousands of chunks at the end.
* ``grpclib.events._DispatchServerEvents`` and ``Configuration.__for_server__`` build the
  handler as ``grpclib.server.Server`` does.
* The Join's fast path (issue 9): :class:`StreamSender` writes a reply's DATA frames with
  the h2 connection (``Stream._h2_connection``, ``_transport``, grpclib's
  ``Connection.write_ready``) at once when the flow-control window and the socket take
  them, and :class:`RequestReader` takes a stream's DATA out of :class:`Connection`'s
  ``data_received`` (the events never reach grpclib's per-stream ``Buffer``; what
  arrived before it attached is taken from ``Buffer._unacked``) and acknowledges it to
  h2 (``acknowledge_received_data``) only as it is consumed; :func:`send_framed` sends
  an already framed message with grpclib's h2-level ``Stream.send_data`` (its flow
  control and write-ready waits), so a big reply is not framed, and copied, again.
* The direct DATA path (issue 20): :func:`route_frames` hands a Join stream's plain DATA
  frames to its reader without h2's frame objects and events, and :func:`put_plain_data`
  queues a reply's DATA frames on h2's output (``_data_to_send``) without them. Both
  change exactly what h2's ``receive_data`` / ``send_data`` would change, which reads and
  writes h2 privates: the frame buffer's ``_data``, ``_preamble_len`` and
  ``_headers_buffer`` (h2 holds nothing), the connection's and streams' state machines,
  ``_inbound_flow_control_window_manager``, a stream's ``_inbound_window_manager``,
  ``_expected_content_length`` and ``_actual_content_length``, and both outbound
  windows. Anything else goes through h2. ``tests/test_transport_shim.py`` feeds the
  same byte streams to h2 alone and to this path and compares everything observable.

* Flood limits and refusals (issue 28; :mod:`._flood` itself touches neither library):
  :class:`Connection` asks h2's public ``highest_inbound_stream_id``, ``streams`` and a
  stream's ``closed`` for the gate's stream states, and grpclib's
  ``EventsProcessor.streams`` for the streams dispatched and not yet released; it swaps
  the class of h2's ``local_settings`` for :class:`_EarlyStreams` (a subclass of the
  public ``h2.settings.Settings``) so that h2's own stream limit sits above the one we
  advertise and the streams past it are refused one by one; it ignores the events
  grpclib's processor has no handler for (it raises ``NotImplementedError``).

* Server reflection (:mod:`._reflection`) uses grpclib's servicers, built with their
  underscored constructor argument ``_service_names`` and their ``_pool`` attribute set
  to our own descriptor pool (the public ``ServerReflection.extend`` names services
  from servicer objects, which ours are not; 0.4.8 has no ``_pool`` argument), the
  v1alpha one from ``grpclib.reflection._deprecated`` (:func:`reflection_servicers`).

h2 cannot send a GOAWAY and keep serving the open streams (its state machine closes the
connection), so the GOAWAY frames of a graceful stop are written next to it with
hyperframe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import h2.config
import h2.events
import h2.exceptions
import h2.settings
from grpclib.config import Configuration
from grpclib.const import Handler as MethodHandler
from grpclib.const import Status
from grpclib.encoding.base import CodecBase
from grpclib.events import _DispatchServerEvents
from grpclib.protocol import H2Protocol
from grpclib.server import Handler as GrpclibHandler
from grpclib.server import Stream
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame

from .._errors import CompressedRequestError, FrameError, UnauthenticatedError, WireError
from .._logging import RateLimit
from .._wire import PREFIX_SIZE, SMALL_MESSAGE, MessageReader, encode_grpc_message, parse_prefix
from ._flood import ADVERTISED_STREAMS, STREAMS_HARD_LIMIT, Flood, FrameGate
from ._h2frames import put_plain_data, route_frames
from ._headers import (
    HEADER_ENCODING,
    Verdict,
    check_request_headers,
    for_dispatch,
    header_value,
)

if TYPE_CHECKING:
    from grpclib.protocol import Stream as H2Stream

log = logging.getLogger("rlmesh_trio.transport")

CHUNK = 1 << 20
"""Bytes read from grpclib's stream buffer at a time for a big message."""

CLOSE_LINGER = 2.0
"""Seconds a connection we closed may take to hand its last bytes (a GOAWAY) to a client
before it is aborted: a client that never reads would otherwise keep it, and its buffer,
forever."""

_REPORTS = RateLimit()
"""At most a few log lines about hostile or broken connections per window, whatever
their number."""

ACK_BATCH = 256 << 10
"""Consumed request bytes are acknowledged to h2 in batches of this size (h2 sends a
WINDOW_UPDATE only once half the 4 MiB window is consumed anyway); a stream's end, a
pause and a detach acknowledge what is left."""


class Admission(Protocol):
    """What :class:`Dispatcher` asks the server about each new stream."""

    @property
    def closing(self) -> bool: ...

    def authorized(self, path: str | None, authorization: str | None) -> bool: ...

    def refuse(self, stream: H2Stream, error: Exception, release: Callable[[], Any]) -> Any: ...


class RawCodec(CodecBase):
    """Messages cross grpclib as bytes: the transport encodes and decodes them itself."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        if not isinstance(message, bytes):
            raise TypeError(f"expected bytes, got {type(message).__name__}")
        return message

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


class MethodTable(dict[str, MethodHandler]):
    """grpclib's method table, answering unknown paths with our own handler.

    grpclib's own answer omits ``content-type`` from the trailers-only response; the
    reference (and strict clients) have it.
    """

    def __init__(self, methods: dict[str, MethodHandler], fallback: MethodHandler) -> None:
        super().__init__(methods)
        self._fallback = fallback

    def get(self, key: str, default: Any = None) -> MethodHandler:
        return super().get(key, self._fallback)


def server_config() -> tuple[Configuration, h2.config.H2Configuration]:
    """grpclib's server configuration, and the h2 settings grpclib's Server uses."""
    h2_config = h2.config.H2Configuration(
        client_side=False,
        header_encoding=HEADER_ENCODING,  # total: a non-ASCII byte cannot fail to decode
        validate_inbound_headers=False,
        validate_outbound_headers=False,
        normalize_inbound_headers=False,
        normalize_outbound_headers=False,
    )
    return Configuration().__for_server__(), h2_config


def h2_stream(stream: Stream[Any, Any]) -> H2Stream:
    raw: H2Stream = stream._stream
    return raw


def _count(headers: list[tuple[str, str]], name: str) -> int:
    return sum(1 for key, _ in headers if key == name)


class Dispatcher(GrpclibHandler):
    """One per connection: grpclib's request dispatcher, with our admission checks."""

    def __init__(self, admission: Admission, mapping: MethodTable, codec: CodecBase) -> None:
        super().__init__(mapping, codec, None, _DispatchServerEvents())
        self._admission = admission
        self.last_stream_id = 0
        # Set by the connection: a header block that is a connection error (GOAWAY);
        # how many streams it has dispatched and not released; a stream refused.
        self.on_connection_error: Callable[[], None] | None = None
        self.streams_in_use: Callable[[], int] = lambda: 0
        self.on_refused: Callable[[], None] = lambda: None

    def accept(
        self, stream: H2Stream, headers: list[tuple[str, str]], release_stream: Callable[[], Any]
    ) -> None:
        # grpclib registered this stream before calling us: it counts itself.
        if self._admission.closing or self.streams_in_use() > ADVERTISED_STREAMS:
            # After GOAWAY, or past our MAX_CONCURRENT_STREAMS (a client may open more
            # before it read our SETTINGS): "not processed, safe to retry", this stream
            # alone (RFC 9113 §5.1.2, §8.7).
            if stream.closable:  # not already reset by the client
                stream.reset_nowait(ErrorCodes.REFUSED_STREAM)
                self.on_refused()
            release_stream()
            return
        verdict, repeated = check_request_headers(headers)
        if verdict is not Verdict.OK:
            # The reference's answers to a malformed header block (see _headers.py).
            log.debug("malformed request headers: %s", verdict.value)
            if verdict is Verdict.RESET_STREAM:
                if stream.closable:
                    stream.reset_nowait(ErrorCodes.PROTOCOL_ERROR)
                    self.on_refused()
            elif self.on_connection_error is not None:
                self.on_connection_error()
            release_stream()
            return
        if stream.id is not None:
            self.last_stream_id = max(self.last_stream_id, stream.id)
        # With a token, a repeated authorization is refused: which one would count?
        ambiguous = repeated and _count(headers, "authorization") > 1
        headers = for_dispatch(headers, repeated)
        error: Exception | None = None
        # Pseudo-headers are unique here: this :path is the one grpclib dispatches on.
        path = header_value(headers, ":path")
        if not self._admission.authorized(path, header_value(headers, "authorization")) or (
            ambiguous and not self._admission.authorized(path, None)
        ):
            error = UnauthenticatedError()
        else:
            encoding = header_value(headers, "grpc-encoding")
            if encoding is not None and encoding != "identity":
                error = CompressedRequestError(encoding)
        if error is not None:
            task = self.loop.create_task(self._admission.refuse(stream, error, release_stream))
            self._tasks[stream] = task
            return
        super().accept(stream, headers, release_stream)


async def send_trailers_only(
    stream: H2Stream, status: int, message: str, release_stream: Callable[[], Any]
) -> None:
    """A trailers-only response on an h2 stream grpclib has not wrapped (SPEC §1.5, §1.7)."""
    try:
        await stream.send_headers(
            [
                (":status", "200"),
                ("content-type", "application/grpc"),
                ("grpc-accept-encoding", "identity"),
                ("grpc-status", str(Status(status).value)),
                ("grpc-message", encode_grpc_message(message)),
            ],
            end_stream=True,
        )
        if stream.closable:
            stream.reset_nowait()
    except Exception:
        log.debug("could not send a trailers-only response", exc_info=True)
    finally:
        release_stream()


def ensure_nodelay(transport: asyncio.BaseTransport) -> None:
    """Pipelined lane requests stall ~40 ms per round on TCP without TCP_NODELAY."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        if not sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _EarlyStreams(h2.settings.Settings):
    """Our local SETTINGS, but h2 lets in up to :data:`STREAMS_HARD_LIMIT` open streams
    where the value sent (and every other use of it) says :data:`ADVERTISED_STREAMS`:
    the streams past it are refused one by one by :class:`Dispatcher`, not by a GOAWAY
    that loses the connection's other calls. h2 reads this property for exactly that
    check (an h2 that does not leaves the check as it was: a GOAWAY)."""

    @property
    def max_concurrent_streams(self) -> int:
        return max(super().max_concurrent_streams, STREAMS_HARD_LIMIT)

    @max_concurrent_streams.setter
    def max_concurrent_streams(self, value: int) -> None:
        h2.settings.Settings.max_concurrent_streams.fset(self, value)  # type: ignore[attr-defined]


class Connection(H2Protocol):
    """One HTTP/2 connection; tracked so a stop can GOAWAY and cut every connection.

    Every byte the client sends passes a :class:`~._flood.FrameGate` first: past a flood
    limit the connection gets GOAWAY(ENHANCE_YOUR_CALM) and is closed; a read of more than
    :data:`~._flood.FRAMES_PER_TURN` frames is taken over several turns of the loop
    (reading paused meanwhile), so that other connections are served in between.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        config: Configuration,
        h2_config: h2.config.H2Configuration,
        registry: set[Connection],
    ) -> None:
        super().__init__(dispatcher, config, h2_config)
        self.dispatcher = dispatcher
        self._registry = registry
        self._transport: asyncio.Transport | None = None
        self.readers: dict[int, RequestReader] = {}  # stream id -> its direct reader
        self._malformed = False  # a header block was a connection error
        self._held: bytes | None = None  # the rest of a read, for the next turn
        self._lost = False
        self._gate: FrameGate | None = None
        dispatcher.on_connection_error = self._on_malformed_headers
        dispatcher.streams_in_use = self._streams_in_use

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not alpn_is_h2(transport):
            # Before a byte of HTTP/2 (Python's TLS layer cannot refuse inside the
            # handshake: OpenSSL goes on without ALPN when nothing matches).
            _report("a TLS client that did not negotiate h2 by ALPN was refused")
            self._lost = True
            cast(asyncio.Transport, transport).abort()
            return
        super().connection_made(transport)
        self._transport = cast(asyncio.Transport, transport)
        loop = asyncio.get_running_loop()
        h2_connection = self.connection._connection
        self._gate = FrameGate(
            loop.time,
            self._stream_open,
            self._output_backlog,
            h2_connection.max_inbound_frame_size,
        )
        self.dispatcher.on_refused = self._gate.refused
        settings = self.connection._connection.local_settings
        if type(settings) is h2.settings.Settings:
            settings.__class__ = _EarlyStreams
        ensure_nodelay(transport)
        self._registry.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._transport is None:
            return  # refused in connection_made: grpclib never saw it
        self._lost = True
        self._held = None
        self._registry.discard(self)
        super().connection_lost(exc)

    # -- what the gate needs to know

    def _streams_in_use(self) -> int:
        processor = getattr(self, "processor", None)
        return 0 if processor is None else len(processor.streams)

    def _stream_open(self, stream_id: int) -> bool | None:
        h2_connection = self.connection._connection
        if stream_id > h2_connection.highest_inbound_stream_id:
            return None
        stream = h2_connection.streams.get(stream_id)
        return stream is not None and not stream.closed

    def _output_backlog(self) -> int:
        transport = self._transport
        return 0 if transport is None else transport.get_write_buffer_size()

    # -- the client's bytes

    def data_received(self, data: bytes) -> None:
        """The connection's bytes, a turn's worth at a time (:meth:`_take`)."""
        if self._held is not None:  # reading is paused; a TLS layer may still hand some
            self._held += data
            return
        try:
            self._take(data)
        except Exception as exc:  # never asyncio's "Fatal error on transport"
            _report("a connection's input could not be handled; GOAWAY and close", exc)
            self._goaway_and_close(ErrorCodes.INTERNAL_ERROR, exc)

    def _take(self, data: bytes) -> None:
        gate = self._gate
        assert gate is not None
        end = gate.scan(data)
        if end:
            self._deliver(data if end == len(data) else data[:end])
        if gate.flood is not None:
            self._flood(gate.flood)
            return
        if end < len(data) and not self._closing():
            self._held = data[end:]
            assert self._transport is not None
            self._transport.pause_reading()
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        held, self._held = self._held, None
        if held is None or self._closing():
            return
        self.data_received(held)
        if self._held is None and not self._closing():
            assert self._transport is not None
            self._transport.resume_reading()

    def _flood(self, flood: Flood) -> None:
        """A limit passed: GOAWAY with its code, naming the last stream h2 saw, and close."""
        self._held = None
        if self._closing():
            return
        code = ErrorCodes(flood.code)
        if code is ErrorCodes.FRAME_SIZE_ERROR:  # a protocol error, not a flood
            log.debug("HTTP/2 protocol error: %s; GOAWAY and close", flood.reason)
        else:
            _report(f"HTTP/2 flood from {self._peer()}: {flood.reason}; GOAWAY({code.name})")
        with contextlib.suppress(Exception):
            h2_connection = self.connection._connection
            h2_connection.close_connection(
                error_code=code, last_stream_id=h2_connection.highest_inbound_stream_id
            )
        self._protocol_error(h2.exceptions.ProtocolError(flood.reason))

    def _peer(self) -> str:
        peer = None if self._transport is None else self._transport.get_extra_info("peername")
        return "a client" if not peer else str(peer)

    def _deliver(self, data: bytes) -> None:
        """Plain DATA frames of a stream with a direct reader go straight to it
        (:func:`take_plain_data`: h2's flow-control windows and stream bookkeeping
        updated exactly as h2 would), every other frame through h2 and grpclib
        (:meth:`_receive_h2`), in arrival order."""
        readers = self.readers
        if not readers:
            self._receive_h2(data)
            return
        told = [reader.on_read for reader in readers.values() if reader.on_read is not None]
        for on_read in told:
            on_read(True)
        try:
            if route_frames(
                self.connection._connection, data, readers, self._receive_h2, self._closing
            ):
                self.connection.flush()  # the WINDOW_UPDATEs of what the readers consumed
        finally:
            for on_read in told:
                on_read(False)

    def _closing(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def _receive_h2(self, data: bytes) -> bool:
        """grpclib's ``data_received``, but a protocol error sends h2's GOAWAY first.

        On a protocol error (garbage after the preface, a frame over our MAX_FRAME_SIZE,
        ...) h2 queues a GOAWAY with the error's code and raises; grpclib would close the
        transport without writing it. The reference sends GOAWAY (PROTOCOL_ERROR /
        FRAME_SIZE_ERROR) and closes: so do we. False when the connection is closing.
        """
        try:
            events = self.connection.feed(data)
        except h2.exceptions.ProtocolError as exc:
            self._protocol_error(exc)
            return False
        except Exception as exc:  # never asyncio's "Fatal error on transport"
            log.debug("unreadable HTTP/2 input; GOAWAY and close", exc_info=True)
            self._goaway_and_close(ErrorCodes.PROTOCOL_ERROR, exc)
            return False
        self.connection.flush()
        readers = self.readers
        processor = self.processor
        for event in events:
            if isinstance(event, h2.events.DataReceived) and not event.data:
                # An empty DATA frame (legal; padding only, or nothing): grpclib's Buffer
                # would take it for the stream's end. Its padding is given back at once.
                self._ack_padding(event)
                continue
            if isinstance(event, h2.events.UnknownFrameReceived):
                continue  # an extension frame: ignored (RFC 9113 §4.1, §5.5)
            if readers:
                # A stream with a direct reader: its DATA goes to the reader, not to
                # grpclib's per-stream Buffer (and its reader task).
                if isinstance(event, h2.events.DataReceived):
                    reader = readers.get(event.stream_id)
                    if reader is not None:
                        reader.feed(event.data, event.flow_controlled_length)
                        continue
                elif isinstance(event, h2.events.StreamEnded):
                    reader = readers.get(event.stream_id)
                    if reader is not None:
                        reader.end()
            try:
                processor.process(event)
            except NotImplementedError:
                log.debug("an HTTP/2 event grpclib does not handle: %r; ignored", event)
            if self._malformed:
                self._goaway_and_close(ErrorCodes.PROTOCOL_ERROR, None)
                return False
        self.connection.flush()
        return not self._closing()

    def _ack_padding(self, event: h2.events.DataReceived) -> None:
        size = event.flow_controlled_length
        if size and event.stream_id is not None:
            with contextlib.suppress(h2.exceptions.H2Error):
                self.connection._connection.acknowledge_received_data(size, event.stream_id)

    def _on_malformed_headers(self) -> None:
        self._malformed = True

    def _goaway_and_close(self, code: ErrorCodes, exc: Exception | None) -> None:
        """GOAWAY(``code``) naming the last stream dispatched, then close (the
        reference's answer to a header field HTTP cannot carry)."""
        with contextlib.suppress(Exception):
            self.connection._connection.close_connection(
                error_code=code, last_stream_id=self.dispatcher.last_stream_id
            )
        self._protocol_error(exc or h2.exceptions.ProtocolError("malformed header block"))

    def _protocol_error(self, exc: Exception) -> None:
        """Write what h2 queued (its GOAWAY last), then close."""
        log.debug("HTTP/2 protocol error (%r); GOAWAY and close", exc)
        transport = self._transport
        with contextlib.suppress(Exception):
            pending = self.connection._connection.data_to_send()
            if pending and transport is not None and not transport.is_closing():
                transport.write(pending)
        self.processor.close("Protocol error")
        self._abort_later()

    def _abort_later(self) -> None:
        """Abort the closed connection if it is still there after :data:`CLOSE_LINGER`."""
        transport = self._transport
        if transport is None or self._lost:
            return

        def abort() -> None:
            if not self._lost:
                transport.abort()

        asyncio.get_running_loop().call_later(CLOSE_LINGER, abort)

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
            self._abort_later()


def _report(message: str, exc: BaseException | None = None) -> None:
    """One rate-limited warning (:data:`_REPORTS`) about a connection."""
    held = _REPORTS.allow()
    if held is None:
        return
    suffix = f" ({held} similar held back)" if held else ""
    log.warning("%s%s", message, suffix, exc_info=exc)


def alpn_is_h2(transport: asyncio.BaseTransport) -> bool:
    """Not TLS, or TLS whose ALPN agreed on ``h2`` (gRPC over TLS needs it, RFC 9113
    §3.2): a client that offered only ``http/1.1``, or nothing, would not speak HTTP/2."""
    ssl_object = transport.get_extra_info("ssl_object")
    return ssl_object is None or ssl_object.selected_alpn_protocol() == "h2"


async def read_message(stream: Stream[Any, Any], limit: int) -> bytes | bytearray | None:
    """Read one length-prefixed message; None when the client half-closed.

    The prefix is read first, so an over-size message is refused before its body is
    buffered (:class:`~rlmesh_trio._errors.MessageTooLarge`); a big body is appended to
    one ``bytearray`` as it arrives (no buffer is ever sized from the declared length). Raises :class:`~rlmesh_trio._errors.FrameError` for a
    truncated or compressed message.
    """
    raw = h2_stream(stream)
    try:
        prefix = await raw.recv_data(PREFIX_SIZE)
        if not prefix:
            return None
        length = parse_prefix(prefix, limit)
        if length <= SMALL_MESSAGE:
            data: bytes | bytearray = await raw.recv_data(length)
            if len(data) != length:
                raise FrameError("truncated message")
            return data
        # Grown as the body arrives, never sized from the prefix: a prefix that lies
        # about its length costs nothing until the bytes themselves come.
        buffer = bytearray()
        while len(buffer) < length:
            chunk = await raw.recv_data(min(CHUNK, length - len(buffer)))
            if not chunk:
                raise FrameError("truncated message")
            buffer += chunk
            del chunk
        return buffer
    except AssertionError as exc:  # grpclib's Buffer: EOF inside a message
        raise FrameError("truncated message") from exc


def reflection_servicers(service_names: tuple[str, ...], pool: Any) -> tuple[Any, Any]:
    """grpclib's reflection servicers (v1, v1alpha) answering from ``pool``."""
    from grpclib.reflection._deprecated import ServerReflection as V1Alpha
    from grpclib.reflection.service import ServerReflection as V1

    servicers = (V1(_service_names=service_names), V1Alpha(_service_names=service_names))
    for servicer in servicers:
        # grpclib 0.4.9 takes ``_pool=`` too, 0.4.8 does not; both keep it in ``_pool``.
        servicer._pool = pool
    return servicers


async def send_framed(stream: Stream[Any, Any], payload: bytes) -> None:
    """Send a framed gRPC message (prefix included) as grpclib's ``send_message`` would,
    flow control and all, without grpclib framing it again (one copy less of a big
    reply). The stream's initial metadata must have been sent."""
    await h2_stream(stream).send_data(payload)


def reset_if_open(stream: Stream[Any, Any]) -> None:
    """After our trailers: whatever the client still sends on this stream is not read."""
    raw = h2_stream(stream)
    if raw.closable:
        raw.reset_nowait()


def find_connection(stream: Stream[Any, Any], connections: set[Connection]) -> Connection | None:
    """The :class:`Connection` a grpclib stream belongs to (None once it is gone)."""
    owner = h2_stream(stream).connection
    for connection in connections:
        if getattr(connection, "connection", None) is owner:
            return connection
    return None


class StreamSender:
    """Writes one stream's framed gRPC messages synchronously when nothing holds them back.

    :meth:`try_send` hands a message's DATA frames to h2 at once when the socket is
    writable (grpclib's ``write_ready``: the transport is under its high-water mark) and
    the stream's flow-control window (h2's, the minimum of the stream's and the
    connection's) takes the whole message; otherwise it returns False and the caller
    queues the message for the awaiting :func:`send_framed`. The frames reach the
    socket on :meth:`flush`, so that the replies of several lanes handled in one loop
    callback go out in one write. Bytes on the wire are exactly grpclib's: the message
    as framed by :func:`~rlmesh_trio._wire.encode_join_response_framed`, split at the
    peer's max frame size.
    """

    __slots__ = ("_connection", "_h2", "_id", "_transport")

    def __init__(self, stream: Stream[Any, Any]) -> None:
        raw = h2_stream(stream)
        assert raw.id is not None
        self._id: int = raw.id
        self._connection = raw.connection
        self._h2 = raw._h2_connection
        self._transport = raw._transport

    def try_send(self, payload: bytes) -> bool:
        """Queue a framed gRPC message (prefix included) on the h2 connection now, or
        return False (nothing was sent).

        Raises h2's errors when the stream is gone (reset, connection closed).
        """
        if not self._connection.write_ready.is_set() or self._transport.is_closing():
            return False
        h2c = self._h2
        size = h2c.max_outbound_frame_size
        if len(payload) <= size and put_plain_data(h2c, self._id, payload):
            return True  # the everyday reply: one frame, the windows checked on the way
        if h2c.local_flow_control_window(self._id) < len(payload):
            return False
        if len(payload) <= size:
            h2c.send_data(self._id, payload)
        else:
            view = memoryview(payload)
            for pos in range(0, len(payload), size):
                chunk = view[pos : pos + size]
                if not put_plain_data(h2c, self._id, chunk):
                    h2c.send_data(self._id, chunk)
            view.release()
        return True

    def flush(self) -> None:
        """Write what h2 has buffered (no-op when nothing is)."""
        data = self._h2.data_to_send()
        if data and not self._transport.is_closing():
            self._transport.write(data)


class RequestReader:
    """Reads one stream's gRPC messages inside the connection's data callback.

    No reader task and no queue: :class:`Connection` hands the stream's DATA to
    :meth:`feed`, which cuts it into messages (the prefix checked first, so an over-size
    message is refused before its body is buffered; a big body copied into one buffer as
    it arrives) and calls ``on_message`` with each, in order, on the loop.

    Back-pressure is explicit: while :attr:`paused` (the session is saturated, a big
    request is being decoded off the loop) or after :meth:`stop`, arriving data is kept
    as it came and is **not** acknowledged to h2, so no WINDOW_UPDATE goes out and the
    peer can send at most its flow-control window (grpclib's 4 MiB) more; consuming it
    later acknowledges it. The stream's end (or an unreadable message) is reported once
    through ``on_end`` (None, or the :class:`~rlmesh_trio._errors.WireError`), after
    every message before it was delivered.
    """

    def __init__(
        self,
        connection: Connection,
        stream: Stream[Any, Any],
        limit: int,
        on_message: Callable[[bytes | bytearray], None],
        on_end: Callable[[WireError | None], None],
        on_read: Callable[[bool], None] | None = None,
    ) -> None:
        raw = h2_stream(stream)
        assert raw.id is not None
        self._id: int = raw.id
        self._raw = raw
        self._connection = connection
        self._h2 = raw._h2_connection
        self._on_message = on_message
        self._on_end = on_end
        self.on_read = on_read
        """``on_read(True)`` before the connection hands over one read's frames, and
        ``on_read(False)`` after them: what the messages of one read cause can be done
        once for all of them (lane wake-ups, a write)."""
        self._chunks: deque[tuple[bytes | memoryview, int]] = deque()  # data, to ack
        self.buffered = 0  # bytes received and not yet consumed
        self._consumed = 0  # flow-controlled bytes consumed, not yet acknowledged
        self._eof = False
        self._done = False  # the end was reported, or the reader detached: discard
        self._stopped = False
        self._paused = False
        self._pumping = False
        self._cutter = MessageReader(limit)  # the message being read

    # -- control

    def attach(self) -> None:
        """Take over the stream's DATA: what grpclib buffered so far, then all that comes."""
        self._connection.readers[self._id] = self
        buffer = self._raw.buffer
        queued = buffer._unacked
        while not queued.empty():
            data, _, ack_size = queued.get_nowait()
            if not ack_size and not data:
                self._eof = True
            else:
                self._chunks.append((data, ack_size))
                self.buffered += len(data)
        if buffer._eof:
            self._eof = True
        self._pump()
        self._flush()

    def close(self) -> None:
        """Read no more, ever: what was kept and what still comes is acknowledged, dropped.

        The WINDOW_UPDATE goes out at once: the connection's window is shared, and a peer
        waiting for it to send on another stream may send nothing else meanwhile.
        """
        self._done = True
        self._drop_all()
        self._flush()

    def detach(self) -> None:
        """:meth:`close`, and the stream's DATA goes back to grpclib (the call is over)."""
        self.close()
        if self._connection.readers.get(self._id) is self:
            del self._connection.readers[self._id]

    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        if value == self._paused:
            return
        self._paused = value
        if not value:
            self._pump()
            self._flush()

    def stop(self) -> None:
        """Consume no more (the server is draining); kept data stays unacknowledged."""
        self._stopped = True

    # -- events from the connection

    def feed(self, data: bytes, flow_controlled_length: int) -> None:
        if self._done:
            self._ack(flow_controlled_length)
            return
        self._chunks.append((data, flow_controlled_length))
        self.buffered += len(data)
        self._pump()

    def end(self) -> None:
        self._eof = True
        self._pump()

    # -- internals

    def _ack(self, size: int) -> None:
        if size and not self._connection.connection.is_closing():
            with contextlib.suppress(h2.exceptions.H2Error):
                self._h2.acknowledge_received_data(size, self._id)

    def _flush(self) -> None:
        if not self._connection.connection.is_closing():
            self._connection.connection.flush()

    def _drop_all(self) -> None:
        ack, self._consumed = self._consumed, 0
        while self._chunks:
            ack += self._chunks.popleft()[1]
        self.buffered = 0
        self._cutter.clear()
        self._ack(ack)

    def _report_end(self, error: WireError | None) -> None:
        self._done = True
        self._drop_all()
        self._on_end(error)

    def _pump(self) -> None:
        if self._pumping:
            return  # re-entered from a callback: the loop below goes on
        self._pumping = True
        try:
            self._consume()
        finally:
            self._pumping = False
        if self._consumed and (self._paused or self._stopped):
            # Held back: what was consumed must not wait for a batch that may never come.
            self._ack(self._consumed)
            self._consumed = 0

    def _consume(self) -> None:
        chunks = self._chunks
        while not (self._done or self._paused or self._stopped):
            if not chunks:
                if self._eof:
                    mid_message = self._cutter.mid_message
                    self._report_end(FrameError("truncated message") if mid_message else None)
                return
            data, ack = chunks[0]
            try:
                message, rest = self._cutter.cut(data)
            except WireError as exc:
                self._report_end(exc)
                return
            if rest is None:  # the chunk is consumed
                chunks.popleft()
                self.buffered -= len(data)
                self._consumed += ack
                if self._consumed >= ACK_BATCH:
                    self._ack(self._consumed)
                    self._consumed = 0
            else:
                chunks[0] = (rest, ack)  # acknowledged once the rest is consumed too
                self.buffered -= len(data) - len(rest)
            del data
            if message is not None:
                try:
                    self._on_message(message)
                except Exception:
                    log.exception("a Join request could not be handled")
                    self._report_end(FrameError("request handling failed"))
                    return
                del message
