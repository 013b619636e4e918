"""``launch``: K endpoints of N lanes as Ray actors in a placement group, supervised.

Also what a program around a fleet needs from Ray: :func:`resolve_bind` (the host
``launch(bind=...)`` binds, decided before launching), :func:`ray_output_to_stderr`
(keep a machine-readable stdout clean of Ray's lines) and :func:`kill_process` (drills).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import secrets
import signal
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, TextIO

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..._address import is_loopback_host, parse_address
from ..._deprecation import renamed_kwargs
from ..._options import ServeOptions, tls_files
from ..._tls import TlsSetting
from ._actor import ActorConfig, EndpointActor, EndpointInfo, TlsPem
from ._supervisor import RayFleet

log = logging.getLogger("rlmesh_trio.fleet.ray")

PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
LOOPBACK = "127.0.0.1"


def _cluster_is_local() -> bool:
    """Every live node of the connected Ray cluster is this machine (a local Ray, or a
    single-node cluster started here); never under Ray Client (``ray://``)."""
    with contextlib.suppress(Exception):
        if ray.util.client.ray.is_connected():  # type: ignore[no-untyped-call,unused-ignore]
            return False
    here: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call,unused-ignore]
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call,unused-ignore]
    return bool(nodes) and all(n.get("NodeManagerAddress") == here for n in nodes)


def resolve_bind(bind: str = "auto") -> str:
    """The host ``launch(bind=bind)`` binds its endpoints to, on the connected Ray.

    ``"auto"``: ``"127.0.0.1"`` when the cluster is local to this machine (every node is
    this host), else ``"node"``; ``"node"``: each node's IP address as Ray reports it
    (returned as ``"node"``); anything else is a host to bind, returned as given
    (``ValueError`` when it is not one). Ray must be initialized for ``"auto"``.
    """
    if not isinstance(bind, str) or not bind:
        raise ValueError(f"bind must be 'auto', 'node' or a host, got {bind!r}")
    if bind == "auto":
        return LOOPBACK if _cluster_is_local() else "node"
    if bind != "node":
        parse_address(f"{bind}:1")  # a host we can bind: raises ValueError otherwise
    return bind


@contextlib.contextmanager
def ray_output_to_stderr() -> Iterator[TextIO]:
    """Keep stdout for machine-readable output while Ray runs in this process.

    Ray's driver prints the cluster's messages (``(raylet) A worker died ...``) and the
    workers' relayed stdout (``(pid=...)`` lines) to ``sys.stdout``. Inside this block
    ``sys.stdout`` is ``sys.stderr``, so those lines (and any stray ``print``) reach the
    user on stderr; the stream yielded writes to the real stdout. (The endpoints'
    own output already goes to their stderr, which Ray relays to the driver's stderr.)
    """
    real = sys.stdout
    sys.stdout = sys.stderr
    try:
        yield real if real is not None else io.StringIO()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        sys.stdout = real


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


