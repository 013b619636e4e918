"""The Join's direct DATA path past h2's frame objects and events (issue 20).

:func:`route_frames` cuts a connection's bytes into frames and hands a Join stream's plain
DATA frames to its reader (:func:`take_plain_data`), everything else to h2;
:func:`put_plain_data` queues a reply's DATA frame on h2's output. Both change exactly
what h2's ``receive_data`` / ``send_data`` would change, which reads and writes h2
privates, each listed in :mod:`._privates` (the one list of every grpclib/h2 private this
package uses), which checks them once per process; when they are not what this module
expects, the transport does not call it (h2's public API instead).
``tests/test_transport_shim.py`` feeds the same byte streams to h2 alone and to this path
and compares everything observable.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Protocol

from h2.connection import ConnectionState, H2Connection
from h2.stream import StreamState

__all__ = ["FrameSink", "h2_idle", "put_plain_data", "route_frames", "take_plain_data"]

_FRAME_HEADER = struct.Struct(">HBBBL")
"""An HTTP/2 frame header: length (24 bits, as 16 + 8), type, flags, stream id (31 bits
and the reserved bit)."""
_STREAM_ID_MASK = 0x7FFFFFFF
_DATA = 0x0
_END_STREAM = 0x1
_PADDED = 0x8


def h2_idle(h2_connection: H2Connection) -> bool:
    """Whether h2's receive side holds nothing: no partial frame, no preface still
    expected, no header block waiting for its CONTINUATION, and the connection open. Only
    then may a frame bypass h2 without changing what h2 would do with it."""
    buffer = h2_connection.incoming_buffer
    return (
        not buffer._data
        and not buffer._preamble_len
        and not buffer._headers_buffer
        and h2_connection.state_machine.state is ConnectionState.SERVER_OPEN
    )


def take_plain_data(
    h2_connection: H2Connection, frame_type: int, flags: int, stream_id: int, length: int
) -> bool:
    """Account for one received DATA frame exactly as h2's ``receive_data`` would, when
    it is a plain one on an open stream; False (nothing changed) for anything else, which
    h2 must then take itself.

    Plain: type DATA, neither END_STREAM nor PADDED, a non-empty body within our
    MAX_FRAME_SIZE, on a stream h2 has OPEN with its headers received and no
    content-length to track, and both inbound windows (connection and stream) large
    enough. For such a frame h2 does nothing but shrink the two windows and count the
    body's bytes, then emits a ``DataReceived`` with the body: the caller hands the body
    (``length`` flow-controlled bytes) to its stream's reader as that event would be.
    Anything h2 would refuse, or where it does more, goes to h2 and gets h2's answer.
    """
    if frame_type != _DATA or flags & (_END_STREAM | _PADDED) or not length:
        return False
    if length > h2_connection.max_inbound_frame_size:
        return False
    stream = h2_connection.streams.get(stream_id)
    if stream is None:
        return False
    machine = stream.state_machine
    if (
        machine.state is not StreamState.OPEN
        or not machine.headers_received
        or stream._expected_content_length is not None
    ):
        return False
    connection_window = h2_connection._inbound_flow_control_window_manager
    stream_window = stream._inbound_window_manager
    if connection_window.current_window_size < length or stream_window.current_window_size < length:
        return False
    connection_window.current_window_size -= length
    stream_window.current_window_size -= length
    stream._actual_content_length += length
    return True


def put_plain_data(
    h2_connection: H2Connection, stream_id: int, payload: bytes | memoryview
) -> bool:
    """Queue ``payload`` as one DATA frame (no flags) on h2's output exactly as h2's
    ``send_data`` would, when the stream is open for sending and the frame fits the
    windows and the peer's max frame size; False (nothing changed) otherwise, where h2's
    own ``send_data`` must be called (and raises what it raises)."""
    length = len(payload)
    if not length or length > h2_connection.max_outbound_frame_size:
        return False
    if h2_connection.state_machine.state is not ConnectionState.SERVER_OPEN:
        return False
    stream = h2_connection.streams.get(stream_id)
    if stream is None or stream.state_machine.state not in _SENDING:
        return False
    if (
        min(h2_connection.outbound_flow_control_window, stream.outbound_flow_control_window)
        < length
    ):
        return False
    stream.outbound_flow_control_window -= length
    h2_connection.outbound_flow_control_window -= length
    out = h2_connection._data_to_send
    out += _FRAME_HEADER.pack(length >> 8, length & 0xFF, _DATA, 0, stream_id)
    out += payload
    return True


class FrameSink(Protocol):
    """Where :func:`route_frames` puts a stream's DATA (:class:`RequestReader`)."""

    def feed(self, data: bytes, flow_controlled_length: int) -> None: ...


def route_frames(
    h2_connection: H2Connection,
    data: bytes,
    sinks: Mapping[int, FrameSink],
    through_h2: Callable[[bytes], bool],
    closing: Callable[[], bool],
) -> bool:
    """Cut ``data`` into frames, in order: a plain DATA frame of a stream in ``sinks``
    goes straight to its sink (:func:`take_plain_data`), every other frame -- and, once
    h2 holds anything (a partial frame, a header block), all that follows -- to
    ``through_h2`` (h2 and grpclib; False: the connection is closing). False when it
    stopped because the connection is closing; True when every byte was taken.
    """
    size = len(data)
    pos = 0
    while pos < size:
        if size - pos < 9 or not h2_idle(h2_connection):
            return through_h2(data[pos:] if pos else data)
        high, low, frame_type, flags, stream_id = _FRAME_HEADER.unpack_from(data, pos)
        end = pos + 9 + (high << 8 | low)
        if end > size:  # a partial frame: h2 buffers it (and checks its header)
            return through_h2(data[pos:] if pos else data)
        stream_id &= _STREAM_ID_MASK
        sink = sinks.get(stream_id)
        if sink is not None and take_plain_data(
            h2_connection, frame_type, flags, stream_id, end - pos - 9
        ):
            sink.feed(data[pos + 9 : end], end - pos - 9)
            if closing():
                return False
        elif not through_h2(data[pos:end] if pos or end < size else data):
            return False
        pos = end
    return True


_SENDING = frozenset({StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE})
"""The stream states in which h2's ``send_data`` changes nothing but the windows."""
