"""Endpoints launched and supervised on Ray (the ``ray`` extra).

Ray is the control plane only: each endpoint is one Ray actor -- a process running
:func:`rlmesh_trio.serve_env` under ``trio.run`` in a thread of its own -- placed by a
placement group, restarted by Ray when its process dies (``max_restarts``), and watched
by a health-driven supervisor in the driver that kills (and so restarts) an endpoint
failing several probes in a row: Ray alone sees a wedged endpoint as healthy. Env
traffic never goes through Ray: clients dial each endpoint's address directly.

>>> from rlmesh_trio.fleet.ray import launch
>>> with launch("CartPole-v1", endpoints=4, lanes=8) as fleet:   # doctest: +SKIP
...     result = fleet.run(model, seeds=range(1000))
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import logging
import os
import queue
import secrets
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .._address import TcpAddress, parse_address
from .._options import ServeOptions, stop_bound, tls_files
from .._tls import TlsSetting
from ._core import Fleet, _Member
from ._records import Health

__all__ = ["RayFleet", "SupervisorStats", "launch"]

log = logging.getLogger("rlmesh_trio.fleet.ray")

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
_PORT_DIR = "rlmesh-trio-fleet"
"""Under the node's temp dir: one small file per endpoint with its pinned port."""


# -- the actor ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _ActorConfig:
    fleet_id: str
    index: int
    env: str | Callable[..., Any]
    env_kwargs: Mapping[str, Any]
    lanes: int
    bind: str
    options: ServeOptions
    pin_ports: bool
    ready_timeout_s: float
    tls_pem: TlsPem | None = None
    """The endpoints' certificate, key and client CA, read on the driver: written to a
    private directory on the actor's node (so the files need not be there already)."""


