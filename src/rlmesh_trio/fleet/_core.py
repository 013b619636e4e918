"""The engine-neutral fleet: endpoints, their health, and shards run over them.

No Ray import here: a :class:`Fleet` over a static address list (or a Kubernetes
StatefulSet's DNS names) gets the same client-side help -- health over grpc.health.v1,
``map`` and ``run`` with retries -- as one launched on Ray (:mod:`rlmesh_trio.fleet.ray`),
which subclasses it and adds restarts.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

from .._address import TcpAddress, UnixAddress, parse_address
from .._tls import TlsSetting, client_context
from ..client import probe
from ._records import (
    Endpoint,
    FleetError,
    FleetRunResult,
    Health,
    Retry,
    State,
    _Abort,
    _Done,
    _Outcome,
)

log = logging.getLogger("rlmesh_trio.fleet")

T = TypeVar("T")
R = TypeVar("R")

RECOVERY_POLL_SECONDS = 0.25
"""How often a static fleet re-probes an endpoint that failed, until it serves again."""


class _Member:
    """The fleet's mutable record of one endpoint (guarded by the fleet's lock)."""

    def __init__(self, index: int, address: str, lanes: int | None, node: str | None) -> None:
        self.index = index
        self.address = address
        self.lanes = lanes
        self.node = node
        self.state: State = "restarting"
        self.restarts = 0

    def snapshot(self) -> Endpoint:
        return Endpoint(self.index, self.address, self.lanes, self.state, self.restarts, self.node)


def normalize_address(address: str) -> str:
    """``host:port``, ``port``, ``tcp://...`` or ``unix://...`` in rlmesh form."""
    parsed = parse_address(address)
    if isinstance(parsed, TcpAddress) and parsed.port == 0:
        raise ValueError(f"{address!r}: a fleet member needs a concrete port, not 0")
    return str(parsed)


def _host_of(address: str) -> str | None:
    parsed = parse_address(address)
    if isinstance(parsed, UnixAddress):
        return socket.gethostname()
    return parsed.host


