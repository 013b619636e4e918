"""One lane's mailbox and state, and the timing split of one job."""

from __future__ import annotations

import queue
import threading
from time import perf_counter_ns
from typing import Final

import trio

from .._errors import LaneBrokenError
from .._jobs import Job, Phases, ReplyFn


class _Stop:
    """The mailbox sentinel that tells a lane thread to wind down."""

    __slots__ = ()


_STOP: Final = _Stop()

_MailboxItem = tuple[int, Job, ReplyFn] | _Stop
"""``(perf_counter_ns() at post, job, reply)``, or the stop sentinel."""


class _Lane:
    """One lane's mailbox and state. ``lock`` guards ``accepting``/``stopping``/``current``.

    The lock is the lane's own (never shared between lanes) and is only held for a few
    attribute reads and writes, never while a job runs, so ``post`` never really waits.
    """

    __slots__ = (
        "accepting",
        "current",
        "index",
        "lock",
        "mailbox",
        "running",
        "scope",
        "stopping",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.mailbox: queue.SimpleQueue[_MailboxItem] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.accepting = True
        """``post`` puts jobs into the mailbox (false once closing or the thread is gone)."""
        self.stopping = False
        """Close was requested: finish the current job, answer the queued ones as stopped."""
        self.current: tuple[int, Job, ReplyFn] | None = None
        """The job the lane thread is running; whoever takes it out answers it."""
        self.running = False
        """The lane thread is up and serving (set at startup, cleared when it exits)."""
        self.scope: trio.CancelScope | None = None


class _Split:
    """Splits one job's time into decode / user / encode (indices 0, 1, 2)."""

    __slots__ = ("mark", "ns", "phase")

    def __init__(self, phase: int) -> None:
        self.ns = [0, 0, 0]
        self.phase = phase
        self.mark = perf_counter_ns()

    def enter(self, phase: int) -> None:
        now = perf_counter_ns()
        self.ns[self.phase] += now - self.mark
        self.phase = phase
        self.mark = now

    def phases(self, queue_ns: int) -> Phases:
        self.enter(self.phase)
        decode_ns, user_ns, encode_ns = self.ns
        return Phases(queue_ns=queue_ns, decode_ns=decode_ns, user_ns=user_ns, encode_ns=encode_ns)


_DECODE, _USER, _ENCODE = 0, 1, 2


def _stopped(index: int) -> LaneBrokenError:
    return LaneBrokenError(f"lane {index} stopped before answering")
