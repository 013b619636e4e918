"""A small synchronous raw-HTTP/2 toolkit over a blocking socket, for hostile-input tests.

Frames are built as bytes (:func:`headers`, :func:`data`, :func:`rst_stream`,
:func:`ping`, :func:`settings`, :func:`window_update`, :func:`unknown`, ...) so a test
can put any sequence on the wire in one write, valid or not; :class:`Connection` owns
the socket, sends them, and parses what the server sent back (:class:`FrameReader`:
GOAWAY, RST_STREAM, header blocks and trailers, DATA and the gRPC messages in it, per
stream). :class:`Flood` writes a long sequence of chunks from a background thread, every
write bounded, so a server that stops reading cannot hang the test; :class:`Bystander`
times Handshakes on a connection of its own (the raw client of :mod:`support.wire`, on
an event loop of its own) while a flood runs. The flood payloads of the hostile tests
are built here too (:func:`rapid_reset_pairs`, :func:`empty_data_frames`,
:func:`control_frames`), for the tests and ``bench/soak_floods.py`` alike.

Header blocks are encoded statelessly (every field a never-indexed literal): a block
encoded once can be sent on any number of streams, in any order.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.events
import hpack
from hpack import NeverIndexedHeaderTuple
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6; PRIORITY_UPDATE: RFC 9218).
DATA = 0x0
HEADERS = 0x1
PRIORITY = 0x2
RST_STREAM = 0x3
SETTINGS = 0x4
PING = 0x6
GOAWAY = 0x7
WINDOW_UPDATE = 0x8
CONTINUATION = 0x9
PRIORITY_UPDATE = 0x10

# Flags.
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4

# Error codes (RFC 9113 §7).
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
STREAM_CLOSED = 0x5
REFUSED_STREAM = 0x7
CANCEL = 0x8
ENHANCE_YOUR_CALM = 0xB

# SETTINGS parameters.
HEADER_TABLE_SIZE = 0x1
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
REFLECTION_V1 = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"

DEFAULT_WINDOW = 65_535
"""The flow-control window before any SETTINGS or WINDOW_UPDATE (RFC 9113 §6.9.2)."""

MAX_FRAME = 16_384
"""The largest frame payload sent (the default SETTINGS_MAX_FRAME_SIZE)."""

DEFAULT_TIMEOUT = 10.0
"""Seconds any single wait of this module may take unless told otherwise."""


# --------------------------------------------------------------------------- frames


def frame(kind: int, stream_id: int, payload: bytes = b"", flags: int = 0) -> bytes:
    """Any frame, header and payload, of any type (unknown ones included)."""
    return (
        len(payload).to_bytes(3, "big")
        + bytes((kind, flags))
        + (stream_id & 0x7FFFFFFF).to_bytes(4, "big")
        + payload
    )


def request_fields(
    path: str, *, authority: str = "localhost", extra: Sequence[tuple[str, str]] = ()
) -> list[tuple[str, str]]:
    """A gRPC request's header fields for ``path``."""
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *extra,
    ]


def header_block(fields: Iterable[tuple[str, str]]) -> bytes:
    """An HPACK block of never-indexed literals: it leaves no state in either side's
    dynamic table, so it is valid on any stream of any connection, in any order."""
    return hpack.Encoder().encode([NeverIndexedHeaderTuple(k, v) for k, v in fields])


def headers(
    stream_id: int,
    path: str | None = None,
    *,
    block: bytes | None = None,
    extra: Sequence[tuple[str, str]] = (),
    end_stream: bool = False,
) -> bytes:
    """A HEADERS frame (END_HEADERS) opening a gRPC call on ``path``, or carrying
    ``block`` (from :func:`header_block`) as it is."""
    if block is None:
        assert path is not None, "a path or a block"
        block = header_block(request_fields(path, extra=extra))
    return frame(HEADERS, stream_id, block, END_HEADERS | (END_STREAM if end_stream else 0))


def grpc_message(payload: bytes, *, compressed: bool = False) -> bytes:
    """A gRPC length-prefixed message."""
    return struct.pack(">?I", compressed, len(payload)) + payload