@renamed_kwargs(
    lanes="num_envs",
    health_period_s="health_period_seconds",
    health_timeout_s="health_timeout_seconds",
    ready_timeout_s="ready_timeout_seconds",
    stop_timeout_s="stop_timeout_seconds",
)
def launch(
    env: str | Callable[..., Any],
    *,
    endpoints: int,
    num_envs: int,
    env_kwargs: Mapping[str, Any] | None = None,
    resources: Mapping[str, float] | None = None,
    placement: str = "SPREAD",
    max_restarts: int = 3,
    health_period_seconds: float = 5.0,
    health_timeout_seconds: float = 2.0,
    unhealthy_after: int = 3,
    pin_ports: bool = True,
    bind: str = "auto",
    auth_token: str | None = None,
    require_auth: bool | None = None,
    tls: TlsSetting = None,
    tls_cert_file: str | os.PathLike[str] | None = None,
    tls_key_file: str | os.PathLike[str] | None = None,
    tls_client_ca_file: str | os.PathLike[str] | None = None,
    niceness: int | None = 0,
    options: ServeOptions | None = None,
    runtime_env: Mapping[str, Any] | None = None,
    ready_timeout_seconds: float = 120.0,
    stop_timeout_seconds: float = 15.0,
) -> RayFleet:
    """Launch ``endpoints`` endpoints of ``num_envs`` lanes each as Ray actors; return the fleet.

    ``env`` is what :func:`rlmesh_trio.serve_env` takes: a gymnasium id, or a factory
    (pickled to the workers; ``env_kwargs`` are passed to it). Ray must be initialized
    (``ray.init(...)``) -- or ``launch`` starts a local Ray with its defaults. (The
    0.1 names ``lanes=`` and ``*_s=`` still work, with a ``DeprecationWarning``.)

    * Placement: a placement group of one bundle of ``resources`` per endpoint
      (default ``{"CPU": 1}``; keys ``CPU``, ``GPU``, ``memory`` and custom resources),
      with ``placement`` one of ``PACK``, ``SPREAD`` (default), ``STRICT_PACK``,
      ``STRICT_SPREAD``.
    * Restarts: Ray restarts a dead endpoint process up to ``max_restarts`` times
      (-1: forever; 0: never). The supervisor (a driver thread) probes every endpoint
      every ``health_period_seconds`` (grpc.health.v1 Check and a Handshake, within
      ``health_timeout_seconds``) and kills one that failed ``unhealthy_after`` probes
      in a row, so Ray restarts it; a restarted endpoint gets ``ready_timeout_seconds`` to serve
      before it can be killed again. An endpoint out of restarts is ``dead``.
    * Addresses: with ``pin_ports`` an endpoint restarted on the same node comes back
      on the same port (when it is still free); the fleet's ``addresses`` follow every
      restart either way.
    * ``bind``: ``"auto"`` (default) binds loopback (``127.0.0.1``) when the Ray
      cluster is local to this machine (every node is this host: the local Ray
      ``launch`` started, or a one-machine ``ray start``) and each node's IP address
      otherwise; ``"node"`` always the node's IP
      address, as Ray reports it; or a host to bind (``"127.0.0.1"``, ``"0.0.0.0"``).
      :func:`resolve_bind` says beforehand which it will be.
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
    ``TimeoutError`` after ``ready_timeout_seconds``, or the first endpoint's startup error
    (after removing what was launched).
    """
    bundle = _check_arguments(
        endpoints=endpoints,
        num_envs=num_envs,
        resources=resources,
        placement=placement,
        max_restarts=max_restarts,
        unhealthy_after=unhealthy_after,
        seconds={
            "health_period_seconds": health_period_seconds,
            "health_timeout_seconds": health_timeout_seconds,
            "ready_timeout_seconds": ready_timeout_seconds,
            "stop_timeout_seconds": stop_timeout_seconds,
        },
        niceness=niceness,
    )
    if bind not in ("auto", "node"):
        resolve_bind(bind)  # checked before Ray is started
    if not ray.is_initialized():
        ray.init()  # a new local Ray, or the cluster RAY_ADDRESS / `ray start` names
    bind = resolve_bind(bind)
    token = _token(bind, auth_token, require_auth)
    serve_options = options or ServeOptions()
    if token is not None:
        serve_options = replace(serve_options, auth_token=token)
    tls_pem = _tls_pem(serve_options, tls, tls_cert_file, tls_key_file, tls_client_ca_file)
    fleet_id = uuid.uuid4().hex[:12]
    plan = _Plan(
        endpoints=endpoints,
        bundle=bundle,
        placement=placement,
        max_restarts=max_restarts,
        runtime_env=_runtime_env(runtime_env, niceness),
        actor=ActorConfig(
            fleet_id=fleet_id,
            index=0,
            env=env,
            env_kwargs=dict(env_kwargs or {}),
            num_envs=num_envs,
            bind=bind,
            options=serve_options,
            pin_ports=pin_ports,
            ready_timeout_seconds=ready_timeout_seconds,
            tls_pem=tls_pem,
        ),
    )
    pg, actors, infos = _start(plan)
    fleet = RayFleet(
        actors,
        infos,
        pg=pg,
        fleet_id=fleet_id,
        auth_token=token,
        tls=tls,
        health_period_seconds=health_period_seconds,
        health_timeout_seconds=health_timeout_seconds,
        unhealthy_after=unhealthy_after,
        ready_timeout_seconds=ready_timeout_seconds,
        stop_timeout_seconds=stop_timeout_seconds,
    )
    log.info("fleet %s: %d endpoints serving: %s", fleet_id, endpoints, fleet.addresses)
    return fleet


