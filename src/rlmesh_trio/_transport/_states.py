"""The transport's state machines, each one table of the moves allowed between states.

* :class:`ReaderState`, a Join's request reader's (:class:`~._reader.RequestReader`),
  checked against :data:`READER_TRANSITIONS`.

Every change of a state goes through its owner's one ``_move``, which checks the
``(from, to)`` pair against the table: a pair not in it is a bug of the transport and
raises :class:`TransportStateError`, as a lane's does (``_lanes/_state.py``). A call that
may come in a state where it has nothing to do (``stop()`` on a reader already done)
names those states, as a constant beside its owner, and moves from any other: a state it
does not name fails the check rather than being passed over.

Adding a state means a member here, its rows in the table, and the owner's calls that
move to and from it.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["READER_TRANSITIONS", "ReaderState", "TransportStateError", "check_reader_move"]


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
    """A state machine of the transport was asked to make a move its table does not allow
    (a bug)."""


def check_reader_move(old: ReaderState, new: ReaderState) -> None:
    """Raise :class:`TransportStateError` unless ``old -> new`` is in
    :data:`READER_TRANSITIONS`."""
    if (old, new) not in READER_TRANSITIONS:
        raise TransportStateError(f"request reader: no move from {old.value} to {new.value}")