def data(stream_id: int, payload: bytes = b"", *, end_stream: bool = False) -> bytes:
    """One DATA frame, raw bytes (wrap a message with :func:`grpc_message`)."""
    return frame(DATA, stream_id, payload, END_STREAM if end_stream else 0)


def rst_stream(stream_id: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, stream_id, code.to_bytes(4, "big"))


def ping(opaque: bytes = b"\x00" * 8, *, ack: bool = False) -> bytes:
    assert len(opaque) == 8
    return frame(PING, 0, opaque, ACK if ack else 0)


def settings(values: Mapping[int, int] | None = None, *, ack: bool = False) -> bytes:
    """A SETTINGS frame: ``values`` as (parameter, value), or an ACK."""
    if ack:
        return frame(SETTINGS, 0, b"", ACK)
    payload = b"".join(struct.pack(">HI", k, v) for k, v in (values or {}).items())
    return frame(SETTINGS, 0, payload)


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, stream_id, (increment & 0x7FFFFFFF).to_bytes(4, "big"))


def unknown(kind: int, stream_id: int, payload: bytes = b"", flags: int = 0) -> bytes:
    """A frame of a type the server does not know (it must ignore it, RFC 9113 §4.1)."""
    return frame(kind, stream_id, payload, flags)


def priority_update(prioritized_stream_id: int, value: bytes = b"u=3", *, on: int = 0) -> bytes:
    """RFC 9218's PRIORITY_UPDATE (0x10), an extension neither server implements; sent
    on stream ``on`` (the RFC says 0; on another stream it is as unknown)."""
    return unknown(PRIORITY_UPDATE, on, prioritized_stream_id.to_bytes(4, "big") + value)


def preface(values: Mapping[int, int] | None = None) -> bytes:
    """The client connection preface and its SETTINGS."""
    return PREFACE + settings(values)


# --------------------------------------------------------------------------- floods


def rapid_reset_pairs(
    count: int,
    path: str,
    *,
    first_stream: int = 1,
    per_write: int = 100,
    extra: Sequence[tuple[str, str]] = (),
) -> list[bytes]:
    """``count`` HEADERS + RST_STREAM(CANCEL) pairs on streams ``first_stream``,
    ``first_stream + 2``, ..., in writes of ``per_write`` pairs ("Rapid Reset",
    CVE-2023-44487). Stream ids past 2^31 - 1 are not made: ``count`` is bounded."""
    assert first_stream % 2 == 1 and first_stream + 2 * count < 2**31
    block = header_block(request_fields(path, extra=extra))
    head = len(block).to_bytes(3, "big") + bytes((HEADERS, END_HEADERS))
    reset = (4).to_bytes(3, "big") + bytes((RST_STREAM, 0))
    tail = CANCEL.to_bytes(4, "big")
    writes = []
    for start in range(0, count, per_write):
        parts = []
        for index in range(start, min(count, start + per_write)):
            sid = (first_stream + 2 * index).to_bytes(4, "big")
            parts += [head, sid, block, reset, sid, tail]
        writes.append(b"".join(parts))
    return writes


def empty_data_frames(
    stream_id: int, count: int, *, per_write: int = 1000, markers: bool = False
) -> list[bytes]:
    """``count`` empty DATA frames without END_STREAM on ``stream_id``, in writes of
    ``per_write``; with ``markers`` each write ends with a PING whose payload is the
    write's index (:func:`marker`): the last one acknowledged tells how far the server
    read (:attr:`FrameReader.last_ping_ack`)."""
    one = data(stream_id)
    writes = []
    for index, start in enumerate(range(0, count, per_write)):
        chunk = one * min(per_write, count - start)
        writes.append(chunk + ping(marker(index)) if markers else chunk)
    return writes


def marker(index: int) -> bytes:
    """A PING payload numbering a write (see :func:`empty_data_frames`)."""
    return b"mk" + index.to_bytes(6, "big")


def marker_index(payload: bytes | None) -> int | None:
    """The write index of a :func:`marker` payload (None for any other)."""
    if payload is None or not payload.startswith(b"mk"):
        return None
    return int.from_bytes(payload[2:], "big")


