"""``serve_env``: the lane engine and the gRPC transport under one nursery.

Lifecycle (DESIGN.md, "Shutdown"): bind the socket, start the lanes (every env built, the
contract agreed), start the transport, report :class:`ServerInfo`. At stop: the
transport goes first (GOAWAY, drain, cut), then the lanes are closed (mailboxes closed,
``env.close()`` on each lane's thread, stuck lanes abandoned), every wait bounded.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import trio

from ._address import (
    DEFAULT_ADDRESS,
    Address,
    Listener,
    UnixAddress,
    bind,
    endpoint_addresses,
    is_loopback,
    parse_address,
)
from ._lanes import LaneEngine
from ._metrics import ServerMetrics, start_http
from ._options import STOP_SLACK, Resolved, ServeOptions, resolve
from ._record._served import ServedRecording, served_recording
from ._session import Endpoint, Session
from ._transport import TransportService, Wiring

log = logging.getLogger("rlmesh_trio.serve")


@dataclass(frozen=True)
class ServerInfo:
    """What ``task_status.started()`` of :func:`serve_env` delivers."""

    address: str
    """The resolved address in rlmesh form: ``tcp://127.0.0.1:45678`` or ``unix:///path``."""
    num_envs: int
    """How many lanes (envs) the endpoint serves."""
    env_id: str
    """The served env's id (``env.spec.id``, or ``UnknownEnv-v1``)."""
    metrics_address: str | None = None
    """Where Prometheus metrics are served (``tcp://host:port``), when asked for."""
    tls: bool = False
    """The endpoint serves TLS: clients connect to ``address`` with ``tls=...``."""
    mtls: bool = False
    """Clients must present a certificate signed by the configured client CA."""
    addresses: tuple[str, ...] = ()
    """Every endpoint's address, in order (``serve_env(..., endpoints=K)``); one
    endpoint: ``(address,)``."""
    metrics_addresses: tuple[str, ...] = ()
    """Every endpoint's metrics address, in order (when asked for)."""

    def __post_init__(self) -> None:
        if not self.addresses:
            object.__setattr__(self, "addresses", (self.address,))
        if not self.metrics_addresses and self.metrics_address is not None:
            object.__setattr__(self, "metrics_addresses", (self.metrics_address,))


