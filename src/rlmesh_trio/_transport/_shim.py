"""Every use of a grpclib (or h2) private, in one file: a grpclib upgrade is one file to read.

grpclib is pinned (0.4.9); each use below is covered by the transport tests:

* ``grpclib.server.Handler`` is subclassed (:class:`Dispatcher`) to see request headers
  before dispatch: refuse streams while stopping, refuse compressed requests, remember
  the last stream id for GOAWAY.
* ``grpclib.protocol.H2Protocol`` is subclassed (:class:`Connection`) to track
  connections, write GOAWAY frames, cut connections, and answer an HTTP/2 protocol error
  with the GOAWAY h2 prepared (grpclib closes without sending it; this reads the h2
  connection inside grpclib's ``Connection._connection``), and to refuse an over-long
  frame on its header (h2's ``incoming_buffer._data``, ``_terminate_connection``).
* ``grpclib.server.Stream._stream`` (the h2-level stream) is read directly, so a message's
  length prefix is read before its body and a big body is copied into one buffer as it
  arrives instead of being joined from thousands of chunks at the end.
* ``grpclib.events._DispatchServerEvents`` and ``Configuration.__for_server__`` build the
  handler as ``grpclib.server.Server`` does.

h2 cannot send a GOAWAY and keep serving the open streams (its state machine closes the
connection), so the GOAWAY frames of a graceful stop are written next to it with
hyperframe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import h2.config
import h2.exceptions
from grpclib.config import Configuration
from grpclib.const import Handler as MethodHandler
from grpclib.const import Status
from grpclib.encoding.base import CodecBase
from grpclib.events import _DispatchServerEvents
from grpclib.metadata import encode_grpc_message
from grpclib.protocol import H2Protocol
from grpclib.server import Handler as GrpclibHandler
from grpclib.server import Stream
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame

from .._errors import CompressedRequestError, FrameError, UnauthenticatedError
from .._wire import PREFIX_SIZE, parse_prefix

if TYPE_CHECKING:
    from grpclib.protocol import Stream as H2Stream

log = logging.getLogger("rlmesh_trio.transport")

CHUNK = 1 << 20
"""Bytes read from grpclib's stream buffer at a time for a big message."""

SMALL_MESSAGE = 1 << 20
"""Messages up to this size are read in one piece; bigger ones into one preallocated
buffer, chunk by chunk (no list of chunks and no join: peak memory is one copy)."""


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
        header_encoding="ascii",
        validate_inbound_headers=False,
        validate_outbound_headers=False,
        normalize_inbound_headers=False,
        normalize_outbound_headers=False,
    )
    return Configuration().__for_server__(), h2_config


def h2_stream(stream: Stream[Any, Any]) -> H2Stream:
    raw: H2Stream = stream._stream
    return raw


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    for key, value in headers:
        if key == name:
            return value
    return None


class Dispatcher(GrpclibHandler):
    """One per connection: grpclib's request dispatcher, with our admission checks."""

    def __init__(self, admission: Admission, mapping: MethodTable, codec: CodecBase) -> None:
        super().__init__(mapping, codec, None, _DispatchServerEvents())
        self._admission = admission
        self.last_stream_id = 0

    def accept(
        self, stream: H2Stream, headers: list[tuple[str, str]], release_stream: Callable[[], Any]
    ) -> None:
        if self._admission.closing:
            # After GOAWAY: "not processed, safe to retry elsewhere".
            stream.reset_nowait(ErrorCodes.REFUSED_STREAM)
            release_stream()
            return
        if stream.id is not None:
            self.last_stream_id = max(self.last_stream_id, stream.id)
        error: Exception | None = None
        if not self._admission.authorized(
            _header(headers, ":path"), _header(headers, "authorization")
        ):
            error = UnauthenticatedError()
        else:
            encoding = _header(headers, "grpc-encoding")
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


class Connection(H2Protocol):
    """One HTTP/2 connection; tracked so a stop can GOAWAY and cut every connection."""

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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._transport = cast(asyncio.Transport, transport)
        ensure_nodelay(transport)
        self._registry.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._registry.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """grpclib's ``data_received``, but a protocol error sends h2's GOAWAY first.

        On a protocol error (garbage after the preface, a frame over our MAX_FRAME_SIZE,
        ...) h2 queues a GOAWAY with the error's code and raises; grpclib would close the
        transport without writing it. The reference sends GOAWAY (PROTOCOL_ERROR /
        FRAME_SIZE_ERROR) and closes: so do we.
        """
        try:
            events = self.connection.feed(data)
        except h2.exceptions.ProtocolError as exc:
            self._protocol_error(exc)
            return
        self.connection.flush()
        for event in events:
            self.processor.process(event)
        self.connection.flush()
        self._check_partial_frame()

    def _protocol_error(self, exc: Exception) -> None:
        log.debug("HTTP/2 protocol error (%r); GOAWAY and close", exc)
        transport = self._transport
        with contextlib.suppress(Exception):
            pending = self.connection._connection.data_to_send()
            if pending and transport is not None and not transport.is_closing():
                transport.write(pending)
        self.processor.close("Protocol error")

    def _check_partial_frame(self) -> None:
        """A frame whose header announces more than our MAX_FRAME_SIZE is an error at once.

        h2 checks a frame's length only when its whole body has arrived, so a header
        announcing 16 MiB would hold the connection open waiting for it; the reference
        answers GOAWAY(FRAME_SIZE_ERROR) on the header, and so do we. Reads h2's frame
        buffer (``H2Connection.incoming_buffer``).
        """
        h2_connection = self.connection._connection
        buffer = h2_connection.incoming_buffer
        pending = buffer._data
        if len(pending) < 9:
            return
        length = int.from_bytes(pending[:3], "big")
        if length > buffer.max_frame_size:
            h2_connection._terminate_connection(ErrorCodes.FRAME_SIZE_ERROR)
            self._protocol_error(
                h2.exceptions.FrameTooLargeError(f"frame of {length} bytes announced")
            )

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


async def read_message(stream: Stream[Any, Any], limit: int) -> bytes | bytearray | None:
    """Read one length-prefixed message; None when the client half-closed.

    The prefix is read first, so an over-size message is refused before its body is
    buffered (:class:`~rlmesh_trio._errors.MessageTooLarge`); a big body is copied into
    one ``bytearray`` as it arrives. Raises :class:`~rlmesh_trio._errors.FrameError` for a
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
        buffer = bytearray(length)
        view = memoryview(buffer)
        pos = 0
        while pos < length:
            chunk = await raw.recv_data(min(CHUNK, length - pos))
            if not chunk:
                raise FrameError("truncated message")
            view[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
            del chunk
        view.release()
        return buffer
    except AssertionError as exc:  # grpclib's Buffer: EOF inside a message
        raise FrameError("truncated message") from exc


def reset_if_open(stream: Stream[Any, Any]) -> None:
    """After our trailers: whatever the client still sends on this stream is not read."""
    raw = h2_stream(stream)
    if raw.closable:
        raw.reset_nowait()