def _check_arguments(
    *,
    endpoints: int,
    num_envs: int,
    resources: Mapping[str, float] | None,
    placement: str,
    max_restarts: int,
    unhealthy_after: int,
    seconds: Mapping[str, float],
    niceness: int | None,
) -> dict[str, float]:
    """``launch``'s arguments checked before Ray is touched; returns the bundle of
    resources each endpoint gets."""
    if not isinstance(endpoints, int) or endpoints < 1:
        raise ValueError(f"endpoints must be an int >= 1, got {endpoints!r}")
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(f"num_envs must be an int >= 1, got {num_envs!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if not isinstance(max_restarts, int) or max_restarts < -1:
        raise ValueError(f"max_restarts must be an int >= -1, got {max_restarts!r}")
    if not isinstance(unhealthy_after, int) or unhealthy_after < 1:
        raise ValueError(f"unhealthy_after must be an int >= 1, got {unhealthy_after!r}")
    for label, value in seconds.items():
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{label} must be a number > 0, got {value!r}")
    if niceness is not None and not -20 <= niceness <= 19:
        raise ValueError(f"niceness must be in -20..19 or None, got {niceness!r}")
    bundle = {"CPU": 1.0} if resources is None else {k: float(v) for k, v in resources.items()}
    if any(v < 0 for v in bundle.values()) or not any(v > 0 for v in bundle.values()):
        raise ValueError(f"resources must be non-negative and not all zero, got {bundle!r}")
    return bundle


def _token(bind: str, auth_token: str | None, require_auth: bool | None) -> str | None:
    """The endpoints' token: beyond loopback (unless ``require_auth`` says otherwise)
    ``auth_token`` or one generated here; else ``auth_token`` as given. The workers'
    ``RLMESH_TRIO_AUTH_TOKEN`` never decides (the actor drops it)."""
    node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call,unused-ignore]
    host = node_ip if bind == "node" else bind
    needs_token = (not is_loopback_host(host)) if require_auth is None else require_auth
    return (auth_token or secrets.token_urlsafe(32)) if needs_token else auth_token


def _runtime_env(runtime_env: Mapping[str, Any] | None, niceness: int | None) -> dict[str, Any]:
    """Ray's runtime env for the actors: the caller's, with the workers' nice value."""
    actor_runtime_env: dict[str, Any] = dict(runtime_env or {})
    if niceness is not None:
        env_vars = dict(actor_runtime_env.get("env_vars") or {})
        env_vars.setdefault("RAY_worker_niceness", str(niceness))
        actor_runtime_env["env_vars"] = env_vars
    return actor_runtime_env


@dataclass(frozen=True)
class _Plan:
    """What ``launch`` decided before placing anything: how many endpoints, each one's
    bundle, the placement, restarts and runtime env, and the actors' config (``actor``:
    endpoint 0's; the others' differ in their ``index`` alone)."""

    endpoints: int
    bundle: dict[str, float]
    placement: str
    max_restarts: int
    runtime_env: dict[str, Any]
    actor: ActorConfig


def _start(plan: _Plan) -> tuple[Any, list[Any], list[EndpointInfo]]:
    """Place the endpoints, start one actor on each bundle, and wait until every one
    serves: the placement group, the actors, what each reports. On any failure what was
    started is killed and the placement group removed before the error goes on."""
    timeout = plan.actor.ready_timeout_seconds
    pg = placement_group(
        [dict(plan.bundle) for _ in range(plan.endpoints)], strategy=plan.placement
    )
    actors: list[Any] = []
    try:
        try:
            ray.get(pg.ready(), timeout=timeout)
        except GetTimeoutError:
            raise TimeoutError(
                f"Ray could not place {plan.endpoints} x {plan.bundle} ({plan.placement}) "
                f"within {timeout} s: not enough resources in the cluster?"
            ) from None
        remote = ray.remote(EndpointActor)
        for index in range(plan.endpoints):
            config = replace(plan.actor, index=index)
            actor = remote.options(
                max_restarts=plan.max_restarts,
                max_task_retries=-1,
                max_concurrency=2,  # info() answers while stop() drains
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                ),
                runtime_env=plan.runtime_env or None,
                **_actor_options(plan.bundle),
            ).remote(config)
            actors.append(actor)
        refs = [a.info.remote() for a in actors]
        try:
            infos: list[EndpointInfo] = ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            raise TimeoutError(
                f"the fleet's endpoints did not all serve within {timeout} s"
            ) from None
        except RayActorError as exc:
            cause = exc.__cause__ or exc
            raise RuntimeError(f"an endpoint failed to start: {_cause_line(cause)}") from exc
    except BaseException:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
        raise
    return pg, actors, infos


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


def _cause_line(exc: BaseException) -> str:
    """``Type: the last line of the message``: an actor's creation error from Ray ends
    with the line that says what went wrong (the lines before are Ray's traceback)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1]}" if text else type(exc).__name__


def kill_process(fleet: RayFleet, index: int, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to endpoint ``index``'s process (on this machine); return its pid.

    For tests and drills: this is what a crash, an OOM kill or a segfault looks like."""
    pid = fleet.info(index).pid
    os.kill(pid, sig)
    return pid
