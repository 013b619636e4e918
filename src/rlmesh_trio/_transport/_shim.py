"""grpclib's seam: the request dispatcher, the HTTP/2 connection, the Join's reader and
sender, unary reads.

Every private name of grpclib and h2 this package uses is listed, with why and its
fallback, in :mod:`._privates` (``tests/test_transport_privates.py`` fails on one that is
not). What this module builds on, by public names:

* ``grpclib.server.Handler`` is subclassed (:class:`Dispatcher`) to see request headers
  before dispatch: refuse streams while stopping or past our MAX_CONCURRENT_STREAMS,
  refuse compressed or unauthenticated requests (trailers-only, from tasks of its own:
  ``cancel``/``close``/``wait_closed`` know them), remember the last stream id for GOAWAY,
  and give a direct-path call (the Join) its :class:`RequestReader` from its first frame.
  The handler task grpclib creates inside ``accept`` finds its connection and h2-level
  stream in a context variable (:func:`call_of`).
* ``grpclib.protocol.H2Protocol`` is subclassed (:class:`Connection`), and its
  ``connection_made`` done here with grpclib's public ``Connection`` and
  ``EventsProcessor``, so the h2 connection is ours to hold: track connections, pass
  every byte through the frame gate (:mod:`._flood`), write GOAWAY frames, cut
  connections, answer an HTTP/2 protocol error with the GOAWAY h2 prepared (grpclib closes
  without sending it), ignore the events grpclib has no handler for (extension frames)
  and empty DATA (grpclib's buffer would take it for the end). h2's own stream limit is
  raised above the advertised one by the class of its ``local_settings``
  (:class:`_EarlyStreams`, a subclass of the public ``h2.settings.Settings``), so the
  streams past it are refused one by one.
* The Join's fast path (issue 9): :class:`StreamSender` writes a reply's DATA frames with
  the connection's h2 (grpclib's public ``Connection.write_ready`` says the socket takes
  them) at once when the flow-control window takes them; :class:`RequestReader` takes the
  stream's DATA inside the connection's data callback and acknowledges it to h2 only as it
  is consumed; :func:`send_framed` sends an already framed message with grpclib's h2-level
  ``Stream.send_data`` (its flow control and write-ready waits).
* The direct DATA path (issue 20, :mod:`._h2frames`) takes a Join's plain DATA frames and
  queues its replies past h2's frame objects, changing exactly what h2 would; it needs
  h2's privates and is checked once per process (:func:`._privates.direct_data_path`):
  h2's public API is the fallback. ``tests/test_transport_shim.py`` feeds the same byte
  streams to h2 alone and to this path and compares everything observable.
* Server reflection (:mod:`._reflection`) uses grpclib's servicers
  (:func:`reflection_servicers`), with our own descriptor pool.

h2 cannot send a GOAWAY and keep serving the open streams (its state machine closes the
connection), so the GOAWAY frames of a graceful stop are written next to it with
hyperframe.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import socket
import struct
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
from grpclib.protocol import Connection as GrpclibConnection
from grpclib.protocol import EventsProcessor, H2Protocol
from grpclib.server import Handler as GrpclibHandler
from grpclib.server import Stream
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
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
from ._privates import direct_data_path, dispatch_events, library_version, server_configuration

if TYPE_CHECKING:
    from grpclib.protocol import Stream as H2Stream

log = logging.getLogger("rlmesh_trio.transport")

CHUNK = 1 << 20
"""Bytes read from grpclib's stream buffer at a time for a big message."""

CLOSE_LINGER = 2.0
"""Seconds a connection we closed may take to hand its last bytes (a GOAWAY) to a client
before it is aborted: a client that never reads would otherwise keep it, and its buffer,
forever."""

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)
"""SO_LINGER on, zero seconds: closing the socket resets the connection at once."""

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
    return server_configuration(), h2_config


_CALL: contextvars.ContextVar[tuple[Connection, H2Stream]] = contextvars.ContextVar("_CALL")
"""The connection and h2-level stream of the call whose handler task this is: set by
:meth:`Dispatcher.accept` around grpclib's ``accept``, which creates the handler task
(a task copies the context it was created in). Public ground: grpclib's server
``Stream`` keeps its h2-level stream in a private attribute."""


def call_of(stream: Stream[Any, Any]) -> tuple[Connection, H2Stream]:
    """The :class:`Connection` and h2-level stream of ``stream``, the call this handler
    task (or a task it started) serves."""
    try:
        return _CALL.get()
    except LookupError:
        raise RuntimeError("not inside a request handler's task") from None