@dataclass(frozen=True)
class TlsPem:
    cert: bytes
    key: bytes
    client_ca: bytes | None

    @classmethod
    def read(cls, cert: Any, key: Any, client_ca: Any) -> TlsPem:
        def load(path: Any) -> bytes:
            with open(os.fspath(path), "rb") as file:
                return file.read()

        return cls(load(cert), load(key), None if client_ca is None else load(client_ca))

    def materialize(self, options: ServeOptions) -> tuple[ServeOptions, str]:
        """``options`` pointing at the PEMs written to a fresh 0700 directory (returned)."""
        directory = tempfile.mkdtemp(prefix="rlmesh-trio-tls-")
        paths: dict[str, str | None] = {}
        for name, data in (("cert", self.cert), ("key", self.key), ("client_ca", self.client_ca)):
            if data is None:
                paths[name] = None
                continue
            path = os.path.join(directory, f"{name}.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            paths[name] = path
        return (
            replace(
                options,
                tls_cert_file=paths["cert"],
                tls_key_file=paths["key"],
                tls_client_ca_file=paths["client_ca"],
            ),
            directory,
        )


@dataclass(frozen=True)
class EndpointInfo:
    """What an endpoint actor reports about itself (one constructor run)."""

    address: str
    node: str
    pid: int
    instance: str
    """Unique per start: a new value means the actor was restarted."""
    niceness: int
    env_id: str
    lanes: int


def _port_file(fleet_id: str, index: int) -> str:
    return os.path.join(tempfile.gettempdir(), _PORT_DIR, f"{fleet_id}-{index}.json")


class _EndpointActor:
    """One endpoint: ``serve_env`` under ``trio.run`` on a thread of this actor process.

    The constructor returns once the endpoint serves (every lane built, the socket
    listening): Ray then runs the method calls. On a restart Ray runs it again with
    the same arguments; the port file makes it come back on the same port.
    """

    def __init__(self, config: _ActorConfig) -> None:
        import trio

        from .._serve import ServerInfo, serve_env

        self._config = config
        self._tls_dir: str | None = None
        if config.tls_pem is not None:
            options, self._tls_dir = config.tls_pem.materialize(config.options)
            config = replace(config, options=options)
        if config.options.auth_token is None:
            # launch() decided on auth; a token in the workers' environment would make
            # the endpoint refuse the fleet's own probes (and be restarted forever).
            os.environ.pop("RLMESH_TRIO_AUTH_TOKEN", None)
        self._ready: queue.Queue[ServerInfo | BaseException] = queue.Queue()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call,unused-ignore]
        host = node_ip if config.bind == "node" else config.bind
        port = self._pinned_port() if config.pin_ports else 0

        async def main(port: int) -> bool:
            """Serve until stopped; False at once if the pinned ``port`` is taken."""
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                try:
                    info = await nursery.start(
                        functools.partial(
                            serve_env,
                            config.env,
                            num_envs=config.lanes,
                            address=str(TcpAddress(host, port)),
                            options=config.options,
                            env_kwargs=config.env_kwargs,
                        )
                    )
                except OSError as exc:
                    if port == 0:
                        raise
                    log.warning("pinned port %d unavailable (%s): using a new one", port, exc)
                    return False
                self._ready.put(info)
            return True

        def thread_main() -> None:
            try:
                if not trio.run(main, port) and port:
                    trio.run(main, 0)
            except BaseException as exc:
                self._ready.put(exc)

        self._thread = threading.Thread(target=thread_main, name="rlmesh-trio-serve", daemon=True)
        self._thread.start()
        try:
            item = self._ready.get(timeout=config.ready_timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"endpoint {config.index} did not serve within {config.ready_timeout_s} s"
            ) from None
        if isinstance(item, BaseException):
            raise item
        self._server: ServerInfo = item
        self._info = EndpointInfo(
            address=item.address,
            node=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            instance=uuid.uuid4().hex,
            niceness=os.nice(0),
            env_id=item.env_id,
            lanes=item.num_envs,
        )
        if config.pin_ports:
            self._pin(parse_address(item.address))

    def _pinned_port(self) -> int:
        try:
            with open(_port_file(self._config.fleet_id, self._config.index)) as file:
                port = int(json.load(file)["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0
        return port if 0 < port < 65536 else 0

    def _pin(self, address: Any) -> None:
        path = _port_file(self._config.fleet_id, self._config.index)
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            temporary = f"{path}.{os.getpid()}"
            with open(temporary, "w") as file:
                json.dump({"port": address.port}, file)
            os.replace(temporary, path)

    def info(self) -> EndpointInfo:
        return self._info

    def stop(self) -> bool:
        """Stop serving (drain, close the lanes; bounded) and forget the pinned port."""
        token, scope = self._token, self._scope
        if token is not None and scope is not None:
            with contextlib.suppress(RuntimeError):  # the run already ended
                token.run_sync_soon(scope.cancel)
        options = self._config.options
        bound = stop_bound(
            5.0 if options.drain_timeout_seconds is None else options.drain_timeout_seconds,
            5.0 if options.close_timeout_seconds is None else options.close_timeout_seconds,
        )
        self._thread.join(bound + 1.0)
        with contextlib.suppress(OSError):
            os.remove(_port_file(self._config.fleet_id, self._config.index))
        if self._tls_dir is not None:
            shutil.rmtree(self._tls_dir, ignore_errors=True)
        return not self._thread.is_alive()


# -- the fleet ---------------------------------------------------------------------------


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


class _RayMember(_Member):
    def __init__(self, index: int, actor: Any, info: EndpointInfo) -> None:
        super().__init__(index, info.address, info.lanes, info.node)
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
        health_period_s: float,
        health_timeout_s: float,
        unhealthy_after: int,
        ready_timeout_s: float,
        stop_timeout_s: float,
    ) -> None:
        super().__init__([i.address for i in infos], auth_token=auth_token, tls=tls)
        self._members = [
            _RayMember(i, a, info) for i, (a, info) in enumerate(zip(actors, infos, strict=True))
        ]
        self._pg = pg
        self.fleet_id = fleet_id
        self._period = health_period_s
        self._probe_timeout = health_timeout_s
        self._unhealthy_after = unhealthy_after
        self._ready_timeout = ready_timeout_s
        self._stop_timeout = stop_timeout_s
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

    def info(self, index: int, timeout: float = 10.0) -> EndpointInfo:
        """Ask endpoint ``index``'s actor about itself (its pid, node, niceness, address);
        refreshes :attr:`endpoints`. Waits for a restart in progress, up to ``timeout``."""
        refreshed = self._refresh(index, timeout)
        if refreshed is None:
            raise TimeoutError(f"endpoint {index} did not answer within {timeout} s")
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
                member.lanes = info.lanes
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
                    str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                )

    def _observed(self, member: _Member, health: Health) -> None:
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

    def restart(self, index: int, timeout: float | None = None) -> EndpointInfo:
        """Kill endpoint ``index``'s process and wait (up to ``timeout``, default the
        launch's ``ready_timeout_s``) until Ray has it serving again."""
        member = self._ray_member(index)
        with self._lock:
            member.state = "restarting"
            member.down_since = time.monotonic()
        ray.kill(member.actor, no_restart=False)
        wait = self._ready_timeout if timeout is None else timeout
        if not self._recover(index, time.monotonic() + wait):
            raise TimeoutError(f"endpoint {index} is not serving again after {wait} s")
        return self._ray_member(index).info

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


