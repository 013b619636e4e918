"""The fleet's scheduler: tasks of work units run on the endpoints, failures retried.

One worker thread per live endpoint takes tasks (lists of unit ids) from a shared queue,
one at a time, and hands each to a *runner* (``map``'s call, ``run``'s ``rlmesh.run``).
A failed task's unfinished units are queued again, up to ``retries`` failures per unit;
the endpoint that failed waits (bounded) until it serves again before it takes more.
Every wait is bounded.

What the scheduler needs from the fleet it runs on is :class:`Host` -- a snapshot of
the endpoints, a recovery wait, a failure hook, a retry log, whether it is closed --
so it can be driven by fakes (``tests/test_fleet_scheduler.py``) as well as by a
:class:`~rlmesh_trio.fleet.Fleet`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._errors import first_line
from ._records import EndpointStatus, FleetError, Retry

log = logging.getLogger("rlmesh_trio.fleet")

WAIT_SLICE_SECONDS = 1.0
"""The longest a worker sleeps on the condition before it looks at the work again."""


class Host(Protocol):
    """What the scheduler needs of the fleet it runs on."""

    def endpoints(self) -> list[EndpointStatus]:
        """Every endpoint, as of now (dead ones included)."""
        ...

    def endpoint(self, index: int) -> EndpointStatus:
        """Endpoint ``index`` as of now (its current address, state and lanes)."""
        ...

    def recover(self, index: int, deadline: float, cancelled: Callable[[], bool]) -> bool:
        """Block until endpoint ``index`` serves again (True), or until ``deadline``
        (``time.monotonic()``), its death or ``cancelled()`` (False)."""
        ...

    def failed(self, index: int, error: BaseException) -> None:
        """Endpoint ``index`` failed a task with ``error``."""
        ...

    def retried(self, retry: Retry) -> None:
        """A retry was queued (the host keeps its log)."""
        ...

    def closed(self) -> bool:
        """The host is closing: take no more work."""
        ...


class Abort(Exception):
    """Raised by a runner: stop the whole schedule, retry nothing (e.g. a user hook raised)."""


Done = Callable[[int, Any], bool]
"""``done(unit, value)``: record a finished unit; False when it was already finished."""

Runner = Callable[[str, EndpointStatus, list[int], Done], None]
"""``runner(address, endpoint, units, done)``: run ``units`` on the endpoint at
``address``, calling ``done(unit, value)`` per finished unit; raises on failure."""


@dataclass
class Outcome:
    """What a schedule came to."""

    done: dict[int, Any]
    """Finished units and their values."""
    failed: dict[int, str]
    """Units given up on, with the last error."""
    retries: list[Retry] = field(default_factory=list)
    last_error: BaseException | None = None

    def describe(self, noun: str) -> str:
        sample = next(iter(self.failed.values()), "")
        return (
            f"{len(self.failed)} {noun}(s) could not be finished ({len(self.done)} were): {sample}"
        )


def schedule(
    host: Host,
    tasks: list[list[int]],
    runner: Runner,
    *,
    retries: int,
    recover_timeout_seconds: float,
    split: bool,
    owners: Sequence[int] | None = None,
) -> Outcome:
    """Run ``tasks`` (lists of unit ids) on ``host``'s endpoints, one task per endpoint at
    a time, re-queueing what a failed attempt left unfinished.

    ``split``: an idle endpoint may take part of a re-queued task (``run``: its
    unfinished seeds, in whole rounds of its lanes), so the task spreads over the free
    endpoints. ``owners[i]``: the endpoint that runs task ``i`` first (another takes it
    only while that one is not serving, or once it has left the work).
    ``recover_timeout_seconds``: how long a failed endpoint may take to serve again
    before it takes no more of this work. Raises :class:`FleetError` when every
    endpoint is dead to begin with.
    """
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0, got {retries!r}")
    if not isinstance(recover_timeout_seconds, (int, float)) or not recover_timeout_seconds >= 0:
        raise ValueError(
            f"recover_timeout_seconds must be a number >= 0, got {recover_timeout_seconds!r}"
        )
    return _Scheduler(host, tasks, runner, retries, recover_timeout_seconds, split, owners).run()


class _Scheduler:
    """One worker thread per endpoint; a shared queue of tasks; every wait bounded."""

    def __init__(
        self,
        host: Host,
        tasks: list[list[int]],
        runner: Runner,
        retries: int,
        recover_timeout: float,
        split: bool,
        owners: Sequence[int] | None,
    ) -> None:
        self.host = host
        self.runner = runner
        self.retries = retries
        self.recover_timeout = recover_timeout
        self.split = split
        self.cond = threading.Condition()
        if owners is not None and len(owners) != len(tasks):
            raise ValueError("owners must name one endpoint per task")
        self.owned: dict[int, list[int]] = {}
        """Tasks reserved for an endpoint (its first shard), by endpoint index."""
        self.queue: deque[tuple[list[int], bool]] = deque()
        """Tasks any endpoint may take, and whether each was queued again after a failure."""
        for i, task in enumerate(tasks):
            if not task:
                continue
            if owners is not None and owners[i] not in self.owned:
                self.owned[owners[i]] = task
            else:
                self.queue.append((task, False))
        self.unavailable: set[int] = set()
        """Endpoints recovering or gone: their reserved tasks are free for the others."""
        self.total = len({unit for task in tasks for unit in task})
        self.done: dict[int, Any] = {}
        self.failed: dict[int, str] = {}
        self.failures: dict[int, int] = {}
        self.in_flight = 0
        self.workers_alive = 0
        self.retry_log: list[Retry] = []
        self.last_error: BaseException | None = None
        self.aborted: BaseException | None = None

    def finished(self) -> bool:
        return len(self.done) + len(self.failed) >= self.total

    def over(self) -> bool:
        """Nothing left for a recovering endpoint to do: stop waiting for it."""
        with self.cond:
            return self.finished() or self.aborted is not None

    def run(self) -> Outcome:
        if self.total:
            live = [e for e in self.host.endpoints() if e.state != "dead"]
            if not live:
                raise FleetError("every endpoint of the fleet is dead")
            threads = [
                threading.Thread(
                    target=self.work, args=(e.index,), name=f"rlmesh-fleet-{e.index}", daemon=True
                )
                for e in live
            ]
            self.workers_alive = len(threads)
            for thread in threads:
                thread.start()
            try:
                for thread in threads:
                    thread.join()
            except BaseException as exc:  # e.g. KeyboardInterrupt: take no more work
                with self.cond:
                    self.aborted = exc
                    self.cond.notify_all()
                raise
            with self.cond:
                self.queue.extend((task, False) for task in self.owned.values())
                self.owned.clear()
                for task, _ in self.queue:  # no endpoint left to run them (or aborted)
                    for unit in task:
                        if unit not in self.done:
                            self.failed.setdefault(unit, "no endpoint left to run it")
                self.queue.clear()
        return Outcome(self.done, self.failed, self.retry_log, self.last_error)

    def take(self, index: int, lanes: int | None) -> list[int] | None:
        """Lock held: the next task for endpoint ``index``, or None when all is done."""
        while True:
            if self.finished() or self.host.closed() or self.aborted is not None:
                return None
            own = self.owned.pop(index, None)
            if own is not None:
                self.in_flight += 1
                return own
            # Reserved for an endpoint that cannot take it now: free for all.
            for owner in sorted(self.owned.keys() & self.unavailable):
                self.queue.append((self.owned.pop(owner), False))
            if self.queue:
                task, again = self.queue.popleft()
                pending = [u for u in task if u not in self.done and u not in self.failed]
                if not pending:
                    continue
                if (
                    again
                    and self.split
                    and self.workers_alive > 1
                    and lanes
                    and len(pending) > lanes
                ):
                    # A re-queued task's seeds: leave some for the other free endpoints.
                    share = max(lanes, -(-len(pending) // self.workers_alive))
                    share = -(-share // lanes) * lanes
                    if share < len(pending):
                        self.queue.appendleft((pending[share:], True))
                        pending = pending[:share]
                self.in_flight += 1
                return pending
            if self.in_flight == 0 and not self.owned:
                return None  # nothing queued, nothing that could re-queue
            self.cond.wait(WAIT_SLICE_SECONDS)

    def record(self, unit: int, value: Any) -> bool:
        with self.cond:
            if unit in self.done or unit in self.failed:
                return False
            self.done[unit] = value
            if self.finished():
                self.cond.notify_all()
            return True

    def available(self, index: int, available: bool) -> None:
        with self.cond:
            if available:
                self.unavailable.discard(index)
            else:
                self.unavailable.add(index)
            self.cond.notify_all()

    def recovered(self, index: int) -> bool:
        """Wait (bounded) for endpoint ``index`` to serve again; False: it takes no more."""
        self.available(index, False)
        deadline = time.monotonic() + self.recover_timeout
        if not self.host.recover(index, deadline, self.over):
            return False
        self.available(index, True)
        return True

    def work(self, index: int) -> None:
        try:
            # Not answering when the work began: wait for it (bounded), then join in.
            if self.host.endpoint(index).state != "serving" and not self.recovered(index):
                return
            while True:
                endpoint = self.host.endpoint(index)
                with self.cond:
                    task = self.take(index, endpoint.num_envs)
                if task is None:
                    return
                try:
                    self.runner(endpoint.address, endpoint, task, self.record)
                except Abort as exc:
                    with self.cond:
                        self.in_flight -= 1
                        for unit in task:  # given up on with the rest: never retried
                            if unit not in self.done:
                                self.failed.setdefault(unit, f"aborted: {exc}")
                        self.aborted = exc
                        self.last_error = exc
                        self.cond.notify_all()
                    return
                except Exception as exc:
                    if not self.requeue(endpoint, task, exc):
                        return
                    self.host.failed(index, exc)
                    if not self.recovered(index):
                        log.warning(
                            "fleet: endpoint %d (%s) is not serving again; it takes no more work",
                            index,
                            endpoint.address,
                        )
                        return
                else:
                    with self.cond:
                        self.in_flight -= 1
                        # A run that returned without some of its units (it cannot
                        # happen with rlmesh.run; a map fn always reports): re-queue.
                        missing = [u for u in task if u not in self.done and u not in self.failed]
                        if missing:
                            self.queue.append((missing, True))
                        self.cond.notify_all()
        finally:
            with self.cond:
                self.workers_alive -= 1
                self.unavailable.add(index)
                leftover = self.owned.pop(index, None)
                if leftover is not None:
                    self.queue.append((leftover, False))
                self.cond.notify_all()

    def requeue(self, endpoint: EndpointStatus, task: list[int], exc: BaseException) -> bool:
        """A task failed: queue its unfinished units again (those within their retries).
        Returns False when the host is closing."""
        error = first_line(exc)
        retry: Retry | None = None
        with self.cond:
            self.in_flight -= 1
            self.last_error = exc
            again: list[int] = []
            worst = 0
            for unit in task:
                if unit in self.done or unit in self.failed:
                    continue
                count = self.failures.get(unit, 0) + 1
                self.failures[unit] = count
                if count > self.retries:
                    self.failed[unit] = error
                else:
                    again.append(unit)
                    worst = max(worst, count)
            if again:
                self.queue.append((again, True))
                retry = Retry(endpoint.index, endpoint.address, len(again), error, worst)
                self.retry_log.append(retry)
            self.cond.notify_all()
        if retry is not None:
            self.host.retried(retry)
            log.warning(
                "fleet: %d item(s) failed on endpoint %d (%s): %s; retry %d queued",
                retry.units,
                endpoint.index,
                endpoint.address,
                error,
                retry.attempt,
            )
        return not self.host.closed()