async def serve_env(
    make_env: str | Callable[..., gym.Env[Any, Any]],
    *,
    num_envs: int = 1,
    address: str = DEFAULT_ADDRESS,
    options: ServeOptions | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    endpoints: int = 1,
    task_status: trio.TaskStatus[ServerInfo] = trio.TASK_STATUS_IGNORED,
) -> str:
    """Serve ``num_envs`` copies of a gymnasium env as the lanes of one rlmesh endpoint.

    ``make_env`` is a gymnasium id (``gym.make(make_env, **env_kwargs)``) or a callable
    (``make_env(**env_kwargs)``); each lane calls it once, on its own thread. ``address``
    takes every form rlmesh accepts (``tcp://host:port``, ``host:port``, ``port``,
    ``unix:///path``; port 0 picks a free port).

    Start it with ``info = await nursery.start(serve_env, ...)``:
    ``task_status.started(info)`` (a :class:`ServerInfo` carrying the resolved address)
    happens only once every lane has built its env, the lanes agree on the env contract
    and the socket is listening and served. Startup failures are raised there, as the
    plain exception: ``ValueError``/``TypeError`` for bad arguments or options (before
    anything is built), ``OSError`` when the address cannot be bound (e.g. in use; before
    any env is built), the env factory's own exception (e.g. ``gymnasium.error.Error`` for
    an unknown id), :class:`~rlmesh_trio.ContractMismatchError`, or a codec error for a
    space rlmesh-wire-v1 cannot express.

    ``endpoints=K`` serves K independent endpoints of ``num_envs`` lanes each, in this
    one Trio tree: each has its own socket, Join session, health, shutdown, idle timeout
    and metrics, and is a plain rlmesh-wire-v1 endpoint (K sessions at once: one client
    each). From ``tcp://host:PORT`` they take the K consecutive ports PORT..PORT+K-1
    (port 0: K free ports), from ``unix:///dir/name.sock`` the sockets
    ``/dir/name-0.sock`` ... ``name-{K-1}.sock``; a metrics address likewise. Every
    socket is bound before any env is built. :class:`ServerInfo` lists them all in
    ``addresses``, ``address`` is the first. It returns once every endpoint stopped.
    Recording serves one endpoint per process (``ValueError`` with ``endpoints > 1``).

    It returns when the server stopped by itself -- a Shutdown RPC was accepted
    (``allow_remote_shutdown``) or the idle timeout expired -- with the reason, e.g.
    ``"remote shutdown accepted"`` or ``"idle for 30 s"``. A failure of the transport
    after startup is raised when the server has stopped.

    Cancellation (of the caller's scope), an accepted Shutdown RPC and the idle timeout
    all stop in phases: close the listener and send GOAWAY; serve the open streams as
    usual until they end, for at most ``drain_timeout_seconds`` (default 5 s; skipped
    for the idle timeout, which by definition has nothing in flight); then read no more
    requests and close the lanes -- each lane finishes its current env call (a request
    still in flight gets its reply) and runs ``env.close()`` on its own thread, all under
    one deadline of ``close_timeout_seconds`` (default 5 s); a lane still stuck then (a
    wedged env) is abandoned: its daemon thread is named in a warning and never blocks
    process exit; finally cut the connections (clients see UNAVAILABLE). So
    ``serve_env`` returns at most ``drain_timeout_seconds + close_timeout_seconds + 1 s``
    after the stop began (:func:`rlmesh_trio._options.stop_bound`; the second covers the
    GOAWAY gap, cutting connections, unwinding handlers and closing the transport loop),
    usually far sooner. The bound is enforced: a part that overruns it is abandoned.
    """
    resolved = resolve(ServeOptions() if options is None else options)
    if isinstance(endpoints, bool) or not isinstance(endpoints, int) or endpoints < 1:
        raise ValueError(f"endpoints must be an int >= 1, got {endpoints!r}")
    parsed = parse_address(address)
    if resolved.tls is not None and isinstance(parsed, UnixAddress):
        raise ValueError(
            f"TLS is served on TCP addresses only, not {address!r}: a unix socket is "
            "guarded by its file permissions (serve it without TLS, or TLS on tcp://)"
        )
    if endpoints > 1 and resolved.record is not None:
        raise ValueError(
            f"recording serves one endpoint per process, not endpoints={endpoints}: "
            "record from a server of its own (one serve per recorded endpoint)"
        )
    factory = LaneEngine.factory(make_env, **dict(env_kwargs or {}))
    if endpoints > 1:
        return await _serve_endpoints(factory, num_envs, parsed, resolved, endpoints, task_status)
    recording = None
    if resolved.record is not None:
        recording = served_recording(resolved.record, make_env, env_kwargs, num_envs)
    engine = LaneEngine(factory, num_envs, resolved, recording=recording)
    listener = bind(parsed)
    try:
        reason = await _serve(engine, listener, resolved, task_status)
    except BaseException as exc:
        listener.cleanup()
        if recording is not None:
            # Stopped by a cancellation (a signal, the embedding program): the server did
            # not fail, so a failed recording is raised (in place of the cancellation);
            # after a failure of the server's own, it is logged.
            await _close_recording(recording, failed=not _cancelled(exc))
        raise
    listener.cleanup()
    if recording is not None:
        await _close_recording(recording, failed=False)
    return reason


async def _serve_endpoints(
    factory: Callable[[], gym.Env[Any, Any]],
    num_envs: int,
    parsed: Address,
    resolved: Resolved,
    count: int,
    task_status: trio.TaskStatus[ServerInfo],
) -> str:
    """``count`` endpoints side by side (``serve_env(..., endpoints=count)``): every
    socket bound first, then each endpoint started in turn (its envs built on its own
    lanes); the first failure stops the others and is raised plainly."""
    addresses = endpoint_addresses(parsed, count)
    metrics: list[str | None] = [None] * count
    if resolved.metrics_address is not None:
        metrics = [
            str(a) for a in endpoint_addresses(parse_address(resolved.metrics_address), count)
        ]
    listeners: list[Listener] = []
    try:
        for each in addresses:
            listeners.append(bind(each))
    except BaseException:
        for listener in listeners:
            listener.cleanup()
        raise
    reasons: list[str] = ["stopped"] * count
    failures: list[Exception] = []

    async def one(k: int, *, task_status: trio.TaskStatus[ServerInfo]) -> None:
        options = dataclasses.replace(resolved, metrics_address=metrics[k])
        engine = LaneEngine(factory, num_envs, options)
        try:
            reasons[k] = await _serve(engine, listeners[k], options, task_status)
        except Exception as exc:
            if not failures:
                failures.append(exc)
            raise _Stopped from None
        finally:
            listeners[k].cleanup()

    infos: list[ServerInfo] = []
    try:
        async with trio.open_nursery() as nursery:
            for k in range(count):
                infos.append(await nursery.start(one, k))
            first = infos[0]
            task_status.started(
                dataclasses.replace(
                    first,
                    addresses=tuple(info.address for info in infos),
                    metrics_addresses=tuple(
                        info.metrics_address for info in infos if info.metrics_address
                    ),
                )
            )
    except BaseException as exc:
        for listener in listeners:
            listener.cleanup()
        if failures and _only_stops(exc):
            raise failures[0] from None
        raise
    return "; ".join(f"endpoint {k}: {reason}" for k, reason in enumerate(reasons))


