"""``serve_env``: the lane engine and the gRPC transport under one nursery.

Lifecycle (DESIGN.md, "Shutdown"): bind the socket, start the lanes (every env built, the
contract agreed), start the transport, report :class:`ServerInfo`. At stop: the
transport goes first (GOAWAY, drain, cut), then the lanes are closed (mailboxes closed,
``env.close()`` on each lane's thread, stuck lanes abandoned), every wait bounded.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import trio

from ._address import DEFAULT_ADDRESS, Listener, bind, parse_address
from ._lanes import LaneEngine
from ._options import DEFAULT_CLOSE_TIMEOUT, WORKFLOW_EDITION, ServeOptions
from ._service import TransportService
from ._session import Endpoint

log = logging.getLogger("rlmesh_trio.serve")

LANES_STOP_SLACK = 1.0
"""Seconds beyond ``close_timeout_seconds`` the lane engine may take to return at stop
(it enforces ``close_timeout_seconds`` itself; this is only a backstop)."""


@dataclass(frozen=True)
class ServerInfo:
    """What ``task_status.started()`` of :func:`serve_env` delivers."""

    address: str
    """The resolved address in rlmesh form: ``tcp://127.0.0.1:45678`` or ``unix:///path``."""
    num_envs: int
    """How many lanes (envs) the endpoint serves."""
    env_id: str
    """The served env's id (``env.spec.id``, or ``UnknownEnv-v1``)."""


async def serve_env(
    make_env: str | Callable[..., gym.Env[Any, Any]],
    *,
    num_envs: int = 1,
    address: str = DEFAULT_ADDRESS,
    options: ServeOptions | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    task_status: trio.TaskStatus[ServerInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
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

    It returns when the server stopped by itself: a Shutdown RPC was accepted
    (``allow_remote_shutdown``) or the idle timeout expired. A failure of the transport
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
    ``serve_env`` returns at most ``drain_timeout_seconds + close_timeout_seconds + 6 s``
    after the stop began (the constant covers the GOAWAY gap, cutting connections,
    unwinding handlers, closing the transport loop and scheduling), usually far sooner.
    """
    options = ServeOptions() if options is None else options
    if not isinstance(options, ServeOptions):
        raise TypeError(f"options must be a ServeOptions, got {type(options).__name__}")
    close_timeout = _check_options(options)
    parsed = parse_address(address)
    factory = LaneEngine.factory(make_env, **dict(env_kwargs or {}))
    engine = LaneEngine(
        factory, num_envs, policy=options.resolved_policy(), teardown_timeout=close_timeout
    )
    listener = bind(parsed)
    try:
        await _serve(engine, listener, options, close_timeout, task_status)
    finally:
        listener.cleanup()


def _check_options(options: ServeOptions) -> float:
    """Validate the options up front (before any env is built); return the close timeout."""
    for name in ("drain_timeout_seconds", "close_timeout_seconds"):
        value = getattr(options, name)
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value < math.inf):
            raise ValueError(f"{name} must be a finite number >= 0 or None, got {value!r}")
    idle = options.idle_timeout_seconds
    if idle is not None and not (isinstance(idle, (int, float)) and 0 < idle < math.inf):
        raise ValueError(f"idle_timeout_seconds must be a finite number > 0 or None, got {idle!r}")
    if not isinstance(options.max_message_bytes, int) or options.max_message_bytes < 1:
        raise ValueError(
            f"max_message_bytes must be an int >= 1, got {options.max_message_bytes!r}"
        )
    if options.validation_policy not in (None, "warn", "strict", "off"):
        raise ValueError(
            f"validation_policy must be 'warn', 'strict', 'off' or None, "
            f"got {options.validation_policy!r}"
        )
    edition = options.workflow_edition or WORKFLOW_EDITION
    if edition != WORKFLOW_EDITION:
        raise ValueError(
            f"workflow edition {edition!r} is not implemented (implements [{WORKFLOW_EDITION!r}])"
        )
    close = options.close_timeout_seconds
    return DEFAULT_CLOSE_TIMEOUT if close is None else float(close)


async def _serve(
    engine: LaneEngine,
    listener: Listener,
    options: ServeOptions,
    close_timeout: float,
    task_status: trio.TaskStatus[ServerInfo],
) -> None:
    failures: list[Exception] = []
    startup_error: Exception | None = None
    async with trio.open_nursery() as nursery:
        # Not shielded while the envs are being built (a cancel then tears the lanes
        # down); shielded once serving, so that the lanes keep answering during the
        # transport's drain. They are then stopped by close() with a deadline.
        lanes_scope = trio.CancelScope()
        try:
            await nursery.start(_run_lanes, engine, lanes_scope)
            lanes_scope.shield = True
            endpoint = Endpoint(
                engine.contract,
                engine.num_envs,
                policy=engine.policy,
                workflow_edition=options.workflow_edition,
                allow_remote_shutdown=options.remote_shutdown_allowed(),
            )
            service = TransportService(
                endpoint,
                post=engine.post,
                listener=listener.sock,
                options=options,
                # Once the drain is over the lanes start closing: a request still in
                # flight finishes (and is answered) while they do.
                on_drained=engine.close,
            )
            await nursery.start(
                _run_transport, service, engine, lanes_scope, close_timeout, failures
            )
        except Exception as exc:
            # Raised plainly after the nursery has wound down, not as an ExceptionGroup.
            startup_error = exc
            _stop_lanes(engine, lanes_scope, close_timeout)
        except BaseException:
            _stop_lanes(engine, lanes_scope, close_timeout)
            raise
        else:
            info = ServerInfo(
                address=str(listener.address),
                num_envs=engine.num_envs,
                env_id=engine.contract.env_id,
            )
            log.info("serving %s x%d lanes on %s", info.env_id, info.num_envs, info.address)
            task_status.started(info)
    if startup_error is not None:
        raise startup_error
    if failures:
        raise failures[0]


async def _run_lanes(
    engine: LaneEngine,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[LaneEngine] = trio.TASK_STATUS_IGNORED,
) -> None:
    with scope:
        await engine.run(task_status=task_status)


def _stop_lanes(engine: LaneEngine, scope: trio.CancelScope, close_timeout: float) -> None:
    """Close the mailboxes; the engine tears down within ``close_timeout`` on its own."""
    engine.close()
    scope.deadline = min(scope.deadline, trio.current_time() + close_timeout + LANES_STOP_SLACK)


async def _run_transport(
    service: TransportService,
    engine: LaneEngine,
    lanes_scope: trio.CancelScope,
    close_timeout: float,
    failures: list[Exception],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        await service.run(task_status=task_status)
    except Exception as exc:
        if not service.listening:
            raise  # a startup failure: raised at nursery.start
        log.error("the transport failed: %r", exc)
        failures.append(exc)
    finally:
        # The transport has stopped (or was abandoned): now the lanes.
        _stop_lanes(engine, lanes_scope, close_timeout)
    log.info("server stopped: %s", service.stop_reason)