def h2_stream(stream: Stream[Any, Any]) -> H2Stream:
    return call_of(stream)[1]


def _count(headers: list[tuple[str, str]], name: str) -> int:
    return sum(1 for key, _ in headers if key == name)


class Dispatcher(GrpclibHandler):
    """One per connection: grpclib's request dispatcher, with our admission checks."""

    def __init__(
        self,
        admission: Admission,
        mapping: MethodTable,
        codec: CodecBase,
        direct_paths: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(mapping, codec, None, dispatch_events())
        self._admission = admission
        self._direct_paths = direct_paths
        self._refusals: dict[H2Stream, asyncio.Task[None]] = {}
        self.owner: Connection | None = None  # set by the connection
        self.last_stream_id = 0
        # Set by the connection: a header block that is a connection error (GOAWAY);
        # how many streams it has dispatched and not released; a stream refused.
        self.on_connection_error: Callable[[], None] | None = None
        self.streams_in_use: Callable[[], int] = lambda: 0
        self.on_refused: Callable[[], None] = lambda: None

    def accept(
        self, stream: H2Stream, headers: list[tuple[str, str]], release_stream: Callable[[], Any]
    ) -> None:
        if not stream.closable:
            # Reset by the client in the same read as its HEADERS ("Rapid Reset"): no
            # handler, no task, nothing to answer (the frame gate counted the reset).
            release_stream()
            return
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
            self._refusals[stream] = task
            task.add_done_callback(lambda _: self._refusals.pop(stream, None))
            return
        owner = self.owner
        assert owner is not None and stream.id is not None
        if path in self._direct_paths:
            # Its DATA goes to a reader of ours from the first frame on (held until the
            # handler starts it), never to grpclib's per-stream buffer.
            reader = RequestReader(owner, stream.id)
            release_stream = reader.releasing(release_stream)
        token = _CALL.set((owner, stream))
        try:
            super().accept(stream, headers, release_stream)
        finally:
            _CALL.reset(token)

    def cancel(self, stream: H2Stream) -> None:
        task = self._refusals.pop(stream, None)
        if task is not None:
            task.cancel()
            return
        super().cancel(stream)

    def close(self) -> None:
        for task in self._refusals.values():
            task.cancel()
        super().close()

    async def wait_closed(self) -> None:
        refusals = list(self._refusals.values())
        if refusals:
            await asyncio.wait(refusals)
        await super().wait_closed()

    def check_closed(self) -> bool:
        return not self._refusals and super().check_closed()


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
        self._lingering = False  # closed by us: reading and dropping until CLOSE_LINGER
        self._gate: FrameGate | None = None
        self._direct = direct_data_path()  # the Join's DATA frames past h2 (issue 20)
        self.h2: H2Connection | None = None
        dispatcher.on_connection_error = self._on_malformed_headers
        dispatcher.streams_in_use = self._streams_in_use
        dispatcher.owner = self

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not alpn_is_h2(transport):
            # Before a byte of HTTP/2 (Python's TLS layer cannot refuse inside the
            # handshake: OpenSSL goes on without ALPN when nothing matches).
            _report("a TLS client that did not negotiate h2 by ALPN was refused")
            self._lost = True
            cast(asyncio.Transport, transport).abort()
            return
        self._transport = cast(asyncio.Transport, transport)
        # What grpclib's H2Protocol.connection_made does, with public names only, so that
        # the h2 connection is ours to hold (grpclib keeps it private).
        h2_connection = self.h2 = H2Connection(config=self.h2_config)
        h2_connection.initiate_connection()
        initial = h2_connection.local_settings.initial_window_size
        if self.config.http2_connection_window_size != initial:
            h2_connection.increment_flow_control_window(
                self.config.http2_connection_window_size - initial
            )
        if self.config.http2_stream_window_size != initial:
            h2_connection.update_settings(
                {SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size}
            )
        self.connection = GrpclibConnection(h2_connection, self._transport, config=self.config)
        self.connection.flush()
        self.connection.initialize()
        self.processor = EventsProcessor(self.handler, self.connection)
        loop = asyncio.get_running_loop()
        self._gate = FrameGate(
            loop.time,
            self._stream_open,
            self._output_backlog,
            h2_connection.max_inbound_frame_size,
        )
        self.dispatcher.on_refused = self._gate.refused
        settings = h2_connection.local_settings
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

    def _h2(self) -> H2Connection:
        assert self.h2 is not None
        return self.h2

    # -- what the gate needs to know

    def _streams_in_use(self) -> int:
        processor = getattr(self, "processor", None)
        return 0 if processor is None else len(processor.streams)

    def _stream_open(self, stream_id: int) -> bool | None:
        h2_connection = self._h2()
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
        if self._lingering:
            return  # after our GOAWAY: read and dropped, so that closing loses nothing
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
            h2_connection = self._h2()
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
        if not self._direct:  # h2's public path: its DataReceived events feed the readers
            told = [reader.on_read for reader in readers.values() if reader.on_read is not None]
            for on_read in told:
                on_read(True)
            try:
                self._receive_h2(data)
            finally:
                for on_read in told:
                    on_read(False)
            return
        told = [reader.on_read for reader in readers.values() if reader.on_read is not None]
        for on_read in told:
            on_read(True)
        try:
            if route_frames(self._h2(), data, readers, self._receive_h2, self._closing):
                self.connection.flush()  # the WINDOW_UPDATEs of what the readers consumed
        finally:
            for on_read in told:
                on_read(False)

    def _closing(self) -> bool:
        return self._lingering or self._transport is None or self._transport.is_closing()

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
                self._h2().acknowledge_received_data(size, event.stream_id)

    def _on_malformed_headers(self) -> None:
        self._malformed = True

    def _goaway_and_close(self, code: ErrorCodes, exc: Exception | None) -> None:
        """GOAWAY(``code``) naming the last stream dispatched, then close (the
        reference's answer to a header field HTTP cannot carry)."""
        with contextlib.suppress(Exception):
            self._h2().close_connection(
                error_code=code, last_stream_id=self.dispatcher.last_stream_id
            )
        self._protocol_error(exc or h2.exceptions.ProtocolError("malformed header block"))

    def _protocol_error(self, exc: Exception) -> None:
        """Write what h2 queued (its GOAWAY last), then close -- lingering: the handlers
        are cancelled at once, our side of the socket is shut after the GOAWAY, and what
        the client still sends is read and dropped until it closes or :data:`CLOSE_LINGER`
        passed. Closing a socket with unread input resets it, and the reset can destroy
        the GOAWAY before the client has read it."""
        log.debug("HTTP/2 protocol error (%r); GOAWAY and close", exc)
        transport = self._transport
        if self._lingering or transport is None or transport.is_closing():
            return
        with contextlib.suppress(Exception):
            pending = self._h2().data_to_send()
            if pending:
                transport.write(pending)
        self._lingering = True
        self._held = None
        self.handler.close()
        with contextlib.suppress(Exception):
            if transport.can_write_eof():
                transport.write_eof()
            transport.resume_reading()  # (paused for a turn's slice, perhaps)
        asyncio.get_running_loop().call_later(CLOSE_LINGER, self._end_linger)

    def _end_linger(self) -> None:
        """The client neither closed nor read everything within :data:`CLOSE_LINGER`."""
        if not self._lost:
            self._reset()
            self.processor.close("Protocol error")

    def _reset(self) -> None:
        """Reset the connection at once. A plain close would leave the socket to the
        kernel, holding our unsent bytes against a window the client never opens."""
        transport = self._transport
        if transport is None or self._lost:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        transport.abort()

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
            asyncio.get_running_loop().call_later(CLOSE_LINGER, self._reset)


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
    """grpclib's reflection servicers (v1, v1alpha) answering from ``pool``; None for
    one whose privates are not there (listed in :mod:`._privates`), with a warning."""
    from grpclib.reflection.service import ServerReflection as V1

    classes: list[Any] = [V1, None]
    try:
        from grpclib.reflection._deprecated import ServerReflection as V1Alpha

        classes[1] = V1Alpha
    except ImportError:
        log.warning(
            "grpclib %s has no grpclib.reflection._deprecated: grpc.reflection.v1alpha "
            "is not served",
            library_version("grpclib"),
        )
    servicers: list[Any] = []
    for cls in classes:
        servicer = None
        if cls is not None:
            try:
                servicer = cls(_service_names=service_names)
                if not hasattr(servicer, "_pool"):
                    raise AttributeError("_pool")
                # grpclib 0.4.9 takes ``_pool=`` too, 0.4.8 does not; both keep it here.
                servicer._pool = pool
            except (TypeError, AttributeError) as exc:
                log.warning(
                    "grpclib %s's reflection servicer is not what we expect (%s): "
                    "reflection is not served",
                    library_version("grpclib"),
                    exc,
                )
                servicer = None
        servicers.append(servicer)
    return servicers[0], servicers[1]


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


def reader_of(stream: Stream[Any, Any], connections: set[Connection]) -> RequestReader | None:
    """The reader :class:`Dispatcher` made for ``stream`` (a direct path's call), None
    once its connection is gone."""
    connection, raw = call_of(stream)
    if connection not in connections or raw.id is None:
        return None
    return connection.readers.get(raw.id)


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

    __slots__ = ("_connection", "_direct", "_h2", "_id", "_transport")

    def __init__(self, stream: Stream[Any, Any]) -> None:
        connection, raw = call_of(stream)
        assert raw.id is not None and connection._transport is not None
        self._id: int = raw.id
        self._connection = connection.connection
        self._h2 = connection._h2()
        self._transport = connection._transport
        self._direct = connection._direct

    def try_send(self, payload: bytes) -> bool:
        """Queue a framed gRPC message (prefix included) on the h2 connection now, or
        return False (nothing was sent).

        Raises h2's errors when the stream is gone (reset, connection closed).
        """
        if not self._connection.write_ready.is_set() or self._transport.is_closing():
            return False
        h2c = self._h2
        size = h2c.max_outbound_frame_size
        direct = self._direct
        if direct and len(payload) <= size and put_plain_data(h2c, self._id, payload):
            return True  # the everyday reply: one frame, the windows checked on the way
        if h2c.local_flow_control_window(self._id) < len(payload):
            return False
        if len(payload) <= size:
            h2c.send_data(self._id, payload)
        else:
            view = memoryview(payload)
            for pos in range(0, len(payload), size):
                chunk = view[pos : pos + size]
                if not (direct and put_plain_data(h2c, self._id, chunk)):
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

    No reader task and no queue: created by :class:`Dispatcher` as the stream is
    accepted, it takes the stream's DATA from its first frame on (:class:`Connection`
    hands it to :meth:`feed`; grpclib's per-stream buffer never sees it) and holds it
    until the handler calls :meth:`start`; from then on it cuts it into messages (the
    prefix checked first, so an over-size message is refused before its body is
    buffered; a big body copied into one buffer as it arrives) and calls
    ``on_message`` with each, in order, on the loop.

    Back-pressure is explicit: until started, while :attr:`paused` (the session is
    saturated, a big request is being decoded off the loop) or after :meth:`stop`,
    arriving data is kept as it came and is **not** acknowledged to h2, so no
    WINDOW_UPDATE goes out and the peer can send at most its flow-control window
    (grpclib's 4 MiB) more; consuming it later acknowledges it. The stream's end (or an
    unreadable message) is reported once through ``on_end`` (None, or the
    :class:`~rlmesh_trio._errors.WireError`), after every message before it was
    delivered.
    """

    def __init__(self, connection: Connection, stream_id: int) -> None:
        self._id = stream_id
        self._connection = connection
        self._h2 = connection._h2()
        self._on_message: Callable[[bytes | bytearray], None] | None = None  # not started
        self._on_end: Callable[[WireError | None], None] = lambda error: None
        self.on_read: Callable[[bool], None] | None = None
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
        self._cutter = MessageReader(0)  # the message being read (its limit at start)
        connection.readers[stream_id] = self

    # -- control

    def releasing(self, release_stream: Callable[[], Any]) -> Callable[[], Any]:
        """``release_stream``, detaching this reader first (the call is over)."""

        def release() -> Any:
            self.detach()
            return release_stream()

        return release

    def start(
        self,
        limit: int,
        on_message: Callable[[bytes | bytearray], None],
        on_end: Callable[[WireError | None], None],
        on_read: Callable[[bool], None] | None = None,
    ) -> None:
        """Deliver messages from now on: what was held first, then all that comes."""
        self._cutter = MessageReader(limit)
        self._on_end = on_end
        self.on_read = on_read
        self._on_message = on_message
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
        if self._consumed and (self._paused or self._stopped or self._on_message is None):
            # Held back: what was consumed must not wait for a batch that may never come.
            self._ack(self._consumed)
            self._consumed = 0

    def _consume(self) -> None:
        chunks = self._chunks
        on_message = self._on_message
        while not (self._done or self._paused or self._stopped or on_message is None):
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
                    on_message(message)
                except Exception:
                    log.exception("a Join request could not be handled")
                    self._report_end(FrameError("request handling failed"))
                    return
                del message