class _Stopped(Exception):
    """An endpoint of several failed: its failure is raised once all have stopped."""


def _only_stops(exc: BaseException) -> bool:
    """``exc`` is made of errors only (no cancellation or interrupt to pass on)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_stops(e) for e in exc.exceptions)
    return isinstance(exc, Exception)


def _cancelled(exc: BaseException) -> bool:
    """``exc`` is a cancellation only (maybe in groups, as nurseries raise it)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_cancelled(inner) for inner in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


RECORD_CLOSE_TIMEOUT = 120.0
"""Seconds the recorders get, after the lanes stopped, to write what is queued (at most
the queues' capacity: 64 episodes, 256 frames). Not part of the stop bound: a normal stop
loses no episode, and that takes as long as writing them takes."""


async def _close_recording(recording: ServedRecording, *, failed: bool) -> None:
    """After the lanes stopped (their open episodes cut and queued): flush and close the
    recorders on a worker thread. Their error is raised, unless the server already
    failed (then it is logged)."""
    with trio.CancelScope(shield=True):
        try:
            await trio.to_thread.run_sync(
                recording.close, RECORD_CLOSE_TIMEOUT, limiter=trio.CapacityLimiter(1)
            )
        except Exception:
            if not failed:
                raise
            log.exception("recording failed")


def compose(engine: LaneEngine, options: Resolved) -> Wiring:
    """The server around started lanes, wired once: endpoint, session factory, metrics.

    ``engine`` has run up to ``task_status.started`` (its contract is agreed). The
    :class:`~rlmesh_trio._transport.Wiring` is handed unchanged to the transport;
    the tests build their servers with this same function (a fake session goes in with
    ``dataclasses.replace``). Metrics are made (not yet served) when ``options`` asks for
    them, and then every session observes what it does.
    """
    metrics = None
    if options.metrics_address is not None:
        metrics = ServerMetrics(engine.num_envs, engine.contract.env_id)
        metrics.watch_lanes(engine.status)
        if engine.recording is not None:
            metrics.watch_recording(engine.recording.counters)
    endpoint = Endpoint(
        engine.contract,
        engine.num_envs,
        policy=engine.policy,
        workflow_edition=options.workflow_edition,
        allow_remote_shutdown=options.allow_remote_shutdown,
        on_lane_fault=options.on_lane_fault,
        close_timeout=options.close_timeout,
        lane_states=lambda: [lane.state for lane in engine.status()],
    )
    return Wiring(
        options=options,
        endpoint=endpoint,
        lanes=engine,
        session_factory=Session if metrics is None else functools.partial(Session, observe=True),
        metrics=metrics,
    )


@dataclass(frozen=True)
class ServeHooks:
    """Where a test reaches into a server it starts exactly as ``serve_env`` does (its
    lanes, stop phases and teardown the production ones), hypercorn-style: nothing is
    built or stopped around :func:`_serve` by the test itself."""

    wiring: Callable[[Wiring], Wiring] = lambda wiring: wiring
    """Given the composed wiring, the one the transport gets (a scripted session goes in
    with ``dataclasses.replace``)."""
    service: Callable[[TransportService], None] = lambda service: None
    """Told the transport service before it starts (its stop reason, its loop)."""


class _StopClock:
    """When the stop began (Trio time), and the one deadline every part of it meets."""

    def __init__(
        self, options: Resolved, engine: LaneEngine, lanes_scope: trio.CancelScope
    ) -> None:
        self.options = options
        self.engine = engine
        self.lanes_scope = lanes_scope
        self.began: float | None = None
        self.transport_done = trio.Event()

    def left(self) -> float:
        """Seconds left of the stop bound (the whole bound before any stop began)."""
        if self.began is None:
            return self.options.stop_bound
        return max(0.0, self.began + self.options.stop_bound - trio.current_time())

    def begin(self) -> None:
        """Trio thread: a stop began (cancellation, Shutdown RPC, idle timeout)."""
        if self.began is None:
            self.began = trio.current_time()
            deadline = self.began + self.options.stop_bound
            # The lanes' own (shielded) teardown and the scope around them both end by then.
            self.engine.limit_teardown(deadline)
            self.lanes_scope.deadline = min(self.lanes_scope.deadline, deadline)


@dataclass
class _TransportEnd:
    """How the transport ended, written once by :func:`_run_transport` as it returns."""

    reason: str = "stopped"
    """Why it stopped (every way out says why, a cancellation too)."""
    failure: Exception | None = None
    """Its failure after startup: raised by :func:`_serve` once everything stopped."""


