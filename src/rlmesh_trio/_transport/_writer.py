"""A Join's output: its replies written to the connection (the reader's twin, :mod:`._reader`).

* The fast path (issue 9): :class:`StreamSender` writes a reply's DATA frames with the
  connection's h2 (grpclib's public ``Connection.write_ready`` says the socket takes
  them) at once when the flow-control window takes them, past h2's frame objects where
  the direct DATA path is on (:func:`~._h2frames.put_plain_data`); the frames reach the
  socket in one write at the end of the loop callback.
* Otherwise :func:`send_framed` sends an already framed message with grpclib's h2-level
  ``Stream.send_data`` (its flow control and write-ready waits).
* :func:`reset_if_open`: after our trailers, the rest of a request is not read.

What it writes on is handed to it by the connection (:class:`Output`), never read from
the connection's own attributes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from grpclib.protocol import Connection as GrpclibConnection
from grpclib.server import Stream
from h2.connection import H2Connection

from ._dispatch import h2_stream
from ._h2frames import put_plain_data


@dataclass(frozen=True, slots=True)
class Output:
    """What a connection's replies are written with: grpclib's connection (its
    ``write_ready``), the h2 connection, the socket's transport, and whether the direct
    DATA path is on."""

    connection: GrpclibConnection
    h2: H2Connection
    transport: asyncio.Transport
    direct: bool


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

    def __init__(self, output: Output, stream_id: int) -> None:
        self._id = stream_id
        self._connection = output.connection
        self._h2 = output.h2
        self._transport = output.transport
        self._direct = output.direct

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