# -- launch ------------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    options: dict[str, Any] = {"num_cpus": float(resources.get("CPU", 0))}
    if "GPU" in resources:
        options["num_gpus"] = float(resources["GPU"])
    if "memory" in resources:
        options["memory"] = float(resources["memory"])
    custom = {k: float(v) for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    if custom:
        options["resources"] = custom
    return options


def launch(
    env: str | Callable[..., Any],
    *,
    endpoints: int,
    lanes: int,
    env_kwargs: Mapping[str, Any] | None = None,
    resources: Mapping[str, float] | None = None,
    placement: str = "SPREAD",
    max_restarts: int = 3,
    health_period_s: float = 5.0,
    health_timeout_s: float = 2.0,
    unhealthy_after: int = 3,
    pin_ports: bool = True,
    bind: str = "node",
    auth_token: str | None = None,
    require_auth: bool | None = None,
    tls: TlsSetting = None,
    tls_cert_file: str | os.PathLike[str] | None = None,
    tls_key_file: str | os.PathLike[str] | None = None,
    tls_client_ca_file: str | os.PathLike[str] | None = None,
    niceness: int | None = 0,
    options: ServeOptions | None = None,
    runtime_env: Mapping[str, Any] | None = None,
    ready_timeout_s: float = 120.0,
    stop_timeout_s: float = 15.0,
) -> RayFleet:
    """Launch ``endpoints`` endpoints of ``lanes`` lanes each as Ray actors; return the fleet.

    ``env`` is what :func:`rlmesh_trio.serve_env` takes: a gymnasium id, or a factory
    (pickled to the workers; ``env_kwargs`` are passed to it). Ray must be initialized
    (``ray.init(...)``) -- or ``launch`` starts a local Ray with its defaults.

    * Placement: a placement group of one bundle of ``resources`` per endpoint
      (default ``{"CPU": 1}``; keys ``CPU``, ``GPU``, ``memory`` and custom resources),
      with ``placement`` one of ``PACK``, ``SPREAD`` (default), ``STRICT_PACK``,
      ``STRICT_SPREAD``.
    * Restarts: Ray restarts a dead endpoint process up to ``max_restarts`` times
      (-1: forever; 0: never). The supervisor (a driver thread) probes every endpoint
      every ``health_period_s`` (grpc.health.v1 Check and a Handshake, within
      ``health_timeout_s``) and kills one that failed ``unhealthy_after`` probes in a
      row, so Ray restarts it; a restarted endpoint gets ``ready_timeout_s`` to serve
      before it can be killed again. An endpoint out of restarts is ``dead``.
    * Addresses: with ``pin_ports`` an endpoint restarted on the same node comes back
      on the same port (when it is still free); the fleet's ``addresses`` follow every
      restart either way.
    * ``bind``: ``"node"`` (the node's IP address, as Ray reports it) or a host to bind
      (``"127.0.0.1"`` keeps a one-machine fleet on loopback; ``"0.0.0.0"``).
    * Auth: beyond loopback every endpoint requires a bearer token -- ``auth_token``,
      or one generated here (:attr:`Fleet.auth_token`) -- unless ``require_auth=False``.
      rlmesh 0.1.0's clients cannot send a token, so :meth:`Fleet.run` needs
      ``require_auth=False`` (on a network you trust); token-capable clients use
      :meth:`Fleet.map` with ``fleet.auth_token``. The health check never needs it.
      These arguments decide: ``RLMESH_TRIO_AUTH_TOKEN`` in the workers' environment is
      ignored.
    * TLS: ``tls_cert_file`` / ``tls_key_file`` (and ``tls_client_ca_file`` for mTLS)
      are the endpoints' (as :class:`~rlmesh_trio.ServeOptions` takes them), read here
      and shipped to each actor, which writes them to a private directory on its node;
      the certificate must name every address an endpoint gets (the nodes' IPs as IP
      SANs with ``bind="node"``). ``tls`` is how the fleet's probes (and ``map``
      functions, :attr:`Fleet.tls`) connect: the CA that signed it, or an
      ``ssl.SSLContext`` with a client certificate under mTLS. :meth:`Fleet.run` drives
      rlmesh 0.1.0's client, which has no TLS.
    * ``niceness``: the endpoint processes' nice value (Ray starts workers at 15, which
      cost an endpoint 11-16 % against normal-priority clients on a busy node);
      ``None`` keeps Ray's.
    * ``options``: the endpoints' :class:`~rlmesh_trio.ServeOptions`;
      ``runtime_env``: Ray's, for the actors (pip packages, env vars, working_dir).

    Returns once every endpoint serves (each actor's constructor returns only after
    ``serve_env`` reported its address through ``task_status.started``), or raises
    ``TimeoutError`` after ``ready_timeout_s``, or the first endpoint's startup error
    (after removing what was launched).
    """
    if not isinstance(endpoints, int) or endpoints < 1:
        raise ValueError(f"endpoints must be an int >= 1, got {endpoints!r}")
    if not isinstance(lanes, int) or lanes < 1:
        raise ValueError(f"lanes must be an int >= 1, got {lanes!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if not isinstance(max_restarts, int) or max_restarts < -1:
        raise ValueError(f"max_restarts must be an int >= -1, got {max_restarts!r}")
    if not isinstance(unhealthy_after, int) or unhealthy_after < 1:
        raise ValueError(f"unhealthy_after must be an int >= 1, got {unhealthy_after!r}")
    for label, value in (
        ("health_period_s", health_period_s),
        ("health_timeout_s", health_timeout_s),
        ("ready_timeout_s", ready_timeout_s),
        ("stop_timeout_s", stop_timeout_s),
    ):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{label} must be a number > 0, got {value!r}")
    if niceness is not None and not -20 <= niceness <= 19:
        raise ValueError(f"niceness must be in -20..19 or None, got {niceness!r}")
    bundle = {"CPU": 1.0} if resources is None else {k: float(v) for k, v in resources.items()}
    if any(v < 0 for v in bundle.values()) or not any(v > 0 for v in bundle.values()):
        raise ValueError(f"resources must be non-negative and not all zero, got {bundle!r}")
    if bind != "node":
        parse_address(f"{bind}:1")  # a host we can bind: raises ValueError otherwise
    if not ray.is_initialized():
        ray.init()
    node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call,unused-ignore]
    host = node_ip if bind == "node" else bind
    needs_token = (not _is_loopback(host)) if require_auth is None else require_auth
    token = (auth_token or secrets.token_urlsafe(32)) if needs_token else auth_token
    serve_options = options or ServeOptions()
    if token is not None:
        serve_options = replace(serve_options, auth_token=token)
    tls_pem = _tls_pem(serve_options, tls, tls_cert_file, tls_key_file, tls_client_ca_file)

    actor_runtime_env: dict[str, Any] = dict(runtime_env or {})
    if niceness is not None:
        env_vars = dict(actor_runtime_env.get("env_vars") or {})
        env_vars.setdefault("RAY_worker_niceness", str(niceness))
        actor_runtime_env["env_vars"] = env_vars

    fleet_id = uuid.uuid4().hex[:12]
    pg = placement_group([dict(bundle) for _ in range(endpoints)], strategy=placement)
    actors: list[Any] = []
    try:
        try:
            ray.get(pg.ready(), timeout=ready_timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"Ray could not place {endpoints} x {bundle} ({placement}) within "
                f"{ready_timeout_s} s: not enough resources in the cluster?"
            ) from None
        remote = ray.remote(_EndpointActor)
        for index in range(endpoints):
            config = _ActorConfig(
                fleet_id=fleet_id,
                index=index,
                env=env,
                env_kwargs=dict(env_kwargs or {}),
                lanes=lanes,
                bind=bind,
                options=serve_options,
                pin_ports=pin_ports,
                ready_timeout_s=ready_timeout_s,
                tls_pem=tls_pem,
            )
            actor = remote.options(
                max_restarts=max_restarts,
                max_task_retries=-1,
                max_concurrency=2,  # info() answers while stop() drains
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                ),
                runtime_env=actor_runtime_env or None,
                **_actor_options(bundle),
            ).remote(config)
            actors.append(actor)
        refs = [a.info.remote() for a in actors]
        try:
            infos: list[EndpointInfo] = ray.get(refs, timeout=ready_timeout_s)
        except GetTimeoutError:
            raise TimeoutError(
                f"the fleet's endpoints did not all serve within {ready_timeout_s} s"
            ) from None
        except RayActorError as exc:
            cause = exc.__cause__ or exc
            raise RuntimeError(f"an endpoint failed to start: {_first_line(cause)}") from exc
    except BaseException:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
        raise
    fleet = RayFleet(
        actors,
        infos,
        pg=pg,
        fleet_id=fleet_id,
        auth_token=token,
        tls=tls,
        health_period_s=health_period_s,
        health_timeout_s=health_timeout_s,
        unhealthy_after=unhealthy_after,
        ready_timeout_s=ready_timeout_s,
        stop_timeout_s=stop_timeout_s,
    )
    log.info("fleet %s: %d endpoints serving: %s", fleet_id, endpoints, fleet.addresses)
    return fleet


