"""The Join's request reader: one stream's gRPC messages, cut out inside the connection's
data callback and acknowledged to h2 only as they are consumed.

:class:`~._dispatch.Dispatcher` makes one for a direct-path call (the Join) as its stream is
accepted; :class:`~._connection.Connection` hands it the stream's DATA (past h2's frame
objects on the direct DATA path, :func:`~._h2frames.route_frames`, else from h2's
``DataReceived`` events); :class:`~._join.JoinCall` starts, pauses, stops and closes it.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

import h2.exceptions

from .._errors import FrameError, WireError
from .._wire import MessageReader
from ._states import ReaderEvent, ReaderState, reader_move

if TYPE_CHECKING:
    from grpclib.protocol import Connection as GrpclibConnection
    from h2.connection import H2Connection

log = logging.getLogger("rlmesh_trio.transport")

ACK_BATCH = 256 << 10
"""Consumed request bytes are acknowledged to h2 in batches of this size (h2 sends a
WINDOW_UPDATE only once half the 4 MiB window is consumed anyway); a stream's end, a
pause and a detach acknowledge what is left."""

# The states the per-chunk paths compare with, as module constants: an enum member read
# off its class costs a descriptor lookup each time.
_READING: Final = ReaderState.READING
_PAUSED: Final = ReaderState.PAUSED
_DONE: Final = ReaderState.DONE


class ReaderConnection(Protocol):
    """What a reader needs of its :class:`~._connection.Connection` (a protocol: that
    module builds readers, so this one cannot import it)."""

    readers: dict[int, RequestReader]
    """Stream id -> its reader: the connection hands each its stream's DATA."""
    connection: GrpclibConnection
    """grpclib's connection (``is_closing``, ``flush``: a WINDOW_UPDATE goes out)."""

    def _h2(self) -> H2Connection: ...


class RequestReader:
    """Reads one stream's gRPC messages inside the connection's data callback.

    No reader task and no queue: created by :class:`~._dispatch.Dispatcher` as the stream
    is accepted, it takes the stream's DATA from its first frame on (the
    :class:`~._connection.Connection` hands it to :meth:`feed`; grpclib's per-stream
    buffer never sees it) and holds it until the handler calls :meth:`start`; from then
    on it cuts it into messages (the prefix checked first, so an over-size message is
    refused before its body is buffered; a big body copied into one buffer as it
    arrives) and calls ``on_message`` with each, in order, on the loop.

    Back-pressure is explicit: until started, while :attr:`paused` (the session is
    saturated, a big request is being decoded off the loop) or after :meth:`stop`,
    arriving data is kept as it came and is **not** acknowledged to h2, so no
    WINDOW_UPDATE goes out and the peer can send at most its flow-control window
    (grpclib's 4 MiB) more; consuming it later acknowledges it. The stream's end (or an
    unreadable message) is reported once through ``on_end`` (None, or the
    :class:`~rlmesh_trio._errors.WireError`), after every message before it was
    delivered.

    Its state (:class:`~._states.ReaderState`) changes only through :meth:`_move`, checked
    against :data:`~._states.READER_TRANSITIONS`.
    """

    def __init__(self, connection: ReaderConnection, stream_id: int) -> None:
        self._id = stream_id
        self._connection = connection
        self._h2 = connection._h2()
        self.state = ReaderState.HOLDING
        self._on_message: Callable[[bytes | bytearray], None] = lambda message: None
        self._on_end: Callable[[WireError | None], None] = lambda error: None
        self.on_read: Callable[[bool], None] | None = None
        """``on_read(True)`` before the connection hands over one read's frames, and
        ``on_read(False)`` after them: what the messages of one read cause can be done
        once for all of them (lane wake-ups, a write)."""
        self._chunks: deque[tuple[bytes | memoryview, int]] = deque()  # data, to ack
        self.buffered = 0  # bytes received and not yet consumed
        self._consumed = 0  # flow-controlled bytes consumed, not yet acknowledged
        # The peer half-closed. Not a state: it is a fact about the input, which comes in
        # any state; the end is reported (-> DONE) once what came before it is consumed.
        self._eof = False
        # Inside _pump: a callback that resumes the reader re-enters it (a guard, not a
        # state of the reader).
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
        self._move(ReaderEvent.START)
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
        self._move(ReaderEvent.CLOSE)  # (closed twice: the Join closes, then detaches it)
        self._drop_all()
        self._flush()

    def detach(self) -> None:
        """:meth:`close`, and the stream's DATA goes back to grpclib (the call is over)."""
        self.close()
        if self._connection.readers.get(self._id) is self:
            del self._connection.readers[self._id]

    @property
    def paused(self) -> bool:
        return self.state is _PAUSED

    @paused.setter
    def paused(self, value: bool) -> None:
        # Level-triggered (the Join sets it after every event): when it says what is
        # already so, nothing is looked up.
        if value is (self.state is _PAUSED):
            return
        if self._move(ReaderEvent.PAUSE if value else ReaderEvent.RESUME) is _READING:
            self._pump()
            self._flush()

    def stop(self) -> None:
        """Consume no more (the server is draining); kept data stays unacknowledged."""
        self._move(ReaderEvent.STOP)

    def _move(self, event: ReaderEvent) -> ReaderState:
        """The one writer of :attr:`state`: ``event`` looked up in
        :data:`~._states.READER_TABLE` (a row that keeps the state: nothing to do)."""
        self.state = new = reader_move(self.state, event)
        return new

    # -- events from the connection

    def feed(self, data: bytes, flow_controlled_length: int) -> None:
        if self.state is _DONE:
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
        self._move(ReaderEvent.END)
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
        if self._consumed and self.state is not _READING:
            # Held back: what was consumed must not wait for a batch that may never come.
            self._ack(self._consumed)
            self._consumed = 0

    def _consume(self) -> None:
        chunks = self._chunks
        on_message = self._on_message
        while self.state is _READING:
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
