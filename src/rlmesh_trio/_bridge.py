"""Every thread crossing of the server, each with a name and one home.

Three kinds of thread run server code: the Trio thread (lifetimes, supervision), the
transport thread (one asyncio loop: sockets, sessions) and the lane threads (one per env).
They meet only here:

* :class:`ToLoop` -- any thread -> the transport loop (``call_soon_threadsafe``);
* :class:`ToTrio` -- any thread -> the Trio run (``TrioToken.run_sync_soon``);
* :class:`ReplyInbox` -- lane threads -> the transport loop: lane replies, coalesced so
  that replies arriving while a wake-up is pending ride along with it (one self-pipe
  write serves several lanes under load);
* :class:`Gather` -- lane threads -> the transport loop, for one whole-vector job: the
  lanes' replies are kept on their side, and the last one to answer crosses for all;
* :class:`Worker` -- the transport loop -> one helper thread and back, for CPU-heavy
  work that must not stall the loop (decoding a huge request);
* :func:`thread_gone` -- the Trio thread waits for a thread that told it it is done to
  have returned, so that nothing the server started is alive once it returned.

Nothing here imports asyncio: a loop is passed in as its ``call_soon_threadsafe``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import outcome
import trio

from ._jobs import LaneReply

__all__ = ["Delivery", "Gather", "ReplyInbox", "ToLoop", "ToTrio", "Worker", "thread_gone"]

log = logging.getLogger("rlmesh_trio.bridge")


class ToLoop:
    """Schedule a callable on the transport loop from any thread; never blocks."""

    __slots__ = ("_call_soon",)

    def __init__(self, call_soon_threadsafe: Callable[..., Any]) -> None:
        self._call_soon = call_soon_threadsafe

    def __call__(self, fn: Callable[..., Any], *args: Any) -> bool:
        """False when the loop is closed (the transport is gone): the call is dropped."""
        try:
            self._call_soon(fn, *args)
        except RuntimeError:
            return False
        return True


class ToTrio:
    """Schedule a sync callable on the Trio run from any thread; never blocks."""

    __slots__ = ("_token",)

    def __init__(self, token: trio.lowlevel.TrioToken | None = None) -> None:
        self._token = token if token is not None else trio.lowlevel.current_trio_token()

    def __call__(self, fn: Callable[..., Any], *args: Any) -> bool:
        """False when the run has finished (nobody is waiting for this any more)."""
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            return False
        return True


async def thread_gone(thread: threading.Thread) -> None:
    """Trio thread: wait until ``thread``, which already ran its last act and has only
    to return, is gone. The caller's cancel scope bounds the wait (a thread that does not
    return in time is left to finish on its own). The join runs on a worker thread of
    its own limiter: an embedding program's busy default limiter does not hold it up."""
    thread.join(timeout=0)
    if thread.is_alive():
        limiter = trio.CapacityLimiter(1)
        await trio.to_thread.run_sync(thread.join, abandon_on_cancel=True, limiter=limiter)


Delivery = LaneReply | list[LaneReply]
"""What crosses to the loop: one lane's reply, or a :class:`Gather`'s batch."""


class ReplyInbox:
    """Lane replies, handed to ``deliver`` on the transport loop in order.

    The server has one: :meth:`put` is the ``reply`` callback it gives the lane engine
    with every job of every Join (``deliver`` routes each reply to its Join by job id).
    It is called once per job, on the lane's thread (or any thread that answers for a
    lane), or once per :class:`Gather` with the batch of its lanes.
    """

    __slots__ = ("_deliver", "_done", "_pending", "_scheduled", "_to_loop")

    def __init__(
        self,
        to_loop: ToLoop,
        deliver: Callable[[Delivery], None],
        done: Callable[[], None] | None = None,
    ) -> None:
        """``done()`` runs on the loop after each batch of deliveries (one wake-up's)."""
        self._to_loop = to_loop
        self._deliver = deliver
        self._done = done
        self._pending: deque[Delivery] = deque()
        self._scheduled = False

    def put(self, reply: Delivery) -> None:
        """Any thread. deque.append is atomic; see :meth:`_drain` for why none strands."""
        self._pending.append(reply)
        if not self._scheduled:
            self._scheduled = True
            if not self._to_loop(self._drain):
                log.debug("lane reply after the transport stopped; dropped")

    def _drain(self) -> None:
        # The flag goes down *before* the deque is emptied: a reply appended after the
        # loop below finished then sees it down and schedules a new drain.
        self._scheduled = False
        pending = self._pending
        try:
            while pending:
                self._deliver(pending.popleft())
        finally:
            if self._done is not None:
                self._done()


class Gather:
    """The replies of one job posted to several lanes (a whole-vector step or reset): each
    lane keeps its reply here, and only the last to answer crosses to the loop, with all of
    them (``put(batch)``, the inbox's), so the loop wakes once per vector op rather than
    once per lane that finishes while it is awake.

    :meth:`reply` is the ``reply`` callback of each lane's job (lane threads; called once
    per job). :meth:`release` (loop) ends the gathering early -- a deadline, a refused
    post: the loop takes the replies that came, and every later one crosses on its own,
    as an ungathered job's would. Either way each reply reaches the loop exactly once.
    """

    __slots__ = ("_left", "_lock", "_open", "_put", "replies")

    def __init__(self, count: int, put: Callable[[Delivery], None]) -> None:
        self._put = put
        self._lock = threading.Lock()
        self._left = count
        self._open = True
        self.replies: list[LaneReply] = []

    def reply(self, reply: LaneReply) -> None:
        """Any thread: one lane's answer."""
        with self._lock:
            if self._open:
                self.replies.append(reply)
                self._left -= 1
                if self._left:
                    return
                self._open = False
                batch: Delivery = self.replies
            else:
                batch = reply
        self._put(batch)

    def release(self) -> list[LaneReply]:
        """Loop: stop gathering; the replies that came (each once: none if the batch
        already crossed)."""
        with self._lock:
            if not self._open:
                return []
            self._open = False
            taken, self.replies = self.replies, []
        return taken


class Worker:
    """One daemon helper thread; results come back to the loop through ``to_loop``.

    Started on first use. Jobs run one at a time in submission order. :meth:`close`
    lets the thread exit after its current job (it is a daemon: a job still running at
    process exit never blocks it).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(
        self,
        fn: Callable[[], Any],
        to_loop: ToLoop,
        done: Callable[[outcome.Outcome[Any]], None],
    ) -> None:
        """Run ``fn()`` on the worker; ``done(outcome)`` is then scheduled on the loop."""
        if self._closed:
            raise RuntimeError(f"{self._name} is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put((fn, to_loop, done))

    def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)

    def _main(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fn, to_loop, done = item
            del item
            result = outcome.capture(fn)
            with contextlib.suppress(Exception):
                to_loop(done, result)
            del fn, result, done
