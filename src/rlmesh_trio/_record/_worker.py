"""A bounded queue to one plain writer thread, off the step path.

:class:`BoundedWorker` takes items with :meth:`~BoundedWorker.put` from any thread (lane
threads, one at a time or many) and hands them, in order, to one function on its own
thread, in batches of whatever has queued meanwhile (so one file open serves many
episodes when the writer is behind, and one when it is not). Its rules:

* ``put`` blocks while ``capacity`` items wait (backpressure: the lane waits, nothing is
  dropped); the time spent blocked is counted.
* The writer's first error stops it; every later ``put`` and :meth:`~BoundedWorker.close`
  raise :class:`RecordingError` from it, saying how many items were not written.
* ``close`` lets the writer finish every queued item, then joins it.
* ``linger`` (seconds, default 0): once an item is queued, the writer waits up to that
  long for ``batch`` items before it writes (a file opened once for many episodes costs
  far less per episode); it never waits past a close, nor for more than the queue holds.
* Counters are plain attributes (read without a lock: each is written by one thread), and
  ``on_batch`` is called on the writer's thread after each batch, for metrics.
* ``start`` is called on the writer's thread before it takes anything (what the writer
  needs that must belong to its thread); its error becomes the writer's, which then
  writes nothing. :attr:`~BoundedWorker.started` is set once it returned or raised.
* ``finish`` is called on the writer's thread as it ends (everything written, or the
  writer failed): what the writer's thread set up is torn down there; its error becomes
  the writer's, if the writer had none.

The thread is a daemon only so that a process killed mid-run can still exit; a normal
stop calls ``close``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["BoundedWorker", "RecordingError"]

T = TypeVar("T")


class RecordingError(RuntimeError):
    """A recorder's writer failed (or was closed): what it had not written is lost."""


class BoundedWorker(Generic[T]):
    """``write(batch) -> bytes written`` on one thread named ``name``, fed by :meth:`put`."""

    def __init__(
        self,
        name: str,
        write: Callable[[list[T]], int],
        *,
        capacity: int = 64,
        on_batch: Callable[[int, int], None] | None = None,
        linger: float = 0.0,
        batch: int = 1,
        start: Callable[[], None] | None = None,
        finish: Callable[[], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        if linger < 0 or batch < 1:
            raise ValueError(f"linger must be >= 0 and batch >= 1, not {linger}, {batch}")
        self.name = name
        self.capacity = capacity
        self.linger = linger
        self.batch = min(batch, capacity)
        self._write = write
        self._on_batch = on_batch
        self._start = start
        self._finish = finish
        self.started = threading.Event()
        """Set once ``start`` returned or raised (at once without one)."""
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._not_empty = threading.Condition(self._lock)
        self._closing = False
        self.error: BaseException | None = None
        """The writer's error, once it has failed."""
        self.items_put = 0
        self.items_written = 0
        self.bytes_written = 0
        self.batches = 0
        self.put_waits = 0
        """Puts that found the queue full and waited."""
        self.put_wait_ns = 0
        """Time ``put`` spent waiting for room, summed over all puts."""
        self.high_water = 0
        """The most items ever waiting at once."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Items waiting for the writer (not counting the batch it is writing)."""
        return len(self._items)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, item: T) -> None:
        """Queue ``item``; wait while the queue is full. Raises :class:`RecordingError`
        if the writer has failed or the worker is closed."""
        with self._lock:
            if len(self._items) >= self.capacity and self.error is None and not self._closing:
                self.put_waits += 1
                start = time.monotonic_ns()
                while (
                    len(self._items) >= self.capacity and self.error is None and not self._closing
                ):
                    self._not_full.wait()
                self.put_wait_ns += time.monotonic_ns() - start
            self._raise_if_stopped()
            self._items.append(item)
            self.items_put += 1
            depth = len(self._items)
            self.high_water = max(self.high_water, depth)
            if depth == 1 or depth >= self.batch:  # a lingering writer waits for a batch
                self._not_empty.notify()

    def close(self, timeout: float | None = None) -> None:
        """Write everything queued, stop the thread, and raise the writer's error if it
        failed. Idempotent. ``timeout`` bounds the join (then :class:`RecordingError`)."""
        with self._lock:
            self._closing = True
            self._not_empty.notify_all()
            self._not_full.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RecordingError(
                    f"{self.name}: still writing after {timeout} s ({self.depth} items queued)"
                )
        if self.error is not None:
            raise RecordingError(self._lost()) from self.error

    def _lost(self) -> str:
        lost = self.items_put - self.items_written
        return f"{self.name} failed: {self.error!r}; {lost} item(s) not written"

    def _raise_if_stopped(self) -> None:
        if self.error is not None:
            raise RecordingError(self._lost()) from self.error
        if self._closing:
            raise RecordingError(f"{self.name} is closed")

    def _run(self) -> None:
        try:
            if self._start is not None:
                try:
                    self._start()
                except BaseException as exc:
                    self._fail(exc)
                    return
                finally:
                    self.started.set()
            self.started.set()
            self._serve()
        finally:
            if self._finish is not None:
                try:
                    self._finish()
                except BaseException as exc:
                    self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """The writer's first error (a later one is dropped); blocked puts wake to it."""
        with self._lock:
            if self.error is None:
                self.error = exc
            self._not_full.notify_all()

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._items and not self._closing:
                    self._not_empty.wait()
                if not self._items:
                    return  # closing, and everything is written
                if self.linger > 0 and len(self._items) < self.batch:
                    deadline = time.monotonic() + self.linger
                    while len(self._items) < self.batch and not self._closing:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._not_empty.wait(left)
                batch = list(self._items)
                self._items.clear()
                self._not_full.notify_all()
            try:
                nbytes = self._write(batch)
                self.items_written += len(batch)
                self.bytes_written += nbytes
                self.batches += 1
                if self._on_batch is not None:
                    self._on_batch(len(batch), nbytes)
            except BaseException as exc:
                self._fail(exc)
                return
