"""A lane's states and the one table of the moves allowed between them.

Every change of a lane's state goes through :meth:`~._lane.Lane._move`, which checks
the ``(from, to)`` pair against :data:`TRANSITIONS`; a pair not in the table is a bug of
the engine and raises :class:`LaneStateError`. docs/supervision.md carries the same table
(``tests/test_lanes_state.py`` reads it and compares), so the documented state machine is
the one the code runs.

Adding a state (e.g. a lane rebuilt while its client's session goes on) means adding a
member here, its rows to :data:`TRANSITIONS` and to the doc's table, and a transition
method on :class:`~._lane.Lane`.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["TRANSITIONS", "LaneState", "LaneStateError", "check_transition"]


class LaneState(enum.Enum):
    """Where a lane is in its life (docs/supervision.md has the state machine)."""

    STARTING = "starting"
    """The first env is being built (server startup)."""
    SERVING = "serving"
    """An env is up and the lane takes jobs."""
    REBUILDING = "rebuilding"
    """The env faulted or wedged; a fresh one is being built. Jobs queue meanwhile."""
    WEDGED = "wedged"
    """Policy ``error``: an env call overran a deadline and has not returned. Jobs are
    refused at once (naming the lane) until it does."""
    DEAD = "dead"
    """A rebuild failed (jobs are refused, fatal, until the next attempt), or the lane is
    given up for good -- a process lane's child died under policy ``error``, or it left
    too many threads behind -- and refuses until the server stops (health then reports
    NOT_SERVING, unless ``max_given_up_lanes`` tolerates it)."""
    STOPPED = "stopped"
    """The engine closed the lane (or it was abandoned at teardown)."""


_S = LaneState

TRANSITIONS: Final[frozenset[tuple[LaneState, LaneState]]] = frozenset(
    {
        (_S.STARTING, _S.SERVING),  # every lane built its env, the contract is agreed
        (_S.SERVING, _S.REBUILDING),  # rebuild/truncate: the env raised or wedged
        (_S.SERVING, _S.WEDGED),  # error: an env call overran a deadline
        (_S.SERVING, _S.DEAD),  # error: a process lane's child died
        (_S.WEDGED, _S.SERVING),  # error: the wedged call returned
        (_S.REBUILDING, _S.SERVING),  # the fresh env agrees with lane 0
        (_S.REBUILDING, _S.DEAD),  # the factory failed, or too many threads left behind
        (_S.DEAD, _S.REBUILDING),  # rebuild/truncate: the backoff is over, try again
        # The engine closed (every state ends here, once).
        (_S.STARTING, _S.STOPPED),
        (_S.SERVING, _S.STOPPED),
        (_S.REBUILDING, _S.STOPPED),
        (_S.WEDGED, _S.STOPPED),
        (_S.DEAD, _S.STOPPED),
    }
)
"""Every ``(from, to)`` move a lane may make; anything else is an engine bug."""


class LaneStateError(RuntimeError):
    """A lane was asked to make a move :data:`TRANSITIONS` does not allow (a bug)."""


def check_transition(lane: int, old: LaneState, new: LaneState) -> None:
    """Raise :class:`LaneStateError` unless ``old -> new`` is in :data:`TRANSITIONS`."""
    if (old, new) not in TRANSITIONS:
        raise LaneStateError(f"lane {lane}: no transition from {old.value} to {new.value}")
