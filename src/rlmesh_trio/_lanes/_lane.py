"""One lane's mailbox and state, and its thread incarnations."""

from __future__ import annotations

import enum
import queue
import threading
from typing import Any, Final

import trio

from .._errors import LaneBrokenError, LaneError
from .._jobs import Job, ReplyFn


class _Stop:
    """The mailbox sentinel that tells a lane thread to wind down."""

    __slots__ = ()


_STOP: Final = _Stop()

_Item = tuple[int, Job, ReplyFn]
"""``(perf_counter_ns() at post, job, reply)``."""

_MailboxItem = _Item | _Stop


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
    """A rebuild failed; jobs are refused (fatal) until the next attempt."""
    STOPPED = "stopped"
    """The engine closed the lane (or it was abandoned at teardown)."""


class _Incarnation:
    """One OS thread of a lane and the env it built (which only it ever touches)."""

    __slots__ = ("abandoned", "child", "detached", "exited", "number", "thread")

    def __init__(self, number: int) -> None:
        self.number = number
        self.thread: threading.Thread | None = None
        self.detached = False
        """The lane moved on (this thread faulted or was abandoned): it takes no more jobs,
        closes its env when it gets control back, and exits."""
        self.abandoned = False
        """Detached while still inside an env call (wedged)."""
        self.exited = trio.Event()
        """Set on the Trio thread once the thread's last act ran."""
        self.child: Any = None
        """Process isolation: the :class:`~rlmesh_trio._lanes._process.ChildLane` whose env
        this (proxy) thread drives."""


class _Lane:
    """One lane's mailbox and state. ``lock`` guards the mutable fields below.

    The lock is the lane's own (never shared between lanes) and is only held for a few
    attribute reads and writes, never while a job runs, so ``post`` never really waits.
    The mailbox outlives the lane's incarnations: jobs queued while a lane is rebuilt are
    served by the fresh env.
    """

    __slots__ = (
        "abandoned",
        "accepting",
        "attempt",
        "current",
        "faults",
        "incarnation",
        "index",
        "last_cause",
        "lock",
        "mailbox",
        "rebuilds",
        "refusal",
        "retry",
        "running",
        "scope",
        "since",
        "state",
        "stopping",
        "wedges",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.mailbox: queue.SimpleQueue[_MailboxItem] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.accepting = True
        """``post`` puts jobs into the mailbox (false once closing or the thread is gone)."""
        self.stopping = False
        """Close was requested: finish the current job, answer the queued ones as stopped."""
        self.current: _Item | None = None
        """The job the lane thread is running; whoever takes it out answers it."""
        self.since = 0
        """``perf_counter_ns()`` when ``current`` started (or the rebuild began)."""
        self.running = False
        """The lane thread is up and serving (set at startup, cleared when it exits)."""
        self.scope: trio.CancelScope | None = None
        self.state = LaneState.STARTING
        self.refusal: LaneError | None = None
        """While set, ``post`` raises it instead of queueing (wedged, dead)."""
        self.incarnation = _Incarnation(0)
        self.retry: tuple[_Item, int] | None = None
        """A job the next incarnation runs first (a reset retried after a fault)."""
        self.attempt = 0
        """Rebuild attempts since the lane last served (for backoff and messages)."""
        self.last_cause = ""
        self.faults = 0
        self.wedges = 0
        self.rebuilds = 0
        self.abandoned = 0
        """Abandoned threads of this lane still running (wedged env calls)."""


def _stopped(index: int) -> LaneBrokenError:
    return LaneBrokenError(f"lane {index} stopped before answering")