CONTROL_KINDS = ("ping", "settings", "window_update")


def control_frames(kind: str, count: int, *, per_write: int = 1000) -> list[bytes]:
    """``count`` PINGs, empty SETTINGS (each needs an ACK) or WINDOW_UPDATE(+1) on the
    connection, in writes of ``per_write``."""
    if kind == "ping":
        one = ping(b"floodpng")
    elif kind == "settings":
        one = settings()
    elif kind == "window_update":
        one = window_update(0, 1)
    else:
        raise ValueError(f"no control flood {kind!r}; one of {CONTROL_KINDS}")
    return [one * min(per_write, count - start) for start in range(0, count, per_write)]


# --------------------------------------------------------------------------- reading


@dataclass
class StreamView:
    """What the server sent on one stream."""

    id: int
    headers: list[tuple[str, str]] | None = None
    trailers: list[tuple[str, str]] | None = None
    data: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset_code: int | None = None
    """The first RST_STREAM's error code."""

    @property
    def status(self) -> int | None:
        """The gRPC status (trailers, or a trailers-only response), if any came."""
        for block in (self.trailers, self.headers):
            if block is not None:
                values = dict(block)
                if "grpc-status" in values:
                    return int(values["grpc-status"])
        return None

    @property
    def message(self) -> str | None:
        for block in (self.trailers, self.headers):
            if block is not None:
                value = dict(block).get("grpc-message")
                if value is not None:
                    return unquote(value)
        return None

    @property
    def answered(self) -> bool:
        """Ended with a gRPC status (whatever it is)."""
        return self.ended and self.status is not None

    def messages(self) -> list[bytes]:
        """The complete gRPC messages received."""
        out = []
        pos = 0
        buf = bytes(self.data)
        while pos + 5 <= len(buf):
            compressed, length = struct.unpack(">?I", buf[pos : pos + 5])
            if pos + 5 + length > len(buf):
                break
            assert not compressed, "the server sent a compressed message"
            out.append(buf[pos + 5 : pos + 5 + length])
            pos += 5 + length
        return out


class FrameReader:
    """Parses the server's byte stream into frames; header blocks are decoded (in
    order, as HPACK requires) and everything is filed per stream."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.decoder = hpack.Decoder()
        self.decoder.max_allowed_table_size = 2**32 - 1  # what a client may advertise
        self._pending: tuple[int, int, bytearray] | None = None  # HEADERS awaiting CONTINUATION
        self.streams: dict[int, StreamView] = {}
        self.goaway: GoAwayFrame | None = None
        self.counts: dict[int, int] = {}
        """Frames received, by type."""
        self.settings_acks = 0
        self.settings_received = 0
        self.last_ping_ack: bytes | None = None
        self.ping_acks = 0
        self.peer_settings: dict[int, int] = {}
        self.window_updates: dict[int, int] = {}
        """The increments of the server's WINDOW_UPDATEs, summed by stream (0: the
        connection)."""

    def stream(self, stream_id: int) -> StreamView:
        view = self.streams.get(stream_id)
        if view is None:
            view = self.streams[stream_id] = StreamView(stream_id)
        return view

    def feed(self, chunk: bytes) -> list[Frame]:
        """Parse the complete frames buffered (a partial one waits); filed, and returned."""
        self._buffer += chunk
        parsed = []
        pos = 0
        buf = self._buffer
        while len(buf) - pos >= 9:
            length = int.from_bytes(buf[pos : pos + 3], "big")
            if len(buf) - pos < 9 + length:
                break
            header = memoryview(bytes(buf[pos : pos + 9]))
            body = memoryview(bytes(buf[pos + 9 : pos + 9 + length]))
            pos += 9 + length
            item, _ = Frame.parse_frame_header(header)
            item.parse_body(body)
            self._file(item)
            parsed.append(item)
        del self._buffer[:pos]
        return parsed

    def _file(self, item: Any) -> None:
        self.counts[item.type] = self.counts.get(item.type, 0) + 1
        if isinstance(item, GoAwayFrame):
            self.goaway = item
        elif isinstance(item, SettingsFrame):
            if "ACK" in item.flags:
                self.settings_acks += 1
            else:
                self.settings_received += 1
                self.peer_settings.update(item.settings)
        elif isinstance(item, PingFrame):
            if "ACK" in item.flags:
                self.ping_acks += 1
                self.last_ping_ack = bytes(item.opaque_data)
        elif isinstance(item, WindowUpdateFrame):
            sid = item.stream_id
            self.window_updates[sid] = self.window_updates.get(sid, 0) + item.window_increment
        elif isinstance(item, RstStreamFrame):
            view = self.stream(item.stream_id)
            if view.reset_code is None:
                view.reset_code = item.error_code
        elif isinstance(item, DataFrame):
            view = self.stream(item.stream_id)
            view.data += item.data
            view.ended = view.ended or "END_STREAM" in item.flags
        elif isinstance(item, HeadersFrame):
            end = "END_STREAM" in item.flags
            if "END_HEADERS" in item.flags:
                self._headers(item.stream_id, bytes(item.data), end)
            else:
                self._pending = (item.stream_id, int(end), bytearray(item.data))
        elif isinstance(item, ContinuationFrame):
            assert self._pending is not None, "CONTINUATION without HEADERS"
            self._pending[2].extend(item.data)
            if "END_HEADERS" in item.flags:
                sid, end, block = self._pending
                self._pending = None
                self._headers(sid, bytes(block), bool(end))

    def _headers(self, stream_id: int, block: bytes, end: bool) -> None:
        decoded = [
            (str(k, "utf-8"), str(v, "utf-8")) for k, v in self.decoder.decode(block, raw=True)
        ]
        view = self.stream(stream_id)
        if view.headers is None:
            view.headers = decoded
        else:
            view.trailers = decoded
        view.ended = view.ended or end


# --------------------------------------------------------------------------- connection


def port_of(address: str | int) -> int:
    """The TCP port of ``tcp://127.0.0.1:PORT`` (or a port as it is)."""
    if isinstance(address, int):
        return address
    return int(address.rsplit(":", 1)[1])


