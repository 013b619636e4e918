"""gRPC over one HTTP/2 connection, sans-IO: the ``h2`` state machine plus gRPC framing.

The drivers (:mod:`._endpoint` on Trio, :mod:`._blocking` on a plain socket) only move
bytes: they feed what they read to :meth:`GrpcConnection.receive` and write whatever
:meth:`GrpcConnection.data_to_send` returns. Outgoing messages are queued whole, so a
caller cancelled at any point never leaves half a gRPC message on a stream; the queue
drains as the peer's flow-control windows allow.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Sequence
from typing import Any, Final

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import h2.stream

from .._wire import MessageReader, decode_grpc_message, frame

__all__ = ["MAX_MESSAGE_SIZE", "Call", "GrpcConnection"]

MAX_MESSAGE_SIZE: Final = 256 * 1024 * 1024
"""The reference's per-message limit (SPEC §1.8), both directions."""

_WINDOW: Final = 16 * 1024 * 1024
"""Our receive window (stream and connection): replies are rarely held by flow control."""


class Call:
    """One gRPC call (an HTTP/2 stream): received messages, how it ended, what to send."""

    __slots__ = (
        "_outbound",
        "_reader",
        "ended",
        "headers",
        "id",
        "lost",
        "messages",
        "path",
        "status",
        "status_message",
    )

    def __init__(self, stream_id: int, path: str = "") -> None:
        self.id = stream_id
        self.path = path
        self.headers: dict[str, str] | None = None
        self.messages: collections.deque[bytes] = collections.deque()
        self.status: int | None = None
        self.status_message = ""
        self.ended = False
        """The server's side is over (trailers, reset or connection loss)."""
        self.lost: str | None = None
        """Why the call ended without a gRPC status (stream reset, connection gone)."""
        self._reader = MessageReader(MAX_MESSAGE_SIZE)
        self._outbound: collections.deque[tuple[memoryview, bool]] = collections.deque()

    def end_with(self, block: list[tuple[str, str]]) -> None:
        values = dict(block)
        status = values.get("grpc-status")
        if status is not None:
            try:
                self.status = int(status)
            except ValueError:
                self.lost = f"unreadable grpc-status {status!r}"
            self.status_message = decode_grpc_message(values.get("grpc-message", ""))
        elif self.lost is None:
            self.lost = "the stream ended without a grpc-status"
        self.ended = True


