"""One HTTP/2 connection of the server: grpclib's ``H2Protocol``, subclassed.

:class:`Connection` does grpclib's ``connection_made`` with grpclib's public
``Connection`` and ``EventsProcessor``, so the h2 connection is ours to hold: track
connections, pass every byte through the frame gate (:mod:`._flood`), a turn's slice at
a time, hand a Join's DATA to its reader (past h2's frame objects on the direct DATA
path, :mod:`._h2frames`), write GOAWAY frames, cut connections, answer an HTTP/2
protocol error with the GOAWAY h2 prepared (grpclib closes without sending it), ignore
the events grpclib has no handler for (extension frames) and empty DATA (grpclib's
buffer would take it for the end). h2's own stream limit is raised above the advertised
one by the class of its ``local_settings`` (:class:`_EarlyStreams`, a subclass of the
public ``h2.settings.Settings``), so the streams past it are refused one by one. Which
streams are served is its :class:`~._dispatch.Dispatcher`'s to say.

A connection we close lingers: what h2 queued (its GOAWAY last) is written, our side is
shut, and what the client still sends is read and dropped until it closes or
:data:`CLOSE_LINGER` passed; then the socket is reset. h2 cannot send a GOAWAY and keep
serving the open streams (its state machine closes the connection), so the GOAWAY frames
of a graceful stop are written next to it with hyperframe.

Every private name of grpclib and h2 used here is listed in :mod:`._privates`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import TYPE_CHECKING, Any, cast

import h2.config
import h2.events
import h2.exceptions
import h2.settings
from grpclib.config import Configuration
from grpclib.protocol import Connection as GrpclibConnection
from grpclib.protocol import EventsProcessor, H2Protocol
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hyperframe.frame import GoAwayFrame, RstStreamFrame

from .._logging import RateLimit
from ._dispatch import Dispatcher, current_call
from ._flood import (
    HEADER_BLOCK_SECONDS,
    STREAMS_HARD_LIMIT,
    Flood,
    FrameGate,
    ServerBudget,
)
from ._h2frames import route_frames
from ._headers import CappedEncoder
from ._privates import direct_data_path
from ._reader import RequestReader
from ._writer import Output

if TYPE_CHECKING:
    from grpclib.protocol import Stream as H2Stream
    from grpclib.server import Stream

log = logging.getLogger("rlmesh_trio.transport")

CLOSE_LINGER = 2.0
"""Seconds a connection we closed may take to hand its last bytes (a GOAWAY) to a client
before it is aborted: a client that never reads would otherwise keep it, and its buffer,
forever."""

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)
"""SO_LINGER on, zero seconds: closing the socket resets the connection at once."""

_REPORTS = RateLimit()
"""At most a few log lines about hostile or broken connections per window, whatever
their number."""


def call_of(stream: Stream[Any, Any]) -> tuple[Connection, H2Stream]:
    """The :class:`Connection` and h2-level stream of ``stream``, the call this handler
    task (or a task it started) serves."""
    connection, raw = current_call()
    assert isinstance(connection, Connection)
    return connection, raw


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
        budget: ServerBudget | None = None,
        *,
        max_connections: int | None = None,
        first_request_timeout: float | None = None,
    ) -> None:
        super().__init__(dispatcher, config, h2_config)
        self._max_connections = max_connections
        self._first_request_timeout = first_request_timeout
        self._first_request_timer: asyncio.TimerHandle | None = None
        self.dispatcher = dispatcher
        self._registry = registry
        self._budget = budget
        self._block_timer: asyncio.TimerHandle | None = None
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
        if self._max_connections is not None and len(self._registry) >= self._max_connections:
            _report(f"a connection past --max-connections ({self._max_connections}) was closed")
            self._lost = True
            cast(asyncio.Transport, transport).abort()
            return
        self._transport = cast(asyncio.Transport, transport)
        # What grpclib's H2Protocol.connection_made does, with public names only, so that
        # the h2 connection is ours to hold (grpclib keeps it private).
        h2_connection = self.h2 = H2Connection(config=self.h2_config)
        h2_connection.encoder = CappedEncoder()  # (a public attribute of h2's connection)
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
            self._budget,
        )
        self.dispatcher.on_refused = self._gate.refused
        settings = h2_connection.local_settings
        if type(settings) is h2.settings.Settings:
            settings.__class__ = _EarlyStreams
        ensure_nodelay(transport)
        self._registry.add(self)
        if self._first_request_timeout is not None:
            self._first_request_timer = loop.call_later(
                self._first_request_timeout, self._first_request_overdue
            )

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._transport is None:
            return  # refused in connection_made: grpclib never saw it
        self._lost = True
        self._held = None
        self._registry.discard(self)
        if self._gate is not None:
            self._gate.close()  # what its unfinished header block held, released
        if self._block_timer is not None:
            self._block_timer.cancel()
        if self._first_request_timer is not None:
            self._first_request_timer.cancel()
        super().connection_lost(exc)

    def output(self) -> Output:
        """What this connection's replies are written with (:class:`~._writer.Output`)."""
        assert self.h2 is not None and self._transport is not None
        return Output(self.connection, self.h2, self._transport, self._direct)

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
        while True:
            end = gate.scan(data)
            if end:
                self._deliver(data if end == len(data) else data[:end])
            if gate.flood is not None:
                self._flood(gate.flood)
                return
            if gate.excised is None:
                break
            stream_id, size = gate.excised
            gate.excised = None
            data = data[end + size :]
            if self._closing():
                return
            self._reset_stream(stream_id, ErrorCodes.PROTOCOL_ERROR)
            if not data:
                return
        if gate.block_since is not None and self._block_timer is None:
            self._block_timer = asyncio.get_running_loop().call_later(
                HEADER_BLOCK_SECONDS, self._block_overdue, gate.block_since
            )
        if end < len(data) and not self._closing():
            self._held = data[end:]
            assert self._transport is not None
            self._transport.pause_reading()
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _first_request_overdue(self) -> None:
        """``first_request_timeout`` after the connection opened: closed (GOAWAY
        NO_ERROR) if it has not begun a call."""
        self._first_request_timer = None
        if self._lost or self._closing() or self._h2().highest_inbound_stream_id:
            return
        log.debug("a connection that began no call in %s s is closed", self._first_request_timeout)
        self._goaway_and_close(ErrorCodes.NO_ERROR, None)

    def _reset_stream(self, stream_id: int, code: ErrorCodes) -> None:
        """A stream error of the client's (its frame cut out by the gate): RST_STREAM
        ``code`` for that stream alone, its handler cancelled as for a client's reset."""
        h2_connection = self._h2()
        stream = h2_connection.streams.get(stream_id)
        if stream is not None and not stream.closed:
            with contextlib.suppress(h2.exceptions.H2Error):
                h2_connection.reset_stream(stream_id, code)
            try:
                event = h2.events.StreamReset(stream_id=stream_id)
            except TypeError:  # h2 before 4.3: an event made empty, then filled
                event = h2.events.StreamReset()  # type: ignore[call-arg]
                event.stream_id = stream_id
            event.error_code = code
            event.remote_reset = False
            self.processor.process(event)  # grpclib cancels the call's handler
        elif stream is None and stream_id > h2_connection.highest_inbound_stream_id:
            # An idle stream h2 has not seen: the RST_STREAM written past it, after what
            # h2 queued (whole frames).
            self.connection.flush()
            assert self._transport is not None
            self._transport.write(RstStreamFrame(stream_id, error_code=code).serialize())
        self.connection.flush()

    def _block_overdue(self, started: float) -> None:
        """:data:`~._flood.HEADER_BLOCK_SECONDS` after a header block started: closed if
        that block is still unfinished; else watched again if another one is."""
        self._block_timer = None
        gate = self._gate
        if gate is None or self._lost or self._closing():
            return
        gate.block_overdue(started)
        if gate.flood is not None:
            self._flood(gate.flood)
        elif gate.block_since is not None:
            delay = max(
                0.0, gate.block_since + HEADER_BLOCK_SECONDS - asyncio.get_running_loop().time()
            )
            self._block_timer = asyncio.get_running_loop().call_later(
                delay, self._block_overdue, gate.block_since
            )

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