class Connection:
    """One raw HTTP/2 connection to a loopback server: send bytes, read frames.

    ``rcvbuf`` shrinks the socket's receive buffer (before connecting), for a client
    that never reads: the server's output then backs up after a few KiB.
    """

    def __init__(
        self,
        address: str | int,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        rcvbuf: int | None = None,
    ) -> None:
        self.timeout = timeout
        self.reader = FrameReader()
        self.closed: str | None = None
        """How the server ended the connection ("eof", "reset"), once seen."""
        self.closed_at: float | None = None
        self.hung_up: str | None = None
        """How the server ended the connection, seen without reading
        (:meth:`wait_peer_closed`)."""
        self.hung_up_at: float | None = None
        self.ack_settings = True
        """Acknowledge the server's SETTINGS as they are read (a real client does)."""
        self._settings_acked = 0
        self.data_sent: dict[int, int] = {}
        """DATA bytes sent by :meth:`send_message`, by stream (for :meth:`window`)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if rcvbuf is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout)
            sock.connect(("127.0.0.1", port_of(address)))
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    # ----------------------------------------------------------------- convenience

    @property
    def goaway(self) -> GoAwayFrame | None:
        return self.reader.goaway

    @property
    def goaway_code(self) -> int | None:
        return None if self.reader.goaway is None else self.reader.goaway.error_code

    @property
    def streams(self) -> dict[int, StreamView]:
        return self.reader.streams

    def stream(self, stream_id: int) -> StreamView:
        return self.reader.stream(stream_id)

    @property
    def server_table_size(self) -> int:
        """The HPACK dynamic table size the server's encoder signalled it uses (our
        decoder's table mirrors it)."""
        return int(self.reader.decoder.header_table.maxsize)

    # ----------------------------------------------------------------- writing

    def send(self, payload: bytes) -> None:
        """Write ``payload`` whole (the socket's timeout bounds it)."""
        self.sock.sendall(payload)

    def try_send(self, payload: bytes) -> str | None:
        """Write ``payload``; None, or how the connection failed ("reset", "timeout")."""
        try:
            self.sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            return "reset"
        except TimeoutError:
            return "timeout"
        return None

    def window(self, stream_id: int) -> int:
        """How many DATA bytes the server's flow-control windows let us send on
        ``stream_id`` now (RFC 9113 §6.9: the smaller of the connection's and the
        stream's), from the WINDOW_UPDATEs and SETTINGS read so far."""
        updates = self.reader.window_updates
        initial = self.reader.peer_settings.get(INITIAL_WINDOW_SIZE, DEFAULT_WINDOW)
        connection = DEFAULT_WINDOW + updates.get(0, 0) - sum(self.data_sent.values())
        stream = initial + updates.get(stream_id, 0) - self.data_sent.get(stream_id, 0)
        return min(connection, stream)

    def send_message(self, stream_id: int, payload: bytes, *, end_stream: bool = False) -> None:
        """One gRPC message in DATA frames of at most 16 KiB, counted against the
        flow-control windows (see :meth:`window`; the caller checks it first)."""
        framed = grpc_message(payload)
        parts = []
        for pos in range(0, len(framed), MAX_FRAME):
            last = pos + MAX_FRAME >= len(framed)
            parts.append(
                data(stream_id, framed[pos : pos + MAX_FRAME], end_stream=end_stream and last)
            )
        self.send(b"".join(parts))
        self.data_sent[stream_id] = self.data_sent.get(stream_id, 0) + len(framed)

    def start(self, values: Mapping[int, int] | None = None, then: bytes = b"") -> None:
        """The preface and SETTINGS (``values``), and ``then``, in one write."""
        self.send(preface(values) + then)

    # ----------------------------------------------------------------- reading

    def _lost(self, how: str) -> None:
        if self.closed is None:
            self.closed = how
            self.closed_at = time.monotonic()

    def pump(self, timeout: float, *, send_acks: bool = True) -> int:
        """Read what arrives within ``timeout`` (one read, as soon as anything is
        readable); the number of bytes, 0 at EOF or when nothing came. The SETTINGS
        ACKs owed are sent, unless ``send_acks`` is false (another thread writes: it
        sends them, :meth:`owed_acks`)."""
        if self.closed is not None:
            return 0
        try:
            readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
            if not readable:
                return 0
            chunk = self.sock.recv(1 << 18)
        except ConnectionResetError:
            self._lost("reset")
            return 0
        except (TimeoutError, BlockingIOError):
            return 0
        except OSError as exc:
            self._lost(f"error: {exc!r}")
            return 0
        if not chunk:
            self._lost("eof")
            return 0
        self.reader.feed(chunk)
        if send_acks:
            owed = self.owed_acks()
            if owed:
                with contextlib.suppress(OSError):
                    self.sock.sendall(owed)
        return len(chunk)

    def owed_acks(self) -> bytes:
        """The SETTINGS ACKs owed for the server's SETTINGS read so far (its settings,
        its receive windows among them, apply once acknowledged); counted as sent."""
        if not self.ack_settings:
            return b""
        owed = self.reader.settings_received - self._settings_acked
        self._settings_acked += owed
        return settings(ack=True) * owed

    def read_until(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Read until ``predicate()`` holds (True), or the connection closed or
        ``timeout`` passed (then the predicate's last value)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.closed is not None:
                return predicate()
            self.pump(min(remaining, 0.5))
        return True

    def wait_peer_closed(self, timeout: float) -> bool:
        """Wait, reading nothing, until the server closed or reset the connection (a
        FIN or a RST seen by the kernel, data still unread or not); whether it did.
        Sets :attr:`hung_up` (what remains unread can still be read afterwards)."""
        if self.closed is not None or self.hung_up is not None:
            return True
        poller = select.poll()
        poller.register(self.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                events = poller.poll(max(0, int(remaining * 1000)))
            except OSError:
                events = [(0, select.POLLERR)]
            if events:
                self.hung_up = "reset" if events[0][1] & select.POLLERR else "eof"
                self.hung_up_at = time.monotonic()
                return True
            if remaining <= 0:
                return False

    def read_until_closed(self, timeout: float | None = None) -> bool:
        """Read (and parse) until the server closes; whether it did within ``timeout``."""
        return self.read_until(lambda: self.closed is not None, timeout)

    def wait_answered(self, stream_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Read until every stream in ``stream_ids`` ended or was reset."""
        ids = list(stream_ids)

        def done() -> bool:
            return all(
                (view := self.streams.get(sid)) is not None
                and (view.ended or view.reset_code is not None)
                for sid in ids
            )

        return self.read_until(done, timeout)

    def unary(
        self,
        stream_id: int,
        path: str,
        payload: bytes,
        *,
        split: Sequence[int] = (),
        empty_first: bool = False,
        extra: Sequence[tuple[str, str]] = (),
        timeout: float | None = None,
    ) -> StreamView:
        """A unary call on ``stream_id``, in one write: HEADERS, then the framed message
        in DATA frames, cut at the offsets ``split`` (of the framed message) with an
        empty DATA frame between the parts, and one before it all if ``empty_first``;
        END_STREAM on the last. Waits for the stream's end or reset."""
        framed = grpc_message(payload)
        cuts = [0, *split, len(framed)]
        parts = [headers(stream_id, path, extra=extra)]
        if empty_first:
            parts.append(data(stream_id))
        for index, (lo, hi) in enumerate(itertools.pairwise(cuts)):
            if index:
                parts.append(data(stream_id))
            parts.append(data(stream_id, framed[lo:hi], end_stream=hi == len(framed)))
        self.send(b"".join(parts))
        self.wait_answered([stream_id], timeout)
        return self.stream(stream_id)


# --------------------------------------------------------------------------- flood writer


class Flood:
    """Writes ``chunks`` to ``conn`` from a background thread, in order, one
    ``sendall`` each; it stops at the first failed write: ``outcome`` is then
    "reset" (the server closed or reset the connection) or "stalled" (a write made no
    progress for ``stall`` seconds: the server stopped reading), else "sent".

    With ``read=True`` a second thread reads (and parses) what the server sends, all
    the while: the server's output never backs up, and its GOAWAY is seen. Use as a
    context manager: leaving it stops and joins the threads (bounded); the connection
    is then the caller's to read again.
    """

    def __init__(
        self,
        conn: Connection,
        chunks: Sequence[bytes],
        *,
        read: bool = False,
        stall: float = 5.0,
    ) -> None:
        self.conn = conn
        self.chunks = chunks
        self.read = read
        self.stall = stall
        self.sent = 0
        """Chunks written whole."""
        self.outcome: str | None = None
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="h2raw-flood", daemon=True)
        self._reader = threading.Thread(target=self._read, name="h2raw-flood-reader", daemon=True)

    def __enter__(self) -> Flood:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._thread.start()
        if self.read:
            self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():  # a write stuck past its bound: unblock it
            self.conn.close()
            self._thread.join(timeout)
        if self.read:
            self._reader.join(timeout)

    def _read(self) -> None:
        """Read until the flood ended (or the server closed the connection)."""
        while self._thread.is_alive() and not self._stop.is_set() and self.conn.closed is None:
            self.conn.pump(0.05, send_acks=False)

    def wait(self, timeout: float) -> bool:
        """Wait until the flood ended (whole, or stopped by the server)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        sock = self.conn.sock
        outcome = "sent"
        try:
            sock.settimeout(self.stall)
            for chunk in self.chunks:
                if self._stop.is_set():
                    outcome = "stopped"
                    break
                sock.sendall(self.conn.owed_acks() + chunk)
                self.sent += 1
                if self.conn.closed is not None:  # seen by the reader
                    outcome = "reset"
                    break
        except (BrokenPipeError, ConnectionResetError):
            outcome = "reset"
        except TimeoutError:
            outcome = "stalled"
        except OSError as exc:
            outcome = f"error: {exc!r}"
        self.ended_at = time.monotonic()
        self.outcome = outcome


# --------------------------------------------------------------------------- bystander


@dataclass
class BystanderReport:
    latencies: list[float]
    failures: list[str]

    @property
    def count(self) -> int:
        return len(self.latencies)

    @property
    def worst(self) -> float:
        return max(self.latencies, default=0.0)

    @property
    def p99(self) -> float:
        return percentile(self.latencies, 0.99)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (0.0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


class Bystander:
    """Another client: a Handshake every ``interval`` seconds (one at a time) on a
    connection of its own, from a thread with an event loop of its own, until stopped.

    A failed Handshake (an error, or none within ``timeout``) is recorded and the
    connection opened again. ``with Bystander(address) as b:`` returns once its first
    Handshake (not timed) succeeded; on leaving it is stopped and joined.
    """

    def __init__(
        self,
        address: str,
        *,
        interval: float = 0.1,
        timeout: float = 5.0,
        extra_headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.address = address
        self.extra_headers = tuple(extra_headers)
        self.interval = interval
        self.timeout = timeout
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="h2raw-bystander", daemon=True)

    def __enter__(self) -> Bystander:
        self._thread.start()
        if not self._ready.wait(self.timeout + 5):
            self.stop()
            raise AssertionError(f"the bystander's first Handshake failed: {self.failures}")
        if self.failures:
            failures = list(self.failures)
            self.stop()
            raise AssertionError(f"the bystander's first Handshake failed: {failures}")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> BystanderReport:
        self._stop.set()
        self._thread.join(self.timeout + 10)
        return self.report()

    def report(self) -> BystanderReport:
        return BystanderReport(list(self.latencies), list(self.failures))

    def _run(self) -> None:
        import asyncio

        asyncio.run(self._loop())

    async def _handshake(self, client: Any) -> None:
        from . import wire

        result = await client.unary(
            wire.HANDSHAKE, bytes(wire.client_handshake()), extra_headers=self.extra_headers
        )
        if result.end.status != 0 or result.reply is None:
            raise AssertionError(f"Handshake failed: {result.end}")

    async def _loop(self) -> None:
        import asyncio

        from . import wire

        # The first Handshake is retried for a while: the server may be starting.
        started = time.monotonic()
        first = True
        while not self._stop.is_set():
            try:
                async with wire.WireClient(self.address, timeout=self.timeout) as client:
                    await asyncio.wait_for(self._handshake(client), self.timeout)
                    if first:
                        first = False
                        self._ready.set()
                    while not self._stop.is_set():
                        await asyncio.sleep(self.interval)
                        start = time.monotonic()
                        await asyncio.wait_for(self._handshake(client), self.timeout)
                        self.latencies.append(time.monotonic() - start)
            except Exception as exc:  # every failure is a finding
                if first:
                    if time.monotonic() - started < self.timeout:
                        await asyncio.sleep(0.05)
                        continue
                    self.failures.append(repr(exc))
                    self._ready.set()
                    return
                self.failures.append(repr(exc))
                await asyncio.sleep(self.interval)


def unary_call(address: str, path: str, payload: bytes, bound: float) -> tuple[Any, ...]:
    """One unary call on ``path`` whose request stream is ``payload`` (any number of
    messages), sent as fast as the server's flow-control windows let it (h2's own state
    machine, as a real client would);
    ("status", grpc-status) when answered, ("reset", code) / ("goaway", code) / ("eof",)
    / ("nothing",) otherwise."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, request_fields(path))
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host.removeprefix("tcp://"), int(port)), timeout=bound)
    deadline = time.monotonic() + bound
    sent = 0
    try:
        while time.monotonic() < deadline:
            while sent < len(payload):
                window = conn.local_flow_control_window(1)
                n = min(window, conn.max_outbound_frame_size, len(payload) - sent)
                if n <= 0:
                    break
                conn.send_data(1, payload[sent : sent + n], end_stream=sent + n == len(payload))
                sent += n
            sock.sendall(conn.data_to_send())
            data = sock.recv(1 << 16)
            if not data:
                return ("eof",)
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                    status = dict(event.headers).get(b"grpc-status")
                    if status is not None:
                        return ("status", int(status))
                elif isinstance(event, h2.events.StreamReset):
                    return ("reset", event.error_code)
                elif isinstance(event, h2.events.ConnectionTerminated):
                    return ("goaway", event.error_code)
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
        return ("nothing",)
    finally:
        sock.close()
