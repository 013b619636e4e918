"""The Ray fleet and its health supervisor: :class:`RayFleet`, :class:`SupervisorStats`.

A driver thread probes every endpoint every ``health_period_seconds`` and kills (so Ray
restarts) one that failed ``unhealthy_after`` probes in a row: Ray alone sees a wedged
endpoint as healthy. It also follows restarts (a new actor instance, perhaps a new
address) and deaths (Ray out of restarts). :class:`RayFleet` subclasses the
engine-neutral :class:`~rlmesh_trio.fleet.Fleet` through its hooks for subclasses
(``_observed``, ``_recover``, its members' record).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from ..._deprecation import renamed_kwargs
from ..._errors import first_line
from ..._tls import TlsSetting
from .._core import Fleet, Member
from .._records import Health
from ._actor import EndpointInfo

log = logging.getLogger("rlmesh_trio.fleet.ray")


@dataclass
class SupervisorStats:
    """What the health supervisor did (:meth:`RayFleet.stats`)."""

    probes: int = 0
    failed_probes: int = 0
    kills: int = 0
    """Endpoints the supervisor killed for failing ``unhealthy_after`` probes in a row."""
    restarts: int = 0
    """Restarts observed (a new actor instance answered), whoever caused them."""
    deaths: int = 0
    """Endpoints Ray gave up on (``max_restarts`` used up)."""


class _RayMember(Member):
    def __init__(self, index: int, actor: Any, info: EndpointInfo) -> None:
        super().__init__(index, info.address, info.num_envs, info.node)
        self.actor = actor
        self.info = info
        self.state = "serving"
        self.failures = 0
        self.down_since: float | None = None
        """When it was killed or found gone (``time.monotonic()``), until it answers again."""

    def dead(self) -> bool:
        return self.state == "dead"


class RayFleet(Fleet):
    """A :class:`~rlmesh_trio.fleet.Fleet` whose endpoints are Ray actors; see :func:`launch`.

    ``close()`` stops the supervisor, stops every endpoint (drain, bounded) and removes
    the actors and their placement group. Ray itself keeps running.
    """

    def __init__(
        self,
        actors: list[Any],
        infos: list[EndpointInfo],
        *,
        pg: PlacementGroup,
        fleet_id: str,
        auth_token: str | None,
        tls: TlsSetting = None,
        health_period_seconds: float,
        health_timeout_seconds: float,
        unhealthy_after: int,
        ready_timeout_seconds: float,
        stop_timeout_seconds: float,
    ) -> None:
        super().__init__([i.address for i in infos], auth_token=auth_token, tls=tls)
        self._members = [
            _RayMember(i, a, info) for i, (a, info) in enumerate(zip(actors, infos, strict=True))
        ]
        self._pg = pg
        self.fleet_id = fleet_id
        self._period = health_period_seconds
        self._probe_timeout = health_timeout_seconds
        self._unhealthy_after = unhealthy_after
        self._ready_timeout = ready_timeout_seconds
        self._stop_timeout = stop_timeout_seconds
        self._stats = SupervisorStats()
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(
            target=self._supervise, name="rlmesh-fleet-supervisor", daemon=True
        )
        self._supervisor.start()

    # -- what Ray knows ----------------------------------------------------------------

    def _ray_member(self, index: int) -> _RayMember:
        member = self._members[index]
        assert isinstance(member, _RayMember)
        return member

    def actor(self, index: int) -> Any:
        """Endpoint ``index``'s Ray actor handle."""
        return self._ray_member(index).actor

    @renamed_kwargs(timeout="timeout_seconds")
    def info(self, index: int, timeout_seconds: float = 10.0) -> EndpointInfo:
        """Ask endpoint ``index``'s actor about itself (its pid, node, niceness, address);
        refreshes :attr:`endpoints`. Waits for a restart in progress, up to
        ``timeout_seconds``."""
        refreshed = self._refresh(index, timeout_seconds)
        if refreshed is None:
            raise TimeoutError(f"endpoint {index} did not answer within {timeout_seconds} s")
        return refreshed

    def stats(self) -> SupervisorStats:
        """A copy of the supervisor's counts."""
        with self._lock:
            return replace(self._stats)

    def _refresh(self, index: int, timeout: float) -> EndpointInfo | None:
        """Ask the actor for its current info (address, instance); None on a timeout.
        A new instance is a restart: the address is updated. ActorDiedError: dead."""
        member = self._ray_member(index)
        if member.state == "dead":
            return None
        try:
            info: EndpointInfo = ray.get(member.actor.info.remote(), timeout=timeout)
        except GetTimeoutError:
            return None
        except RayActorError as exc:
            self._dead(member, exc)
            return None
        with self._lock:
            if info.instance != member.info.instance:
                member.restarts += 1
                self._stats.restarts += 1
                log.warning(
                    "fleet: endpoint %d restarted (%d so far): %s -> %s",
                    index,
                    member.restarts,
                    member.address,
                    info.address,
                )
                member.info = info
                member.address = info.address
                member.node = info.node
                member.num_envs = info.num_envs
                member.failures = 0
                # Its start-up grace; the state stays what the probes say.
                member.down_since = time.monotonic()
        return info

    def _dead(self, member: _RayMember, exc: BaseException) -> None:
        with self._lock:
            if member.state != "dead":
                member.state = "dead"
                self._stats.deaths += 1
                log.error(
                    "fleet: endpoint %d (%s) is dead: %s",
                    member.index,
                    member.address,
                    first_line(exc),
                )

    def _observed(self, member: Member, health: Health) -> None:
        assert isinstance(member, _RayMember)
        self._stats.probes += 1
        if health.serving:
            member.state = "serving"
            member.failures = 0
            member.down_since = None
        else:
            self._stats.failed_probes += 1
            member.failures += 1
            if member.state == "serving":
                member.state = "restarting"

    # -- supervision -------------------------------------------------------------------

    def _supervise(self) -> None:
        # The endpoints are checked at once (a wedged one takes its whole probe timeout).
        workers = min(16, len(self._members))
        with ThreadPoolExecutor(workers, "rlmesh-fleet-supervise") as pool:
            while not self._stopping.wait(self._period):
                list(pool.map(self._check_safely, range(len(self._members))))

    def _check_safely(self, index: int) -> None:
        if self._stopping.is_set():
            return
        try:
            self._check(index)
        except Exception:  # never let one endpoint's trouble stop the watch
            log.exception("fleet: supervising endpoint %d failed", index)

    def _check(self, index: int) -> None:
        member = self._ray_member(index)
        if member.state == "dead":
            return
        health = self._probe_one(index, self._probe_timeout)
        # Serving or not, ask the actor too: a restart that was over before any probe
        # failed (a pinned port) is still counted. Not serving: has it been restarted
        # (new address), is it dead, or wedged?
        info = self._refresh(index, self._probe_timeout)
        if health.serving:
            return
        with self._lock:
            if info is None and _refused(health) and member.down_since is None:
                # Nothing listens and the actor does not answer: its process died and
                # Ray is starting it again. Killing it would only count against
                # max_restarts: it gets its start-up time first.
                member.down_since = time.monotonic()
            if member.dead() or member.failures < self._unhealthy_after:
                return
            now = time.monotonic()
            if member.down_since is not None and now - member.down_since < self._ready_timeout:
                return  # killed or restarted recently: it gets its start-up time first
            failures = member.failures
            member.failures = 0
            member.down_since = now
            member.state = "restarting"
            self._stats.kills += 1
        log.warning(
            "fleet: endpoint %d (%s) failed %d health probes in a row (%s): restarting it",
            index,
            member.address,
            failures,
            health,
        )
        try:
            ray.kill(member.actor, no_restart=False)
        except Exception as exc:  # the actor is already gone
            self._dead(member, exc)

    @renamed_kwargs(timeout="timeout_seconds")
    def restart(self, index: int, timeout_seconds: float | None = None) -> EndpointInfo:
        """Kill endpoint ``index``'s process and wait (up to ``timeout_seconds``, default
        the launch's ``ready_timeout_seconds``) until Ray has it serving again: a new
        actor instance, answering its health check."""
        member = self._ray_member(index)
        with self._lock:
            member.state = "restarting"
            member.down_since = time.monotonic()
            before = member.info.instance
        ray.kill(member.actor, no_restart=False)
        wait = self._ready_timeout if timeout_seconds is None else timeout_seconds
        deadline = time.monotonic() + wait
        # The kill is asynchronous: the old process may answer a little longer.
        while member.info.instance == before:
            left = deadline - time.monotonic()
            if left <= 0 or member.dead():
                break
            self._refresh(index, min(left, self._ready_timeout))
            if member.info.instance == before:
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        if member.info.instance == before or not self._recover(index, deadline):
            raise TimeoutError(f"endpoint {index} is not serving again after {wait} s")
        return member.info

    def _recover(
        self, index: int, deadline: float, cancelled: Callable[[], bool] = lambda: False
    ) -> bool:
        member = self._ray_member(index)
        while not self._closed and not cancelled():
            left = deadline - time.monotonic()
            if member.state == "dead":
                return False
            if left <= 0:
                return False
            # Short waits, so that a cancelled recovery ends soon.
            self._refresh(index, min(max(0.1, left), self._probe_timeout))
            if member.dead():
                return False
            health = self._probe_one(index, min(self._probe_timeout, max(0.1, left)))
            if health.serving:
                return True
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return False

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the supervisor, then every endpoint (bounded), then remove the actors and
        the placement group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._supervisor.join(self._probe_timeout * 3 + self._period + 5.0)
        live = [m for m in self._members if isinstance(m, _RayMember) and m.state != "dead"]
        stops = [m.actor.stop.remote() for m in live]
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=self._stop_timeout)
        for member in self._members:
            assert isinstance(member, _RayMember)
            with contextlib.suppress(Exception):
                ray.kill(member.actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self._pg)

    def __enter__(self) -> RayFleet:
        return self


def _refused(health: Health) -> bool:
    """The probe found nothing listening (as opposed to no answer, or NOT_SERVING)."""
    return health.error is not None and "ConnectionRefusedError" in health.error
