"""The engine-neutral fleet: endpoints, their health, and shards run over them.

No Ray import here: a :class:`Fleet` over a static address list (or a Kubernetes
StatefulSet's DNS names) gets the same client-side help -- health over grpc.health.v1,
``map`` and ``run`` with retries -- as one launched on Ray (:mod:`rlmesh_trio.fleet.ray`),
which subclasses it and adds restarts. The scheduler (:mod:`._scheduler`) sees the
fleet through a small adapter (:class:`_SchedulerHost`), the run (:mod:`._run`) through
the fleet's public face and that adapter.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

from .._address import TcpAddress, UnixAddress, parse_address
from .._deprecation import renamed_kwargs, warn
from .._tls import TlsSetting, client_context
from ..client import probe
from ._records import EndpointStatus, FleetError, FleetRunResult, Health, Retry, State
from ._run import run as run_sharded
from ._scheduler import Done, Outcome, Runner, schedule

log = logging.getLogger("rlmesh_trio.fleet")

T = TypeVar("T")
R = TypeVar("R")

RECOVERY_POLL_SECONDS = 0.25
"""How often a static fleet re-probes an endpoint that failed, until it serves again."""


class Member:
    """The fleet's mutable record of one endpoint (guarded by the fleet's lock)."""

    def __init__(self, index: int, address: str, num_envs: int | None, node: str | None) -> None:
        self.index = index
        self.address = address
        self.num_envs = num_envs
        self.node = node
        self.state: State = "restarting"
        self.restarts = 0

    def snapshot(self) -> EndpointStatus:
        return EndpointStatus(
            self.index, self.address, self.num_envs, self.state, self.restarts, self.node
        )


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
            Member(i, a, None, nodes[i] if nodes is not None else _host_of(a))
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
    def endpoints(self) -> list[EndpointStatus]:
        """A snapshot of every endpoint: address, num_envs, state, restarts, node."""
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

    def _probe_one(self, index: int, timeout_seconds: float) -> Health:
        with self._lock:
            member = self._members[index]
            address, state = member.address, member.state
        if state == "dead":
            return Health(index, address, False, "dead", "the endpoint is dead")
        # Two calls (Check, then Handshake), each within half the deadline.
        result = probe(
            address,
            timeout_seconds=timeout_seconds / 2,
            auth_token=self._auth_token,
            tls=self._tls_context,
        )
        num_envs = result.num_envs or None
        health = Health(index, address, result.serving, result.health, result.error, num_envs)
        with self._lock:
            if member.address == address and member.state != "dead":
                if num_envs is not None:
                    member.num_envs = num_envs
                self._observed(member, health)
        return health

    def _observed(self, member: Member, health: Health) -> None:
        """Lock held: a probe's verdict on ``member`` (a subclass may track more)."""
        member.state = "serving" if health.serving else "restarting"

    @renamed_kwargs(timeout="timeout_seconds")
    def health(self, timeout_seconds: float = 2.0) -> list[Health]:
        """Probe every endpoint at once (grpc.health.v1 Check, then a Handshake), each
        within ``timeout_seconds``; updates :attr:`endpoints`' states and num_envs."""
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        self._check_open()
        with ThreadPoolExecutor(len(self._members), "rlmesh-fleet-probe") as pool:
            futures = [pool.submit(self._probe_one, i, timeout_seconds) for i in range(len(self))]
            return [f.result() for f in futures]

    @renamed_kwargs(timeout="timeout_seconds", probe_timeout="probe_timeout_seconds")
    def wait_ready(self, timeout_seconds: float, *, probe_timeout_seconds: float = 2.0) -> None:
        """Return once every live endpoint serves; ``TimeoutError`` after
        ``timeout_seconds`` (naming those that do not), each probe within
        ``probe_timeout_seconds``. Dead endpoints are not waited for."""
        timeout = timeout_seconds
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            report = self.health(max(0.05, min(probe_timeout_seconds, left)))
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

    def _member(self, index: int) -> EndpointStatus:
        with self._lock:
            return self._members[index].snapshot()

    # -- work -----------------------------------------------------------------------------

    @renamed_kwargs(recover_timeout="recover_timeout_seconds")
    def map(
        self,
        fn: Callable[[str, T], R],
        shards: Iterable[T],
        *,
        retries: int = 2,
        recover_timeout_seconds: float = 60.0,
    ) -> list[R]:
        """``[fn(address, shard) for shard in shards]``, one shard per endpoint at a time.

        Each endpoint takes the next shard as soon as it is free, so the endpoints work
        at once (``fn`` runs on one thread per endpoint). A shard whose call raises is
        queued again and runs on the next endpoint that is free -- the same one once it
        serves again (re-resolved: a restarted endpoint's new address), or another;
        each retry is logged at WARNING and recorded in :attr:`retries`. A shard that
        failed ``retries + 1`` times, or work left with no endpoint to run it, raises
        :class:`FleetError` (``partial``: the results so far, ``None`` where missing).
        ``recover_timeout_seconds``: how long a failed endpoint may take to serve again
        before it takes no more of this work. Results come back in the order of ``shards``.
        """
        items = list(shards)
        results: list[Any] = [None] * len(items)

        def runner(address: str, endpoint: EndpointStatus, units: list[int], done: Done) -> None:
            # One shard per call: the scheduler hands out tasks of one unit.
            (unit,) = units
            done(unit, fn(address, items[unit]))

        outcome = self._schedule(
            [[i] for i in range(len(items))],
            runner,
            retries=retries,
            recover_timeout_seconds=recover_timeout_seconds,
            split=False,
        )
        for unit, value in outcome.done.items():
            results[unit] = value
        if outcome.failed:
            raise FleetError(
                outcome.describe("shard"), partial=results, retries=outcome.retries
            ) from outcome.last_error
        return results

    @renamed_kwargs(recover_timeout="recover_timeout_seconds")
    def run(
        self,
        model: Any,
        *,
        seeds: Sequence[int],
        retries: int = 2,
        recover_timeout_seconds: float = 60.0,
        record_episodes: bool = True,
        **run_kwargs: Any,
    ) -> FleetRunResult:
        """Evaluate ``model`` once per seed over the fleet and merge the results.

        The seeds are cut, in order, into one shard per serving endpoint (the first
        endpoint's shard holds the first seeds), in whole rounds of that endpoint's lanes
        (a short shard is filled up by repeating some of its seeds, and the extra
        episodes are discarded), and every endpoint runs its shard with its own
        :func:`rlmesh.run` (endpoints admit one session each), all at once, on one
        thread each. ``model`` is what ``rlmesh.run`` takes: a local ``rlmesh``
        ``Model`` instance (borrowed by the concurrent runs, as ``rlmesh.run`` borrows
        it) or a ``Model`` subclass (one built per run). ``run_kwargs`` go to every
        ``rlmesh.run`` (``max_episode_steps``, ``hooks``, ``instruction``, ...).

        Finished episodes are recorded as they end (through rlmesh's ``RunHooks``), so
        when an endpoint fails mid-run only the seeds its run had not finished are
        queued again: on the same endpoint once it serves again (a Ray fleet waits for
        the restarted actor, at its new address), or on whichever endpoint is free
        first. A seed that failed ``retries + 1`` times, or seeds left with no endpoint
        to run them, raise :class:`FleetError` whose ``partial`` is the merged result of
        what finished.

        ``record_episodes=False`` trades that for speed: without hooks, rlmesh's runtime
        does not relay every step to Python (it decodes each observation and action for
        the hooks: about a quarter of the driver's time per step was measured), but a
        failed run's episodes are unknown, so its whole shard runs again. (A caller's
        own ``hooks`` turn the recording on anyway.) ``recover_timeout_seconds``: how
        long a failed endpoint may take to serve again before it is left out of this run.

        The result (:class:`FleetRunResult`, shaped like ``rlmesh.RunResult``) holds each
        seed's episode exactly once, in the order of ``seeds``, with ``index`` its
        position there; ``shards`` records every run made and ``retries`` every retry.

        A user's ``hooks`` sees ``on_run_start`` once per shard run, ``on_episode_start``
        and ``on_step`` of every episode run (calls from the endpoints' threads are
        serialized), ``on_episode_end`` once per kept episode, ``on_run_end`` once with
        the merged result (as an ``rlmesh.RunResult``).
        """
        self._check_open()
        return run_sharded(
            self,
            _SchedulerHost(self),
            model,
            seeds=seeds,
            retries=retries,
            recover_timeout_seconds=recover_timeout_seconds,
            record_episodes=record_episodes,
            run_kwargs=run_kwargs,
        )

    def _schedule(
        self,
        tasks: list[list[int]],
        runner: Runner,
        *,
        retries: int,
        recover_timeout_seconds: float,
        split: bool,
        owners: Sequence[int] | None = None,
    ) -> Outcome:
        """:func:`._scheduler.schedule` on this fleet."""
        self._check_open()
        return schedule(
            _SchedulerHost(self),
            tasks,
            runner,
            retries=retries,
            recover_timeout_seconds=recover_timeout_seconds,
            split=split,
            owners=owners,
        )

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


class _SchedulerHost:
    """The fleet as :class:`._scheduler.Host` sees it (and nothing more of it)."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def endpoints(self) -> list[EndpointStatus]:
        return self._fleet.endpoints

    def endpoint(self, index: int) -> EndpointStatus:
        return self._fleet._member(index)

    def recover(self, index: int, deadline: float, cancelled: Callable[[], bool]) -> bool:
        return self._fleet._recover(index, deadline, cancelled)

    def failed(self, index: int, error: BaseException) -> None:
        self._fleet._failed(index, error)

    def retried(self, retry: Retry) -> None:
        with self._fleet._lock:
            self._fleet._retries.append(retry)

    def closed(self) -> bool:
        return self._fleet.closed


def run_fleet(fleet: Fleet, model: Any, **kwargs: Any) -> FleetRunResult:
    """Deprecated: use :meth:`Fleet.run` (``run_fleet(fleet, model, ...)`` is
    ``fleet.run(model, ...)``); goes in rlmesh-trio 0.2."""
    warn("rlmesh_trio.fleet.run_fleet()", "Fleet.run()")
    return fleet.run(model, **kwargs)