async def _serve(
    engine: LaneEngine,
    listener: Listener,
    options: Resolved,
    task_status: trio.TaskStatus[ServerInfo],
    *,
    hooks: ServeHooks = ServeHooks(),
) -> str:
    end = _TransportEnd()
    startup_error: Exception | None = None
    async with trio.open_nursery() as nursery:
        # Not shielded while the envs are being built (a cancel then tears the lanes
        # down); shielded once serving, so that the lanes keep answering during the
        # transport's drain. They are then stopped by close() with a deadline.
        lanes_scope = trio.CancelScope()
        clock = _StopClock(options, engine, lanes_scope)
        try:
            await nursery.start(_run_lanes, engine, lanes_scope)
            lanes_scope.shield = True
            wiring = hooks.wiring(compose(engine, options))
            metrics_address = None
            if wiring.metrics is not None and options.metrics_address is not None:
                metrics_address = await nursery.start(
                    _run_metrics, wiring.metrics, options.metrics_address, clock
                )
            service = TransportService(wiring, listener=listener.sock, on_stop_begin=clock.begin)
            hooks.service(service)
            await nursery.start(_run_transport, service, engine, clock, end)
        except Exception as exc:
            # Raised plainly after the nursery has wound down, not as an ExceptionGroup.
            startup_error = exc
            _stop_lanes(engine, clock)
            clock.transport_done.set()  # no transport: the metrics stop too
        except BaseException:
            _stop_lanes(engine, clock)
            clock.transport_done.set()
            raise
        else:
            info = ServerInfo(
                address=str(listener.address),
                num_envs=engine.num_envs,
                env_id=engine.contract.env_id,
                metrics_address=metrics_address,
                tls=options.tls is not None,
                mtls=options.mtls,
            )
            log.info(
                "serving %s x%d lanes on %s%s",
                info.env_id,
                info.num_envs,
                info.address,
                " (mTLS)" if info.mtls else " (TLS)" if info.tls else "",
            )
            anonymous = options.auth_token is None and not options.mtls
            if anonymous and not is_loopback(listener.address):
                log.warning(
                    "serving on %s, beyond loopback, with no auth token: anyone who can "
                    "reach this port can drive the envs. Set --auth-token "
                    "(ServeOptions.auth_token) or mTLS (--tls-client-ca-file), and TLS so "
                    "that neither the token nor the observations cross the network in "
                    "clear (docs/operations.md, 'Running beyond loopback')",
                    info.address,
                )
            task_status.started(info)
    if startup_error is not None:
        raise startup_error
    if end.failure is not None:
        raise end.failure
    return end.reason


async def _run_metrics(
    metrics: ServerMetrics,
    address: str,
    clock: _StopClock,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the metrics over HTTP until the transport has stopped, then stop within
    what is left of the stop bound (the HTTP thread is a daemon: abandoned past it)."""
    server, thread, bound = start_http(metrics, address)
    try:
        task_status.started(bound)
        await clock.transport_done.wait()
    finally:

        def close() -> None:
            server.shutdown()  # wakes serve_forever (it polls every 0.5 s)
            server.server_close()
            thread.join()  # serve_forever has returned: the thread only has to end

        with trio.move_on_after(clock.left(), shield=True):
            limiter = trio.CapacityLimiter(1)  # not the embedding program's default one
            await trio.to_thread.run_sync(close, abandon_on_cancel=True, limiter=limiter)


async def _run_lanes(
    engine: LaneEngine,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[LaneEngine] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await engine.run(task_status=task_status)


def _stop_lanes(engine: LaneEngine, clock: _StopClock) -> None:
    """Close the mailboxes; the engine tears down within ``close_timeout`` on its own,
    and the lanes' scope holds the stop's one deadline as a backstop."""
    engine.close()
    clock.begin()
    if clock.began is not None:
        backstop = trio.current_time() + clock.options.close_timeout + STOP_SLACK
        clock.lanes_scope.deadline = min(clock.lanes_scope.deadline, backstop)


async def _run_transport(
    service: TransportService,
    engine: LaneEngine,
    clock: _StopClock,
    end: _TransportEnd,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        await service.run(task_status=task_status)
    except Exception as exc:
        if not service.listening:
            raise  # a startup failure: raised at nursery.start
        log.error("the transport failed: %r", exc)
        end.failure = exc
    finally:
        # The transport has stopped (or was abandoned): now the lanes (and the metrics).
        _stop_lanes(engine, clock)
        clock.transport_done.set()
        # Every way out says why, a cancellation (a signal, the embedding program) too.
        end.reason = service.stop_reason or "stopped"
        log.info("server stopped: %s", end.reason)
