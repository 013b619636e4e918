"""The transport's two state machines, each one table of the moves allowed between states.

* :class:`JoinState`, a Join stream's (:class:`~._join.JoinCall`), checked against
  :data:`JOIN_TRANSITIONS`. docs/architecture.md carries the same table
  (``tests/test_transport_states.py`` reads it and compares), so the documented machine is
  the one the driver runs.
* :class:`ReaderState`, its request reader's (:class:`~._reader.RequestReader`), checked
  against :data:`READER_TRANSITIONS`.

Every change of a state goes through its owner's one ``_move``, which checks the
``(from, to)`` pair against the table: a pair not in it is a bug of the transport and
raises :class:`TransportStateError`, as a lane's does (``_lanes/_state.py``). A call that
may come in a state where it has nothing to do (``finish()`` on a stream already ending)
names those states, as a constant beside its owner, and moves from any other: a state it
does not name fails the check rather than being passed over.

Adding a state means a member here, its rows in the table (and, for the Join, in the
doc's), and the owner's calls that move to and from it.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = [
    "JOIN_TRANSITIONS",
    "READER_TRANSITIONS",
    "JoinState",
    "ReaderState",
    "TransportStateError",
    "check_join_move",
    "check_reader_move",
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


_J = JoinState

JOIN_TRANSITIONS: Final[frozenset[tuple[JoinState, JoinState]]] = frozenset(
    {
        (_J.OPEN, _J.DECODING),  # a big request goes to the worker thread
        (_J.DECODING, _J.OPEN),  # it is decoded: the session gets it, the reader goes on
        # stop_reading(): the server drains, reading was over before the stream started,
        # or the requests ended (half-close, unreadable request); a request being decoded
        # is then not read.
        (_J.OPEN, _J.NOT_READING),
        (_J.DECODING, _J.NOT_READING),
        # finish(): the session ended the stream (EndStream), a failure set its status, or
        # (from not_reading) the handler saw the requests end.
        (_J.OPEN, _J.FLUSHING),
        (_J.DECODING, _J.FLUSHING),
        (_J.NOT_READING, _J.FLUSHING),
        # A send failed, or the call was cancelled (client reset, disconnect, server cut).
        (_J.OPEN, _J.BROKEN),
        (_J.DECODING, _J.BROKEN),
        (_J.NOT_READING, _J.BROKEN),
        (_J.FLUSHING, _J.BROKEN),
        (_J.FLUSHING, _J.CLOSED),  # the queued replies and the trailers went out
        (_J.BROKEN, _J.CLOSED),  # the handler returned
    }
)
"""Every ``(from, to)`` move a Join stream may make; anything else is a transport bug."""


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


_R = ReaderState

READER_TRANSITIONS: Final[frozenset[tuple[ReaderState, ReaderState]]] = frozenset(
    {
        (_R.HOLDING, _R.READING),  # start(): what was held comes first
        (_R.HOLDING, _R.DONE),  # the call was over before its handler started
        (_R.READING, _R.PAUSED),  # paused = True
        (_R.PAUSED, _R.READING),  # paused = False: what was kept is consumed now
        (_R.READING, _R.STOPPED),  # stop()
        (_R.PAUSED, _R.STOPPED),  # stop()
        # The end reported (half-close, unreadable message, a failing handler), or close().
        (_R.READING, _R.DONE),
        (_R.PAUSED, _R.DONE),
        (_R.STOPPED, _R.DONE),  # close(): what was kept is given back to the window
    }
)
"""Every ``(from, to)`` move a request reader may make; anything else is a transport bug."""


class TransportStateError(RuntimeError):
    """A Join stream or its reader was asked to make a move its table does not allow
    (a bug)."""


def check_join_move(old: JoinState, new: JoinState) -> None:
    """Raise :class:`TransportStateError` unless ``old -> new`` is in
    :data:`JOIN_TRANSITIONS`."""
    if (old, new) not in JOIN_TRANSITIONS:
        raise TransportStateError(f"Join stream: no move from {old.value} to {new.value}")


def check_reader_move(old: ReaderState, new: ReaderState) -> None:
    """Raise :class:`TransportStateError` unless ``old -> new`` is in
    :data:`READER_TRANSITIONS`."""
    if (old, new) not in READER_TRANSITIONS:
        raise TransportStateError(f"request reader: no move from {old.value} to {new.value}")