class GrpcConnection:
    """The client side of one HTTP/2 connection carrying gRPC calls: h2c (prior
    knowledge) or, with ``tls``, h2 inside a TLS session the driver set up (ALPN ``h2``)."""

    def __init__(
        self, authority: str, metadata: list[tuple[str, str]], *, tls: bool = False
    ) -> None:
        self._authority = authority
        self._scheme = "https" if tls else "http"
        self._tls = tls
        self._metadata = metadata
        self._h2 = _GracefulH2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self._calls: dict[int, Call] = {}
        self.lost: str | None = None
        """Set once the connection is gone; every call then fails with it."""
        self.goaway = False
        """The server sent GOAWAY (of any code)."""
        self.shutting_down = False
        """The server sent a graceful GOAWAY (NO_ERROR): it is stopping, and a call it
        cuts afterwards was cut by its shutdown."""
        self.pings_acked = 0
        self._preface: bytearray | None = bytearray()
        self._inbox = bytearray()
        """Received bytes past the last whole frame (see :meth:`_frames`)."""
        self._in_headers = False
        """h2 holds a header block awaiting its CONTINUATION: every frame goes to h2."""
        self._taken = 0
        """DATA bytes read past h2 (:meth:`_frames`) since the last WINDOW_UPDATE for them."""
        self._taken_by: dict[int, int] = {}
        """The same by stream."""
        self._updates = b""
        """WINDOW_UPDATE frames for those bytes, sent ahead of h2's own output."""
        self._h2.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 16384,
            },
        )
        self._h2.initiate_connection()
        self._h2.increment_flow_control_window(_WINDOW - 65535)

    # ---- output ------------------------------------------------------------------------

    @property
    def tls(self) -> bool:
        """The driver runs this connection inside a TLS session."""
        return self._tls

    @property
    def heard_from_server(self) -> bool:
        """The server's first frame (SETTINGS) has arrived."""
        return self._preface is None

    def data_to_send(self) -> bytes:
        if self._updates:
            updates, self._updates = self._updates, b""
            return updates + self._h2.data_to_send()
        return self._h2.data_to_send()

    def open(self, path: str) -> Call:
        """Start a call (request headers go out with the next :meth:`data_to_send`)."""
        self._check()
        stream_id = self._h2.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", self._scheme),
            (":path", path),
            (":authority", self._authority),
            ("te", "trailers"),
            ("content-type", "application/grpc"),
            ("user-agent", "rlmesh-trio-client"),
            *self._metadata,
        ]
        self._h2.send_headers(stream_id, headers)
        call = self._calls[stream_id] = Call(stream_id, path)
        return call

    def send(self, call: Call, message: bytes, *, end: bool = False) -> None:
        """Queue one whole gRPC message (and END_STREAM after it if ``end``)."""
        self.send_many(call, [message], end=end)

    def send_many(self, call: Call, messages: Sequence[bytes], *, end: bool = False) -> None:
        """Queue whole gRPC messages back to back (one DATA frame when they fit)."""
        self._check()
        for message in messages:
            if len(message) > MAX_MESSAGE_SIZE:
                raise ValueError(
                    f"message of {len(message)} bytes over the {MAX_MESSAGE_SIZE}-byte limit"
                )
        if call.ended:
            return
        data = frame(messages[0]) if len(messages) == 1 else b"".join(map(frame, messages))
        call._outbound.append((memoryview(data), end))
        self._pump(call)

    def cancel(self, call: Call) -> None:
        """RST_STREAM(CANCEL) a call that is still open; forget it either way."""
        self._calls.pop(call.id, None)
        call._outbound.clear()
        if self.lost is None and not call.ended:
            with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                self._h2.reset_stream(call.id, h2.errors.ErrorCodes.CANCEL)
        call.ended = True
        if call.status is None and call.lost is None:
            call.lost = "cancelled by the client"

    def forget(self, call: Call) -> None:
        self._calls.pop(call.id, None)
        self._taken_by.pop(call.id, None)

    def ping(self, opaque: bytes) -> None:
        self._check()
        self._h2.ping(opaque)

    def close(self) -> None:
        """GOAWAY(NO_ERROR) if the connection still works (the driver then closes the socket)."""
        if self.lost is None:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.close_connection()
        self.lose("the connection was closed by the client")

    def _check(self) -> None:
        if self.lost is not None:
            raise ConnectionError(self.lost)

    def _pump(self, call: Call) -> None:
        """Move queued bytes of ``call`` into h2 as far as the windows allow."""
        h2c = self._h2
        while call._outbound:
            view, end = call._outbound[0]
            window = min(h2c.local_flow_control_window(call.id), h2c.max_outbound_frame_size)
            if window <= 0 and view:
                return
            chunk = view[:window]
            rest = view[len(chunk) :]
            last = not rest
            if end and last:
                h2c.send_data(call.id, chunk.tobytes(), end_stream=True)
            else:
                self._send_data(call.id, chunk)
            if last:
                call._outbound.popleft()
            else:
                call._outbound[0] = (rest, end)

    def _send_data(self, stream_id: int, chunk: memoryview) -> None:
        """One DATA frame of ``chunk`` (no flags; within the windows, as :meth:`_pump`
        cut it), written as h2's ``send_data`` would write it and counted against the
        same windows, without its per-frame objects and log formatting (~8 us a
        request). h2 does it when the stream or connection is not plainly open."""
        h2c = self._h2
        stream = h2c.streams.get(stream_id)
        out = getattr(h2c, "_data_to_send", None)
        if (
            not _DIRECT_DATA
            or stream is None
            or stream.state_machine.state not in _SENDING
            or h2c.state_machine.state is not h2.connection.ConnectionState.CLIENT_OPEN
            or not isinstance(out, bytearray)
        ):
            h2c.send_data(stream_id, chunk.tobytes())
            return
        n = len(chunk)
        h2c.outbound_flow_control_window -= n
        stream.outbound_flow_control_window -= n
        out += n.to_bytes(3, "big") + b"\x00\x00" + stream_id.to_bytes(4, "big")
        out += chunk

    # ---- input -------------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Feed bytes read from the socket; the calls' state changes accordingly."""
        if self.lost is not None:
            return
        if not data:
            if self._preface is not None and not self._tls:
                tls_record = len(self._preface) >= 2 and self._preface[0] in (0x15, 0x16)
                self.lose(
                    "the server speaks TLS and this connection is plaintext: connect with "
                    "tls=True, a CA file or an ssl.SSLContext"
                    if tls_record and self._preface[1] == 0x03
                    else "the server closed the connection before its HTTP/2 settings "
                    "(if it serves TLS, connect with tls=...)"
                )
            elif self._preface is not None:
                self.lose(
                    "the server closed the TLS connection before its HTTP/2 settings (an "
                    "mTLS server does so when the client presents no certificate it trusts)"
                )
            else:
                self.lose("the server closed the connection")
            return
        if self._preface is not None:
            # A server's first frame is SETTINGS (RFC 9113 §3.4); h2 would buffer a bogus
            # "frame" of up to 16 MiB before saying anything. Tell an HTTP/1 or TLS peer
            # at once.
            self._preface += data
            if len(self._preface) < 9:
                return
            head, data, self._preface = bytes(self._preface[:9]), bytes(self._preface), None
            if head[3] != 0x04:
                if not self._tls and head[0] in (0x15, 0x16) and head[1] == 0x03:
                    self.lose(  # a TLS record (alert or handshake): a TLS server
                        "the server speaks TLS and this connection is plaintext: "
                        "connect with tls=True, a CA file or an ssl.SSLContext"
                    )
                else:
                    self.lose(
                        "HTTP/2 protocol error from the server: it does not speak HTTP/2 "
                        f"(prior knowledge{' over TLS' if self._tls else ', no TLS'}): "
                        f"its first bytes are {head!r}"
                    )
                return
        self._frames(data)

    def _frames(self, data: bytes) -> None:
        """Whole frames of ``data`` (and what was left of the last read) in order: a
        plain DATA frame of a call whose response headers came is split into messages
        here, everything else goes to h2.

        h2 reads a frame in ~30 us (it also formats each frame's repr for its logger);
        a reply is one or a few DATA frames, so this is most of a step's reading. h2
        never sees those bytes: they are counted here and given back to the server in
        WINDOW_UPDATE frames of our own (connection and stream) once half the window
        is used, as h2 does for the rest. A frame with flags (END_STREAM, PADDED), of a
        stream h2 must judge, past the frame size limit, or inside a header block is
        h2's, which checks it as ever."""
        inbox = self._inbox
        if inbox:  # a frame was left partial by the last read
            inbox += data
            buf: bytes | bytearray = inbox
        else:  # the common case: frames read straight from this read's bytes
            buf = data
        size = len(buf)
        view = memoryview(buf)  # slices copied once, by bytes(), not twice
        try:
            pos, slow = self._scan(view, size)
            rest = bytes(view[slow:pos]) if slow < pos and self.lost is None else b""
            tail = bytes(view[pos:]) if buf is data and pos < size else b""
        finally:
            view.release()
        if buf is inbox:
            del inbox[:pos]
        elif tail:
            inbox += tail
        if rest:
            self._h2_frames(rest)

    def _scan(self, view: memoryview, size: int) -> tuple[int, int]:
        """:meth:`_frames`' loop over the whole frames in ``view``: where it stopped
        (the start of a partial frame, or ``size``) and where the frames not yet given
        to h2 start."""
        limit = self._h2.max_inbound_frame_size
        pos = 0
        slow = 0  # start of the run of frames for h2 not yet given to it
        while size - pos >= 9:
            length = int.from_bytes(view[pos : pos + 3], "big")
            end = pos + 9 + length
            if length > limit:
                return size, slow  # h2 refuses the frame (too large): all of it is h2's
            if end > size:
                break
            kind, flags = view[pos + 3], view[pos + 4]
            if kind == 0 and not flags and not self._in_headers:
                stream_id = int.from_bytes(view[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                call = self._calls.get(stream_id)
                if call is not None and call.headers is not None and not call.ended:
                    if slow < pos:
                        self._h2_frames(bytes(view[slow:pos]))
                        if self.lost is not None:
                            return size, size
                    if not call.ended:
                        self._take(call, bytes(view[pos + 9 : end]))
                    else:  # the frames before ended it: dropped, its window given back
                        self._take_window(None, length)
                    slow = pos = end
                    continue
            elif kind in (1, 5, 9):  # HEADERS, PUSH_PROMISE, CONTINUATION
                self._in_headers = not flags & 0x4  # END_HEADERS
            pos = end
        return pos, slow

    def _take(self, call: Call, payload: bytes) -> None:
        """A DATA frame's payload read past h2: its messages, and the window it used."""
        self._split(call, payload)
        self._take_window(call, len(payload))

    def _take_window(self, call: Call | None, n: int) -> None:
        """``n`` bytes of DATA read past h2, on ``call``'s stream (None: one that ended):
        WINDOW_UPDATEs for them once they reach half the window."""
        if not n:
            return
        half = _WINDOW // 2
        self._taken += n
        if call is not None:
            taken = self._taken_by[call.id] = self._taken_by.get(call.id, 0) + n
            if taken >= half and not call.ended:
                self._updates += _window_update(call.id, taken)
                self._taken_by[call.id] = 0
        if self._taken >= half:
            self._updates += _window_update(0, self._taken)
            self._taken = 0

    def _h2_frames(self, data: bytes) -> None:
        """Whole frames through h2; the calls' state changes accordingly."""
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            self.lose(f"HTTP/2 protocol error from the server: {exc}")
            return
        pump = False
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                call = self._calls.get(event.stream_id)
                if event.flow_controlled_length:
                    self._h2.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
                if call is not None:
                    self._split(call, event.data)
            elif isinstance(event, h2.events.ResponseReceived):
                call = self._calls.get(event.stream_id)
                if call is not None:
                    block = [(str(k), str(v)) for k, v in event.headers]
                    call.headers = dict(block)
                    if "grpc-status" in call.headers:  # trailers-only
                        call.end_with(block)
            elif isinstance(event, h2.events.TrailersReceived):
                call = self._calls.get(event.stream_id)
                if call is not None:
                    call.end_with([(str(k), str(v)) for k, v in event.headers])
            elif isinstance(event, h2.events.StreamEnded):
                call = self._calls.get(event.stream_id)
                if call is not None and not call.ended:
                    call.end_with([])
            elif isinstance(event, h2.events.StreamReset):
                call = self._calls.get(event.stream_id)
                if call is not None and not call.ended:
                    call.lost = f"the server reset the stream (error code {int(event.error_code)})"
                    call.ended = True
            elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                pump = True
            elif isinstance(event, h2.events.PingAckReceived):
                self.pings_acked += 1
            elif isinstance(event, h2.events.ConnectionTerminated):
                self._goaway(event)
        if pump:
            for call in list(self._calls.values()):
                if call._outbound:
                    self._pump(call)

    def _split(self, call: Call, data: bytes | memoryview) -> None:
        rest: bytes | memoryview | None = data
        while rest is not None:
            try:
                message, rest = call._reader.cut(rest)
            except Exception as exc:
                self.lose(f"bad gRPC message from the server: {exc}")
                return
            if message is not None:
                call.messages.append(bytes(message) if isinstance(message, bytearray) else message)

    def _goaway(self, event: Any) -> None:
        self.goaway = True
        code = int(event.error_code or 0)
        if code == 0 and self.lost is None:
            self.shutting_down = True
        last = event.last_stream_id
        for call in self._calls.values():
            if not call.ended and (code != 0 or last is None or call.id > last):
                call.lost = f"the server sent GOAWAY (error code {code})"
                call.ended = True
        if code != 0:
            self.lose(f"the server ended the connection (GOAWAY error code {code})")

    def lose(self, why: str) -> None:
        if self.lost is not None:
            return
        self.lost = why
        for call in self._calls.values():
            if not call.ended:
                call.lost = why
                call.ended = True


_SENDING: Final = (h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_REMOTE)
"""The stream states h2 sends DATA in."""

_DIRECT_DATA: Final = os.environ.get("RLMESH_TRIO_DIRECT_DATA", "1") != "0"
"""Whether a request's DATA frames may be written past h2 (h2's private ``_data_to_send``,
listed with the transport's in ``_transport/_privates.py``). ``RLMESH_TRIO_DIRECT_DATA=0``
makes every frame go through ``h2.send_data``, as it does the server's."""


def _window_update(stream_id: int, increment: int) -> bytes:
    """A WINDOW_UPDATE frame (RFC 9113 §6.9)."""
    return b"\x00\x00\x04\x08\x00" + stream_id.to_bytes(4, "big") + increment.to_bytes(4, "big")


class _GracefulH2Connection(h2.connection.H2Connection):
    """h2 treats every received GOAWAY as the end of the connection and refuses the
    frames that follow; a graceful one (NO_ERROR, sent by a server that stops) still lets
    the streams already open finish, so keep accepting their replies and trailers."""

    def _receive_goaway_frame(self, frame: Any) -> Any:
        state = self.state_machine.state
        result = super()._receive_goaway_frame(frame)
        if frame.error_code == 0:
            self.state_machine.state = state
        return result
