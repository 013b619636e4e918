"""The transport's two state machines, each one table keyed by (state, event), as h11's.

* :class:`JoinState`, a Join stream's (:class:`~._join.JoinCall`), moved by a
  :class:`JoinEvent` through :data:`JOIN_TABLE`. docs/architecture.md carries the same
  table (``tests/test_transport_states.py`` reads it and compares), so the documented
  machine is the one the driver runs.
* :class:`ReaderState`, its request reader's (:class:`~._reader.RequestReader`), moved by
  a :class:`ReaderEvent` through :data:`READER_TABLE`.

Every change of a state goes through its owner's one ``_move(event)``, which looks the
``(state, event)`` pair up: a pair not in the table is a bug of the transport and raises
:class:`TransportStateError`, as a lane's does (``_lanes/_state.py``). An event that may
come where it has nothing to do (``finish()`` on a stream already flushing) is a row of
its own that leads back to the same state: every such case is named in the table, and
any other fails the check rather than being passed over.

Adding a state means a member here, its rows in the table (and, for the Join, in the
doc's), and the owner's calls that raise the events to and from it.

What is not a state, and why (each a plain attribute of its owner):

* ``JoinCall.in_read``: inside one read's requests, so that the Join flushes once, at
  the read's end. It spans calls in any state (a read may end the stream).
* ``JoinCall.sending``: the writer task is inside an awaited send. It is the writer's
  progress, in open, not_reading and flushing alike.
* ``JoinCall.session_told``: the session learned the stream's end (it performed
  EndStream, or ``on_stream_end()`` was called): it follows the session, which ends the
  stream itself or has it end (break) under it, once either way.
* ``RequestReader._eof``: the peer half-closed. A fact about the input, which comes in
  any state; the end is reported (the END event) once what came before it is consumed.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = [
    "JOIN_TABLE",
    "JOIN_TRANSITIONS",
    "READER_TABLE",
    "READER_TRANSITIONS",
    "JoinEvent",
    "JoinState",
    "ReaderEvent",
    "ReaderState",
    "TransportStateError",
    "join_move",
    "reader_move",
]


class JoinState(enum.Enum):
    """Where a Join stream is (docs/architecture.md has the table of its moves)."""

    OPEN = "open"
    """Requests are read and answered."""
    DECODING = "decoding"
    """A request over ``OFF_LOOP_DECODE_BYTES`` is being decoded on the worker thread:
    the reader waits (requests stay in order); replies still go out."""
    NOT_READING = "not_reading"
    """No more requests are read (the server drains, or the client's requests ended);
    what is in flight is still answered."""
    FLUSHING = "flushing"
    """The stream ends: the queued replies go out, then the trailers (status as set)."""
    BROKEN = "broken"
    """The stream is gone (a send failed, the call was cancelled): nothing more is sent."""
    CLOSED = "closed"
    """The Join's handler has returned."""


class JoinEvent(enum.Enum):
    """What moves a Join stream (docs/architecture.md has the table)."""

    DECODE_OFF_LOOP = "decode_off_loop"
    """A request over ``OFF_LOOP_DECODE_BYTES`` goes to the worker thread."""
    DECODED = "decoded"
    """The worker decoded it."""
    STOP_READING = "stop_reading"
    """The server drains, or the requests ended (half-close, an unreadable request)."""
    FINISH = "finish"
    """The session ended the stream (EndStream), a failure set its status, or the
    handler saw the requests end."""
    BREAK = "break"
    """A send failed, or the call was cancelled (client reset, disconnect, server cut)."""
    CLOSE = "close"
    """The trailers went out, or the handler returned."""


_J = JoinState
_JE = JoinEvent

JOIN_TABLE: Final[dict[tuple[JoinState, JoinEvent], JoinState]] = {
    (_J.OPEN, _JE.DECODE_OFF_LOOP): _J.DECODING,
    (_J.DECODING, _JE.DECODED): _J.OPEN,
    # decoded after reading stopped (or the stream ended): the request is not read
    (_J.NOT_READING, _JE.DECODED): _J.NOT_READING,
    (_J.FLUSHING, _JE.DECODED): _J.FLUSHING,
    (_J.BROKEN, _JE.DECODED): _J.BROKEN,
    (_J.CLOSED, _JE.DECODED): _J.CLOSED,
    (_J.OPEN, _JE.STOP_READING): _J.NOT_READING,
    (_J.DECODING, _JE.STOP_READING): _J.NOT_READING,  # the request being decoded: not read
    # reading is over already (the server's drain may come after)
    (_J.NOT_READING, _JE.STOP_READING): _J.NOT_READING,
    (_J.FLUSHING, _JE.STOP_READING): _J.FLUSHING,
    (_J.BROKEN, _JE.STOP_READING): _J.BROKEN,
    (_J.CLOSED, _JE.STOP_READING): _J.CLOSED,
    (_J.OPEN, _JE.FINISH): _J.FLUSHING,
    (_J.DECODING, _JE.FINISH): _J.FLUSHING,
    (_J.NOT_READING, _JE.FINISH): _J.FLUSHING,
    # ending already (a failure after EndStream, a late session event)
    (_J.FLUSHING, _JE.FINISH): _J.FLUSHING,
    (_J.BROKEN, _JE.FINISH): _J.BROKEN,
    (_J.CLOSED, _JE.FINISH): _J.CLOSED,
    (_J.OPEN, _JE.BREAK): _J.BROKEN,
    (_J.DECODING, _JE.BREAK): _J.BROKEN,
    (_J.NOT_READING, _JE.BREAK): _J.BROKEN,
    (_J.FLUSHING, _JE.BREAK): _J.BROKEN,
    # nothing is sent already (a failed send, then the handler's end)
    (_J.BROKEN, _JE.BREAK): _J.BROKEN,
    (_J.CLOSED, _JE.BREAK): _J.CLOSED,
    (_J.FLUSHING, _JE.CLOSE): _J.CLOSED,  # the queued replies and the trailers went out
    (_J.BROKEN, _JE.CLOSE): _J.CLOSED,  # the handler returned
}
"""Every ``(state, event)`` a Join stream may meet, and the state it leads to; anything
else is a transport bug."""

JOIN_TRANSITIONS: Final[frozenset[tuple[JoinState, JoinState]]] = frozenset(
    (old, new) for (old, _), new in JOIN_TABLE.items() if old is not new
)
"""The ``(from, to)`` moves of :data:`JOIN_TABLE` that change the state."""


class ReaderState(enum.Enum):
    """Where a Join's request reader is: whether what arrives is consumed."""

    HOLDING = "holding"
    """Accepted, its handler not started yet: data is kept, unacknowledged."""
    READING = "reading"
    """Started: messages are cut out and delivered as data arrives."""
    PAUSED = "paused"
    """Back-pressure (the session is saturated, a big request is being decoded): data is
    kept, unacknowledged, until it is resumed."""
    STOPPED = "stopped"
    """The Join reads no more (the server drains, the stream ends): data is kept,
    unacknowledged, until the reader is closed."""
    DONE = "done"
    """The end was reported, or the reader was closed: what arrives is acknowledged and
    dropped."""


class ReaderEvent(enum.Enum):
    """What moves a request reader."""

    START = "start"
    """The Join's handler started it."""
    PAUSE = "pause"
    """``paused = True``: back-pressure (level-triggered: set after every Join event)."""
    RESUME = "resume"
    """``paused = False``."""
    STOP = "stop"
    """The Join reads no more (the server drains, the stream ends)."""
    END = "end"
    """The input ended: a half-close once what came before it was consumed, an
    unreadable message, or a failing handler."""
    CLOSE = "close"
    """The reader is closed: nothing more is consumed, ever."""


_R = ReaderState
_RE = ReaderEvent

READER_TABLE: Final[dict[tuple[ReaderState, ReaderEvent], ReaderState]] = {
    (_R.HOLDING, _RE.START): _R.READING,  # what was held comes first
    (_R.READING, _RE.PAUSE): _R.PAUSED,
    # paused already, or reading nothing either way
    (_R.PAUSED, _RE.PAUSE): _R.PAUSED,
    (_R.STOPPED, _RE.PAUSE): _R.STOPPED,
    (_R.DONE, _RE.PAUSE): _R.DONE,
    (_R.PAUSED, _RE.RESUME): _R.READING,  # what was kept is consumed now
    # not paused: nothing to resume
    (_R.HOLDING, _RE.RESUME): _R.HOLDING,
    (_R.READING, _RE.RESUME): _R.READING,
    (_R.STOPPED, _RE.RESUME): _R.STOPPED,
    (_R.DONE, _RE.RESUME): _R.DONE,
    (_R.READING, _RE.STOP): _R.STOPPED,
    (_R.PAUSED, _RE.STOP): _R.STOPPED,
    # stopped already, or done (the Join stops its reader on every way out of reading)
    (_R.STOPPED, _RE.STOP): _R.STOPPED,
    (_R.DONE, _RE.STOP): _R.DONE,
    # the end reported (a handler that fails may have paused or stopped it first)
    (_R.READING, _RE.END): _R.DONE,
    (_R.PAUSED, _RE.END): _R.DONE,
    (_R.STOPPED, _RE.END): _R.DONE,
    (_R.HOLDING, _RE.CLOSE): _R.DONE,  # the call was over before its handler started
    (_R.READING, _RE.CLOSE): _R.DONE,
    (_R.PAUSED, _RE.CLOSE): _R.DONE,
    (_R.STOPPED, _RE.CLOSE): _R.DONE,  # what was kept is given back to the window
    (_R.DONE, _RE.CLOSE): _R.DONE,  # closed twice: the Join closes it, then detaches it
}
"""Every ``(state, event)`` a request reader may meet, and the state it leads to;
anything else is a transport bug."""

READER_TRANSITIONS: Final[frozenset[tuple[ReaderState, ReaderState]]] = frozenset(
    (old, new) for (old, _), new in READER_TABLE.items() if old is not new
)
"""The ``(from, to)`` moves of :data:`READER_TABLE` that change the state."""


class TransportStateError(RuntimeError):
    """A Join stream or its reader met an event its table does not hold in its state
    (a bug)."""


def join_move(state: JoinState, event: JoinEvent) -> JoinState:
    """The state ``event`` leads to from ``state``; :class:`TransportStateError` when
    :data:`JOIN_TABLE` has no such row."""
    new = JOIN_TABLE.get((state, event))
    if new is None:
        raise TransportStateError(f"Join stream: no {event.value} from {state.value}")
    return new


def reader_move(state: ReaderState, event: ReaderEvent) -> ReaderState:
    """The state ``event`` leads to from ``state``; :class:`TransportStateError` when
    :data:`READER_TABLE` has no such row."""
    new = READER_TABLE.get((state, event))
    if new is None:
        raise TransportStateError(f"request reader: no {event.value} from {state.value}")
    return new
