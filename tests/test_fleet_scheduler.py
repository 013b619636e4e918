"""The fleet's scheduler with a fake host and scripted runners: no servers, no Ray.

A :class:`FakeHost` is what ``fleet/_scheduler.py`` asks of a fleet (endpoint snapshots,
a recovery wait, failure and retry hooks); the runners fail on cue. Everything waits for
events (a barrier, the scheduler's own ``cancelled`` callback) under generous bounds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from rlmesh_trio.fleet import EndpointStatus, Fleet, FleetError, Retry, State
from rlmesh_trio.fleet._scheduler import Abort, Done, Outcome, schedule

pytestmark = pytest.mark.timeout(30)

BOUND = 10.0
"""The longest a fake waits for an event the test arranged."""

Recovery = Callable[[int, float, Callable[[], bool]], bool]


class FakeHost:
    """A fleet of ``n`` endpoints of ``lanes`` lanes, as the scheduler sees one."""

    def __init__(self, n: int, *, lanes: int = 2, states: list[State] | None = None) -> None:
        self.lock = threading.Lock()
        self.statuses = [
            EndpointStatus(i, f"tcp://127.0.0.1:{7000 + i}", lanes, (states or ["serving"] * n)[i])
            for i in range(n)
        ]
        self.recovery: dict[int, Recovery] = {}
        """How endpoint i recovers (default: never)."""
        self.recover_calls: list[tuple[int, float]] = []
        """(endpoint, seconds left to its deadline when asked)."""
        self.failures: list[tuple[int, BaseException]] = []
        self.retry_log: list[Retry] = []
        self.is_closed = False

    def endpoints(self) -> list[EndpointStatus]:
        return list(self.statuses)

    def endpoint(self, index: int) -> EndpointStatus:
        return self.statuses[index]

    def recover(self, index: int, deadline: float, cancelled: Callable[[], bool]) -> bool:
        with self.lock:
            self.recover_calls.append((index, deadline - time.monotonic()))
        return self.recovery.get(index, lambda i, d, c: False)(index, deadline, cancelled)

    def failed(self, index: int, error: BaseException) -> None:
        with self.lock:
            self.failures.append((index, error))

    def retried(self, retry: Retry) -> None:
        with self.lock:
            self.retry_log.append(retry)

    def closed(self) -> bool:
        return self.is_closed


def recovers(index: int, deadline: float, cancelled: Callable[[], bool]) -> bool:
    return True


def until_cancelled(index: int, deadline: float, cancelled: Callable[[], bool]) -> bool:
    """Never serves again: waits until the work is over or the deadline passes."""
    while not cancelled() and time.monotonic() < deadline:
        time.sleep(0.005)
    return False


class Runs:
    """A runner that records every call and runs ``script(endpoint, units, done)``."""

    def __init__(self, script: Callable[[int, list[int], Done], None] | None = None) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[int, list[int]]] = []
        self.script = script

    def __call__(
        self, address: str, endpoint: EndpointStatus, units: list[int], done: Done
    ) -> None:
        assert address == endpoint.address
        with self.lock:
            self.calls.append((endpoint.index, list(units)))
        if self.script is not None:
            self.script(endpoint.index, units, done)
        else:
            for unit in units:
                done(unit, (endpoint.index, unit))

    def by(self, index: int) -> list[list[int]]:
        return [units for endpoint, units in self.calls if endpoint == index]


def run(host: FakeHost, tasks: list[list[int]], runner: Runs, **kwargs: Any) -> Outcome:
    options: dict[str, Any] = {"retries": 2, "recover_timeout_seconds": BOUND, "split": False}
    options.update(kwargs)
    return schedule(host, tasks, runner, **options)


def test_the_endpoints_work_at_once_one_task_each() -> None:
    barrier = threading.Barrier(3, timeout=BOUND)

    def together(index: int, units: list[int], done: Done) -> None:
        barrier.wait()  # passes only when all three endpoints run a task at the same time
        for unit in units:
            done(unit, (index, unit))

    host = FakeHost(3)
    runner = Runs(together)
    outcome = run(host, [[0], [1], [2]], runner)
    assert sorted(outcome.done) == [0, 1, 2]
    assert outcome.failed == {} and outcome.retries == []
    assert sorted(index for index, _ in runner.calls) == [0, 1, 2]
    assert {unit: value[1] for unit, value in outcome.done.items()} == {0: 0, 1: 1, 2: 2}


def test_a_failed_task_is_retried_and_every_retry_is_told() -> None:
    failed_once = threading.Event()

    def flaky(index: int, units: list[int], done: Done) -> None:
        if units == [0] and not failed_once.is_set():
            failed_once.set()
            raise ConnectionError("boom")
        for unit in units:
            done(unit, index)

    host = FakeHost(1)
    host.recovery[0] = recovers
    outcome = run(host, [[0], [1]], Runs(flaky))
    assert sorted(outcome.done) == [0, 1] and outcome.failed == {}
    retry = Retry(0, host.statuses[0].address, 1, "ConnectionError: boom", 1)
    assert outcome.retries == [retry]
    assert host.retry_log == [retry]  # the host keeps the fleet's log
    assert [(i, str(e)) for i, e in host.failures] == [(0, "boom")]
    assert [index for index, _ in host.recover_calls] == [0]


def test_a_unit_failing_past_its_retries_is_given_up_with_its_error() -> None:
    def broken(index: int, units: list[int], done: Done) -> None:
        for unit in units:
            if unit == 0:
                raise ValueError("bad shard\nsecond line")
            done(unit, index)

    host = FakeHost(2)
    host.recovery = {0: recovers, 1: recovers}
    runner = Runs(broken)
    outcome = run(host, [[0], [1], [2]], runner, retries=2)
    assert sorted(outcome.done) == [1, 2]
    assert outcome.failed == {0: "ValueError: bad shard"}
    assert [units for _, units in runner.calls].count([0]) == 3  # the first try, 2 retries
    assert [r.attempt for r in outcome.retries] == [1, 2]
    assert isinstance(outcome.last_error, ValueError)
    assert "1 shard(s) could not be finished (2 were)" in outcome.describe("shard")


def test_an_endpoint_dying_mid_shard_leaves_only_its_unfinished_units() -> None:
    def dies_after_two(index: int, units: list[int], done: Done) -> None:
        if index == 0:
            done(units[0], index)
            done(units[1], index)
            raise ConnectionResetError("the endpoint died")
        for unit in units:
            done(unit, index)

    host = FakeHost(2)  # endpoint 0 never serves again
    runner = Runs(dies_after_two)
    outcome = run(host, [[0, 1, 2, 3], [4, 5, 6, 7]], runner, split=True, owners=[0, 1])
    assert outcome.failed == {}
    assert {u: outcome.done[u] for u in range(8)} == {
        0: 0,
        1: 0,
        2: 1,
        3: 1,
        4: 1,
        5: 1,
        6: 1,
        7: 1,
    }
    assert runner.by(0) == [[0, 1, 2, 3]]
    assert runner.by(1) == [[4, 5, 6, 7], [2, 3]]  # only the seeds it had not finished
    assert [(r.endpoint, r.units) for r in outcome.retries] == [(0, 2)]


def test_with_every_endpoint_gone_the_rest_fails_and_the_fleet_raises_with_partial() -> None:
    def first_unit_then_die(index: int, units: list[int], done: Done) -> None:
        if index == 0 and units == [0]:
            done(0, "kept")
            return
        raise ConnectionRefusedError("gone")

    host = FakeHost(2)
    outcome = run(host, [[0], [1], [2]], Runs(first_unit_then_die))
    assert outcome.done == {0: "kept"}
    assert set(outcome.failed) == {1, 2}
    assert set(outcome.failed.values()) <= {"no endpoint left to run it"}

    # The same through Fleet.map: FleetError, the results so far as ``partial``.
    dead = [f"127.0.0.1:{port}" for port in _closed_ports(2)]
    with (
        Fleet.from_addresses(dead) as fleet,
        pytest.raises(FleetError, match="no endpoint left") as caught,
    ):
        fleet.map(lambda address, shard: shard, ["a", "b"], recover_timeout_seconds=0.05)
    assert caught.value.partial == [None, None]


def test_every_endpoint_dead_to_begin_with_is_a_fleet_error() -> None:
    host = FakeHost(2, states=["dead", "dead"])
    with pytest.raises(FleetError, match="every endpoint of the fleet is dead"):
        run(host, [[0]], Runs())
    assert run(host, [], Runs()).done == {}  # no work: nothing to say


def test_the_recover_timeout_bounds_the_wait_for_a_failed_endpoint() -> None:
    def fails(index: int, units: list[int], done: Done) -> None:
        raise TimeoutError("no answer")

    host = FakeHost(1)
    host.recovery[0] = until_cancelled
    runner = Runs(fails)
    outcome = run(host, [[0]], runner, recover_timeout_seconds=0.05)
    ((index, left),) = host.recover_calls
    assert index == 0 and 0 < left <= 0.05  # the deadline given is the timeout asked for
    assert outcome.failed == {0: "no endpoint left to run it"}
    assert runner.calls == [(0, [0])]  # it took no more work


def test_a_recovery_in_progress_ends_when_the_work_is_done() -> None:
    def first_fails(index: int, units: list[int], done: Done) -> None:
        if index == 0:
            raise ConnectionError("lost")
        for unit in units:
            done(unit, index)

    host = FakeHost(2)
    host.recovery[0] = until_cancelled  # would wait BOUND seconds: the work ends it first
    outcome = run(host, [[0], [1]], Runs(first_fails), owners=[0, 1])
    assert {u: outcome.done[u] for u in (0, 1)} == {0: 1, 1: 1}
    assert [i for i, _ in host.recover_calls] == [0]


def test_a_task_reserved_for_an_endpoint_not_serving_goes_to_another() -> None:
    host = FakeHost(2, states=["restarting", "serving"])
    host.recovery[0] = until_cancelled
    runner = Runs()
    outcome = run(host, [[0, 1], [2, 3]], runner, split=True, owners=[0, 1])
    assert sorted(outcome.done) == [0, 1, 2, 3]
    assert sorted(runner.by(1)) == [[0, 1], [2, 3]] and runner.by(0) == []


def test_a_requeued_task_is_split_over_the_free_endpoints_in_whole_rounds() -> None:
    def zero_fails(index: int, units: list[int], done: Done) -> None:
        if index == 0:
            raise ConnectionError("lost")
        for unit in units:
            done(unit, index)

    host = FakeHost(3, lanes=2)
    runner = Runs(zero_fails)
    outcome = run(host, [list(range(8))], runner, split=True, owners=[0])
    assert sorted(outcome.done) == list(range(8))
    shares = [units for index, units in runner.calls if index != 0]
    assert sorted(u for share in shares for u in share) == list(range(8))  # each once
    # Spread over the two free endpoints (at most half each), in whole rounds of 2 lanes.
    assert len(shares) >= 2
    assert all(len(share) % 2 == 0 and len(share) <= 4 for share in shares)


def test_an_abort_stops_the_schedule_and_retries_nothing() -> None:
    def aborts(index: int, units: list[int], done: Done) -> None:
        raise Abort("a hook raised")

    host = FakeHost(1)
    host.recovery[0] = recovers
    runner = Runs(aborts)
    outcome = run(host, [[0], [1], [2]], runner)
    assert outcome.retries == [] and host.retry_log == []
    assert isinstance(outcome.last_error, Abort)
    assert runner.calls == [(0, [0])]
    assert outcome.failed[0] == "aborted: a hook raised"
    assert outcome.failed[1] == outcome.failed[2] == "no endpoint left to run it"


def test_a_closing_host_takes_no_more_work() -> None:
    host = FakeHost(1)
    host.recovery[0] = recovers

    def closes(index: int, units: list[int], done: Done) -> None:
        host.is_closed = True
        raise ConnectionError("closing")

    runner = Runs(closes)
    outcome = run(host, [[0], [1]], runner)
    assert runner.calls == [(0, [0])] and host.recover_calls == []
    assert set(outcome.failed) == {0, 1}


def test_bad_arguments_are_refused() -> None:
    host = FakeHost(1)
    for retries in (-1, 1.5, True):
        with pytest.raises(ValueError, match="retries"):
            run(host, [[0]], Runs(), retries=retries)
    with pytest.raises(ValueError, match="recover_timeout_seconds"):
        run(host, [[0]], Runs(), recover_timeout_seconds=-1)
    with pytest.raises(ValueError, match="owners"):
        run(host, [[0], [1]], Runs(), owners=[0])


def _closed_ports(n: int) -> list[int]:
    """Ports nothing listens on (bound, then closed)."""
    import socket

    ports = []
    for _ in range(n):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    return ports