def _tls_pem(
    options: ServeOptions, tls: TlsSetting, cert: Any, key: Any, client_ca: Any
) -> TlsPem | None:
    """The endpoints' TLS files (checked here, where they are read), or None."""
    merged = replace(
        options,
        tls_cert_file=cert if cert is not None else options.tls_cert_file,
        tls_key_file=key if key is not None else options.tls_key_file,
        tls_client_ca_file=client_ca if client_ca is not None else options.tls_client_ca_file,
    )
    files = tls_files(merged)  # ValueError naming a missing or unusable file
    if files is None:
        if tls is not None and tls is not False:
            raise ValueError(
                "tls= is how the fleet connects to TLS endpoints: give them "
                "tls_cert_file and tls_key_file too"
            )
        return None
    if tls is None or tls is False:
        raise ValueError(
            "the endpoints serve TLS: give tls= too (the CA that signed their certificate, "
            "or an ssl.SSLContext with a client certificate under mTLS), so that the "
            "fleet's probes can reach them"
        )
    return TlsPem.read(files.cert_file, files.key_file, files.client_ca_file)


def _refused(health: Health) -> bool:
    """The probe found nothing listening (as opposed to no answer, or NOT_SERVING)."""
    return health.error is not None and "ConnectionRefusedError" in health.error


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1]}" if text else type(exc).__name__


def kill_process(fleet: RayFleet, index: int, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to endpoint ``index``'s process (on this machine); return its pid.

    For tests and drills: this is what a crash, an OOM kill or a segfault looks like."""
    pid = fleet.info(index).pid
    os.kill(pid, sig)
    return pid