class Fleet:
    """K endpoints of N lanes each, driven from one client process.

    Clients dial every endpoint directly (``addresses``); the fleet adds health checks,
    ``map`` (one shard per endpoint at a time, failed shards retried elsewhere) and
    ``run`` (seeds sharded over the endpoints, one :func:`rlmesh.run` per endpoint, one
    merged result). Build one with :meth:`from_addresses`, :meth:`from_dns`, or
    :func:`rlmesh_trio.fleet.ray.launch`. A context manager: :meth:`close` at exit.

    ``auth_token`` is sent with the fleet's own probes; it is also what
    :attr:`auth_token` gives ``map`` functions that use a token-capable client.
    ``tls`` (as :func:`rlmesh_trio.client.open_endpoint` takes it: True, a CA file, an
    ``ssl.SSLContext`` carrying a client certificate for mTLS) is how the fleet's probes
    connect, and what :attr:`tls` gives ``map`` functions.
    """

    def __init__(
        self,
        addresses: Iterable[str],
        *,
        auth_token: str | None = None,
        tls: TlsSetting = None,
        nodes: Sequence[str | None] | None = None,
    ) -> None:
        normalized = [normalize_address(a) for a in addresses]
        if not normalized:
            raise ValueError("a fleet needs at least one endpoint address")
        if len(set(normalized)) != len(normalized):
            raise ValueError(f"duplicate endpoint addresses: {normalized}")
        if nodes is not None and len(nodes) != len(normalized):
            raise ValueError("nodes must give one entry per address")
        self._lock = threading.RLock()
        self._members = [
            _Member(i, a, None, nodes[i] if nodes is not None else _host_of(a))
            for i, a in enumerate(normalized)
        ]
        self._auth_token = auth_token
        self._tls = tls
        self._tls_context = client_context(tls)  # checked (and a CA file read) once
        if self._tls_context is not None:
            unix = [m.address for m in self._members if m.address.startswith("unix://")]
            if unix:
                raise ValueError(f"tls= is for TCP addresses, not {unix[0]}")
        self._closed = False
        self._retries: list[Retry] = []

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_addresses(
        cls, addresses: Iterable[str], *, auth_token: str | None = None, tls: TlsSetting = None
    ) -> Fleet:
        """A fleet over endpoints that something else runs (processes, containers, pods)."""
        return cls(addresses, auth_token=auth_token, tls=tls)

    @classmethod
    def from_dns(
        cls,
        service: str,
        replicas: int,
        port: int,
        namespace: str = "default",
        *,
        cluster_domain: str = "cluster.local",
        auth_token: str | None = None,
        tls: TlsSetting = None,
    ) -> Fleet:
        """The pods of a Kubernetes StatefulSet behind a headless Service.

        A StatefulSet named ``service`` whose ``serviceName`` is ``service`` gives pod
        ``i`` the DNS name ``service-i.service.namespace.svc.cluster_domain``; those names
        (with ``port``) are the fleet's addresses, resolved when each client dials, so a
        rescheduled pod is found at its new IP. Nothing is resolved here. Under TLS the
        pods' certificates are checked against those names (give them as DNS SANs, or
        a wildcard ``*.service.namespace.svc.cluster_domain``).
        """
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"port must be an int in 1..65535, got {port!r}")
        for label, value in (("service", service), ("namespace", namespace)):
            if not value or not all(c.isalnum() or c in "-." for c in value):
                raise ValueError(f"{label} must be a DNS name, got {value!r}")
        suffix = f"{service}.{namespace}.svc.{cluster_domain}"
        return cls(
            [f"{service}-{i}.{suffix}:{port}" for i in range(replicas)],
            auth_token=auth_token,
            tls=tls,
        )

    # -- state ----------------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """The current address of every endpoint, in order (dead ones included)."""
        with self._lock:
            return [m.address for m in self._members]

    @property
    def endpoints(self) -> list[Endpoint]:
        """A snapshot of every endpoint: address, lanes, state, restarts, node."""
        with self._lock:
            return [m.snapshot() for m in self._members]

    @property
    def auth_token(self) -> str | None:
        """The endpoints' bearer token (``None``: they take none). Never logged."""
        return self._auth_token

    @property
    def tls(self) -> TlsSetting:
        """How the endpoints are reached (``tls=`` as given; None: plaintext): pass it
        to :func:`~rlmesh_trio.client.open_endpoint` / ``VectorEnv`` in ``map``."""
        return self._tls

    @property
    def retries(self) -> list[Retry]:
        """Every retry ``map`` and ``run`` made on this fleet, oldest first."""
        with self._lock:
            return list(self._retries)

    def __len__(self) -> int:
        return len(self._members)

    def __repr__(self) -> str:
        states = ", ".join(f"{e.address} {e.state}" for e in self.endpoints)
        return f"{type(self).__name__}([{states}])"

    # -- health -----------------------------------------------------------------------

    def _probe_one(self, index: int, timeout: float) -> Health:
        with self._lock:
            member = self._members[index]
            address, state = member.address, member.state
        if state == "dead":
            return Health(index, address, False, "dead", "the endpoint is dead")
        # Two calls (Check, then Handshake), each within half the deadline.
        result = probe(
            address, timeout_seconds=timeout / 2, auth_token=self._auth_token, tls=self._tls_context
        )
        lanes = result.num_envs or None
        health = Health(index, address, result.serving, result.health, result.error, lanes)
        with self._lock:
            if member.address == address and member.state != "dead":
                if lanes is not None:
                    member.lanes = lanes
                self._observed(member, health)
        return health

    def _observed(self, member: _Member, health: Health) -> None:
        """Lock held: a probe's verdict on ``member`` (a subclass may track more)."""
        member.state = "serving" if health.serving else "restarting"

    def health(self, timeout: float = 2.0) -> list[Health]:
        """Probe every endpoint at once (grpc.health.v1 Check, then a Handshake), each
        within ``timeout`` seconds; updates :attr:`endpoints`' states and lanes."""
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        self._check_open()
        with ThreadPoolExecutor(len(self._members), "rlmesh-fleet-probe") as pool:
            futures = [pool.submit(self._probe_one, i, timeout) for i in range(len(self))]
            return [f.result() for f in futures]

    def wait_ready(self, timeout: float, *, probe_timeout: float = 2.0) -> None:
        """Return once every live endpoint serves; ``TimeoutError`` after ``timeout`` s
        (naming those that do not). Dead endpoints are not waited for."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            report = self.health(max(0.05, min(probe_timeout, left)))
            waiting = [h for h in report if not h.serving and h.status != "dead"]
            if not waiting:
                if all(h.status == "dead" for h in report):
                    raise FleetError("every endpoint of the fleet is dead")
                return
            left = deadline - time.monotonic()
            if left <= 0:
                names = "; ".join(f"{h.address}: {h}" for h in waiting)
                raise TimeoutError(
                    f"{len(waiting)} endpoint(s) not serving after {timeout} s: {names}"
                )
            time.sleep(min(RECOVERY_POLL_SECONDS, left))

    # -- recovery (what a subclass with an engine does better) ----------------------------

    def _recover(
        self, index: int, deadline: float, cancelled: Callable[[], bool] = lambda: False
    ) -> bool:
        """After a failure on endpoint ``index``: block until it serves again (True),
        or until ``deadline`` (``time.monotonic()``), its death or ``cancelled()`` (the
        work is over; False). A static fleet can only re-probe; a Ray fleet waits for
        the restarted actor."""
        while not self._closed and not cancelled():
            health = self._probe_one(index, min(2.0, max(0.1, deadline - time.monotonic())))
            if health.serving:
                return True
            if health.status == "dead" or time.monotonic() >= deadline:
                return False
            time.sleep(RECOVERY_POLL_SECONDS)
        return False

    def _failed(self, index: int, error: BaseException) -> None:
        """Endpoint ``index`` failed a piece of work with ``error`` (hook for subclasses)."""
        with self._lock:
            member = self._members[index]
            if member.state == "serving":
                member.state = "restarting"

    def _member(self, index: int) -> Endpoint:
        with self._lock:
            return self._members[index].snapshot()

    # -- work -----------------------------------------------------------------------------

    def map(
        self,
        fn: Callable[[str, T], R],
        shards: Iterable[T],
        *,
        retries: int = 2,
        recover_timeout: float = 60.0,
    ) -> list[R]:
        """``[fn(address, shard) for shard in shards]``, one shard per endpoint at a time.

        Each endpoint takes the next shard as soon as it is free, so the endpoints work
        at once (``fn`` runs on one thread per endpoint). A shard whose call raises is
        queued again and runs on the next endpoint that is free -- the same one once it
        serves again (re-resolved: a restarted endpoint's new address), or another;
        each retry is logged at WARNING and recorded in :attr:`retries`. A shard that
        failed ``retries + 1`` times, or work left with no endpoint to run it, raises
        :class:`FleetError` (``partial``: the results so far, ``None`` where missing).
        Results come back in the order of ``shards``.
        """
        items = list(shards)
        results: list[Any] = [None] * len(items)

        def runner(address: str, endpoint: Endpoint, units: list[int], done: _Done) -> None:
            # One shard per call: the scheduler hands out tasks of one unit.
            (unit,) = units
            done(unit, fn(address, items[unit]))

        outcome = self._schedule(
            [[i] for i in range(len(items))], runner, retries, recover_timeout, split=False
        )
        for unit, value in outcome.done.items():
            results[unit] = value
        if outcome.failed:
            raise FleetError(
                outcome.describe("shard"), partial=results, retries=outcome.retries
            ) from outcome.last_error
        return results

    def run(
        self,
        model: Any,
        *,
        seeds: Sequence[int],
        retries: int = 2,
        recover_timeout: float = 60.0,
        record_episodes: bool = True,
        **run_kwargs: Any,
    ) -> FleetRunResult:
        """One evaluation over the whole fleet: :func:`rlmesh.run` per endpoint, merged.

        See :func:`rlmesh_trio.fleet.run_fleet` (this is it, bound to the fleet).
        """
        from ._run import run_fleet

        return run_fleet(
            self,
            model,
            seeds=seeds,
            retries=retries,
            recover_timeout=recover_timeout,
            record_episodes=record_episodes,
            **run_kwargs,
        )

    def _schedule(
        self,
        tasks: list[list[int]],
        runner: Callable[[str, Endpoint, list[int], _Done], None],
        retries: int,
        recover_timeout: float,
        *,
        split: bool,
        owners: Sequence[int] | None = None,
    ) -> _Outcome:
        """Run ``tasks`` (lists of unit ids) on the endpoints, one task per endpoint at a
        time, re-queueing what a failed attempt left unfinished. ``runner(address,
        endpoint, units, done)`` calls ``done(unit, value)`` per finished unit and raises
        on failure. ``split``: an idle endpoint may take part of a queued task (``run``:
        its unfinished seeds), so a re-queued task spreads over the free endpoints.
        ``owners[i]``: the endpoint that runs task ``i`` first (another takes it only
        while that one is not serving, or once it has left the work)."""
        self._check_open()
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        return _Scheduler(self, tasks, runner, retries, recover_timeout, split, owners).run()

    # -- lifecycle -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this fleet is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the fleet. A static fleet owns no endpoint, so they keep running;
        a launched fleet stops its endpoints. Idempotent."""
        self._closed = True

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Scheduler:
    """One worker thread per endpoint; a shared queue of tasks; every wait bounded."""

    def __init__(
        self,
        fleet: Fleet,
        tasks: list[list[int]],
        runner: Callable[[str, Endpoint, list[int], _Done], None],
        retries: int,
        recover_timeout: float,
        split: bool,
        owners: Sequence[int] | None = None,
    ) -> None:
        self.fleet = fleet
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
        self.total = sum(len(t) for t in tasks)
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

    def run(self) -> _Outcome:
        if self.total:
            live = [e for e in self.fleet.endpoints if e.state != "dead"]
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
        return _Outcome(self.done, self.failed, self.retry_log, self.last_error)

    def take(self, index: int, lanes: int | None) -> list[int] | None:
        """Lock held: the next task for endpoint ``index``, or None when all is done."""
        while True:
            if self.finished() or self.fleet.closed or self.aborted is not None:
                return None
            own = self.owned.pop(index, None)
            if own is None:
                # Reserved for an endpoint that cannot take it now: free for all.
                for owner in sorted(self.owned.keys() & self.unavailable):
                    self.queue.append((self.owned.pop(owner), False))
            if own is not None:
                self.in_flight += 1
                return own
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
            self.cond.wait(1.0)

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

    def work(self, index: int) -> None:
        try:
            # Not answering when the work began: wait for it (bounded), then join in.
            if self.fleet._member(index).state != "serving":
                self.available(index, False)
                if not self.fleet._recover(
                    index, time.monotonic() + self.recover_timeout, self.over
                ):
                    return
                self.available(index, True)
            while True:
                endpoint = self.fleet._member(index)
                with self.cond:
                    task = self.take(index, endpoint.lanes)
                if task is None:
                    return
                try:
                    self.runner(endpoint.address, endpoint, task, self.record)
                except _Abort as exc:
                    with self.cond:
                        self.in_flight -= 1
                        self.aborted = exc
                        self.last_error = exc
                        self.cond.notify_all()
                    return
                except Exception as exc:
                    if not self.requeue(endpoint, task, exc):
                        return
                    self.fleet._failed(index, exc)
                    self.available(index, False)
                    deadline = time.monotonic() + self.recover_timeout
                    if not self.fleet._recover(index, deadline, self.over):
                        log.warning(
                            "fleet: endpoint %d (%s) is not serving again; it takes no more work",
                            index,
                            endpoint.address,
                        )
                        return
                    self.available(index, True)
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

    def requeue(self, endpoint: Endpoint, task: list[int], exc: BaseException) -> bool:
        """A task failed: queue its unfinished units again (those within their retries).
        Returns False when the fleet is closing."""
        error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
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
                with self.fleet._lock:
                    self.fleet._retries.append(retry)
                log.warning(
                    "fleet: %d item(s) failed on endpoint %d (%s): %s; retry %d queued",
                    len(again),
                    endpoint.index,
                    endpoint.address,
                    error,
                    worst,
                )
            self.cond.notify_all()
            return not self.fleet.closed
