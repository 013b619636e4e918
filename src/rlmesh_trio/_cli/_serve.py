"""``rlmesh-trio serve``: serve a gymnasium env from the command line.

A drop-in for ``python -m rlmesh._cli.serve_env`` where its flags apply (``--env``,
``--entrypoint``, ``--num-envs``, ``--kwargs-json``, ``--package``, ``--transport``,
``--address``, ``--ready-fd``, ``--workflow-edition``, ``--verbose``), plus the lifecycle
options of :class:`~rlmesh_trio.ServeOptions` and ``--log-level``.

Exit codes: 0 after a stop (first SIGINT/SIGTERM: graceful drain; an accepted Shutdown
RPC; the idle timeout), 1 when the server cannot start or fails, 2 for bad arguments.
A second SIGINT/SIGTERM exits at once with 128 + the signal number.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import trio

from .._address import DEFAULT_ADDRESS, parse_address
from .._crash import CrashWitness
from .._lanes import UNKNOWN_ENV_ID
from .._logging import JsonFormatter
from .._logging import configure as configure_logging
from .._options import (
    DEFAULT_FIRST_REQUEST_TIMEOUT,
    DEFAULT_MAX_ABANDONED_LANES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_GIVEN_UP_LANES,
    EVENT_LOOPS,
    FAULT_POLICIES,
    LANE_ISOLATIONS,
    POLICIES,
    ServeOptions,
)
from .._serve import ServerInfo, serve_env
from ._args import (
    EXIT_INTERRUPTED,
    PROG,
    UsageError,
    add_env_source,
    check_fd,
    fd,
    int_at_least,
    lane_list,
    load_env,
    seconds,
    write_ready_fd,
)
from ._hints import describe

__all__ = ["add_serve_parser", "serve_command"]

log = logging.getLogger("rlmesh_trio.cli")

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_serve_parser(commands: Any) -> None:
    """Register ``serve`` on the ``rlmesh-trio`` subparsers."""
    serve = commands.add_parser(
        "serve",
        help="serve an env as the lanes of one endpoint",
        description="Serve N copies of a gymnasium env as the lanes of one rlmesh endpoint.",
    )
    add_env_source(serve, where="called once per lane")
    serve.add_argument(
        "--num-envs",
        type=int_at_least(1, "--num-envs"),
        default=1,
        metavar="N",
        help="how many envs (lanes) to serve (default: 1)",
    )
    serve.add_argument(
        "--endpoints",
        type=int_at_least(1, "--endpoints"),
        default=1,
        metavar="K",
        help=(
            "serve K independent endpoints of N lanes each (one client each), on K "
            "consecutive ports from --address's port (port 0: K free ports) or unix "
            "sockets NAME-0.sock ... NAME-{K-1}.sock; every address is printed in order "
            "(default: 1)"
        ),
    )
    serve.add_argument(
        "--transport",
        choices=("tcp", "unix"),
        default="tcp",
        help="tcp (default) or unix; with unix, --address is the socket path",
    )
    serve.add_argument(
        "--address",
        help=(
            "tcp: tcp://host:port, host:port or port (default tcp://127.0.0.1:0); "
            "unix: a socket path or unix:///path (default: a private per-user path)"
        ),
    )
    serve.add_argument(
        "--ready-fd",
        type=fd,
        metavar="FD",
        help=(
            "write the bound address and a newline (with --endpoints, every address, one "
            "per line, in order) to this file descriptor, then close it"
        ),
    )
    serve.add_argument(
        "--allow-remote-shutdown",
        action="store_true",
        help="accept the Shutdown RPC (also: RLMESH_ALLOW_REMOTE_SHUTDOWN=1)",
    )
    serve.add_argument(
        "--reflection",
        action="store_true",
        help="serve gRPC server reflection (grpc.reflection.v1 and v1alpha) for tools like "
        "grpcurl; needs the reflection extra (protobuf); under --auth-token it needs the token",
    )
    serve.add_argument(
        "--idle-timeout-seconds",
        type=seconds(minimum_exclusive=True),
        metavar="S",
        help="stop after this long without Join activity (default: never)",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        default=DEFAULT_MAX_CONNECTIONS,
        help="connections served at once; more are closed as they come "
        f"(default: {DEFAULT_MAX_CONNECTIONS})",
    )
    serve.add_argument(
        "--first-request-timeout-seconds",
        type=_seconds_or_never,
        metavar="S",
        default=DEFAULT_FIRST_REQUEST_TIMEOUT,
        help="close a connection that has not begun a call this long after it opened "
        f"(default: {DEFAULT_FIRST_REQUEST_TIMEOUT:g}; 'never': as the reference)",
    )
    serve.add_argument(
        "--drain-timeout-seconds",
        type=seconds(minimum_exclusive=False),
        metavar="S",
        help="at stop, how long open streams may still be served (default: 5)",
    )
    serve.add_argument(
        "--close-timeout-seconds",
        type=seconds(minimum_exclusive=False),
        metavar="S",
        help="at stop, how long the lanes together may take to close their envs (default: 5)",
    )
    serve.add_argument(
        "--on-lane-fault",
        choices=FAULT_POLICIES,
        default="error",
        help="when an env raises or wedges: error (as rlmesh: the env stays as the "
        "exception left it), rebuild (a fresh env from the factory on a fresh thread), "
        "truncate (rebuild, and a failed step answers as a truncation); default error",
    )
    recording = serve.add_argument_group("recording (docs/recording.md; needs the record extra)")
    recording.add_argument(
        "--record-dataset",
        metavar="DATASET_ID",
        help="write every episode of every lane into this Minari dataset (under "
        "MINARI_DATASETS_PATH, else Minari's default root; it must not exist yet, unless "
        "--record-append)",
    )
    recording.add_argument(
        "--record-append",
        action="store_true",
        help="continue the dataset if it exists (a restarted endpoint keeps one dataset): "
        "its env and spaces must be the ones served; its episodes are never rewritten",
    )
    recording.add_argument(
        "--record-drop-faulted",
        action="store_true",
        help="drop the episodes the server cut (lane fault, reset mid-episode, stop) "
        "instead of recording them truncated",
    )
    recording.add_argument(
        "--record-infos",
        action="store_true",
        help="record the infos too (an episode whose info structure varies keeps its "
        "data, not its infos)",
    )
    recording.add_argument(
        "--record-video",
        metavar="DIR",
        help="write one video per recorded episode into DIR (the env must render "
        'rgb_array: --kwargs-json \'{"render_mode": "rgb_array"}\')',
    )
    recording.add_argument(
        "--record-video-lanes",
        type=lane_list,
        metavar="LANES",
        help="the lanes recorded to video, e.g. 0,3 (default: all)",
    )
    recording.add_argument(
        "--record-video-every",
        type=int_at_least(1, "--record-video-every"),
        default=1,
        metavar="K",
        help="record every K-th episode of each video lane (default: 1, every one)",
    )
    serve.add_argument(
        "--lane-isolation",
        choices=LANE_ISOLATIONS,
        default="thread",
        help="where each lane's env lives: a thread of the server (default), or a child "
        "process of its own (a segfault or a GIL-holding env costs the other lanes "
        "nothing; pure-Python envs use every core)",
    )
    serve.add_argument(
        "--lane-timeout-seconds",
        type=seconds(minimum_exclusive=True),
        metavar="S",
        help="a lane job running longer is wedged: answered TIMEOUT (with rebuild/truncate "
        "its thread is abandoned and the lane rebuilt); default: none",
    )
    serve.add_argument(
        "--max-abandoned-lanes",
        type=int_at_least(0),
        metavar="N",
        default=DEFAULT_MAX_ABANDONED_LANES,
        help="abandoned (wedged) lane threads tolerated before health reports NOT_SERVING "
        f"(default: {DEFAULT_MAX_ABANDONED_LANES})",
    )
    serve.add_argument(
        "--max-given-up-lanes",
        type=int_at_least(0),
        metavar="N",
        default=DEFAULT_MAX_GIVEN_UP_LANES,
        help="lanes given up for good (dead, never rebuilt again: too many abandoned "
        "threads, a process lane lost under --on-lane-fault error) tolerated before health "
        "reports NOT_SERVING (default: 0, the first one: whole-vector requests fail from "
        "then on); for lane-scoped clients that can live with lost lanes, --num-envs "
        "leaves health to --min-serving-lanes",
    )
    serve.add_argument(
        "--min-serving-lanes",
        type=int_at_least(1),
        metavar="N",
        default=1,
        help="health reports NOT_SERVING while fewer lanes than N can serve (dead or "
        "wedged lanes cannot, for good or for a while; at most --num-envs; default: 1)",
    )
    serve.add_argument(
        "--auth-token",
        metavar="TOKEN",
        help="require 'authorization: Bearer TOKEN' on every call but the health check "
        "(also: RLMESH_TRIO_AUTH_TOKEN, which keeps it off the command line); never logged",
    )
    serve.add_argument(
        "--tls-cert-file",
        metavar="FILE",
        help="serve TLS with this certificate chain (PEM; with --tls-key-file; TCP only)",
    )
    serve.add_argument(
        "--tls-key-file", metavar="FILE", help="the private key of --tls-cert-file (PEM)"
    )
    serve.add_argument(
        "--tls-client-ca-file",
        metavar="FILE",
        help="mTLS: refuse, in the TLS handshake, every client without a certificate "
        "signed by this CA (PEM)",
    )
    serve.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="the transport's event loop (default auto: uvloop where installed, as on "
        "Linux and macOS; else asyncio's selector loop)",
    )
    serve.add_argument(
        "--metrics-address",
        metavar="ADDR",
        help="serve Prometheus metrics over HTTP at tcp://host:port (default: off; "
        "loopback unless given otherwise; needs the metrics extra)",
    )
    serve.add_argument(
        "--workflow-edition",
        metavar="EDITION",
        help="the workflow edition the endpoint declares (default: RLMESH_WORKFLOW_EDITION, "
        "else 2026.06, the only one)",
    )
    serve.add_argument(
        "--validation-policy",
        choices=POLICIES,
        help="conformance checks (default: RLMESH_VALIDATION_POLICY, else warn)",
    )
    serve.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="logging level (default: warning); debug also turns on the debug logs of "
        "the libraries underneath (h2, hpack, grpclib, asyncio)",
    )
    serve.add_argument(
        "--verbose",
        action="store_true",
        help="rlmesh-trio's own debug logs, with tracebacks (other libraries stay at warning)",
    )
    serve.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text (default) or json: one JSON object per line, for log shippers",
    )


EXIT_RECORDING_FAILED = 3
"""The exit code when a recorder lost data (the server served on, and stopped)."""


def _recording_failure(exc: BaseException) -> BaseException | None:
    """The recorder's failure in what ``trio.run`` raised (maybe inside groups)."""
    from .._record._worker import RecordingError

    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _recording_failure(inner)
            if found is not None:
                return found
        return None
    return exc if isinstance(exc, RecordingError) else None


def serve_command(args: argparse.Namespace) -> int:
    """Run ``rlmesh-trio serve`` until it stops; return the exit code."""
    debug = args.verbose or args.log_level == "debug"
    configure_logging(
        "debug" if debug else args.log_level,
        fmt=args.log_format,
        everything=args.log_level == "debug",
    )
    try:
        address, source = _resolve_address(args)
        if args.ready_fd is not None:
            check_fd(args.ready_fd)
    except UsageError as exc:
        print(f"{PROG} serve: error: {exc} (see '{PROG} serve --help')", file=sys.stderr)
        return 2
    if source is not None:
        print(f"{PROG}: binding {address} (from {source})", file=sys.stderr, flush=True)
    try:
        config = _configure(args, address)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted while starting", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        return _fail("cannot load the environment", exc, debug)
    witness = CrashWitness(PROG, args.lane_isolation)  # a native crash is not silent
    try:
        return trio.run(_run, config, witness)
    except KeyboardInterrupt:
        # Ctrl-C before the signal watcher is up (the envs still being built): stop as
        # a shell expects, with no traceback.
        print(f"{PROG}: interrupted while starting", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        lost = _recording_failure(exc)
        if lost is not None:
            if debug:
                log.error("the recording failed", exc_info=lost)
            print(
                f"{PROG}: error: the recording failed (what was not yet written is lost): "
                f"{describe(lost)}",
                file=sys.stderr,
            )
            return EXIT_RECORDING_FAILED
        return _fail("cannot serve", exc, debug)
    finally:
        witness.dismiss()


@dataclass(frozen=True)
class _Config:
    make_env: str | Callable[..., Any]
    label: str
    num_envs: int
    kwargs: dict[str, Any]
    address: str
    endpoints: int
    options: ServeOptions
    ready_fd: int | None
    log_format: str = "text"


def _say(config: _Config, message: str) -> None:
    """One status line on stderr: ``rlmesh-trio: ...``, or a JSON log line in json mode."""
    if config.log_format == "json":
        record = logging.LogRecord("rlmesh_trio.cli", logging.INFO, "", 0, message, None, None)
        print(JsonFormatter().format(record), file=sys.stderr, flush=True)
    else:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _fail(what: str, exc: BaseException, debug: bool) -> int:
    if debug:
        log.exception("%s", what)
    print(f"{PROG}: error: {what}: {describe(exc)}", file=sys.stderr)
    return 1


def _seconds_or_never(value: str) -> float | None:
    """An argparse type: seconds > 0, or ``never`` (None)."""
    if value.strip().lower() == "never":
        return None
    return seconds(minimum_exclusive=True)(value)


ADDRESS_ENV = "RLMESH_ADDRESS"
"""rlmesh's container bind contract: a full bind address (``host:port``, ``port``,
``tcp://host:port``, ``unix:///path``), used when ``--address`` is not given."""

PORT_ENV = "RLMESH_PORT"
"""rlmesh's container bind contract: a TCP port on all interfaces (``0.0.0.0:PORT``), used
when neither ``--address`` nor ``RLMESH_ADDRESS`` is given."""


def _bind_from_environment(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(address, where it came from)`` by rlmesh 0.1.0's rule when ``--address`` is not
    given: ``RLMESH_ADDRESS`` if set and not empty, else ``RLMESH_PORT`` (TCP) as
    ``0.0.0.0:PORT``; ``(None, None)`` when neither is set."""
    if args.address is not None:
        return None, None
    address = os.environ.get(ADDRESS_ENV, "").strip()
    if address:
        return address, ADDRESS_ENV
    port = os.environ.get(PORT_ENV, "").strip()
    if port and args.transport == "tcp":
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            raise UsageError(f"{PORT_ENV}={port!r} is not a TCP port (0-65535)")
        return f"0.0.0.0:{int(port)}", PORT_ENV
    return None, None


def _resolve_address(args: argparse.Namespace) -> tuple[str, str | None]:
    """The address to bind, and the environment variable it came from (None: the
    command line or the default)."""
    address: str | None = args.address
    source: str | None = None
    if address is None:
        address, source = _bind_from_environment(args)
    if args.transport == "unix":
        if os.name == "nt":
            raise UsageError("unix sockets are not supported on Windows; use --transport tcp")
        if address is None:
            address = "unix://" + _default_unix_path(args.env or args.entrypoint)
        elif "://" not in address:
            address = "unix://" + address
        elif not address.startswith("unix://"):
            raise UsageError(f"--transport unix needs a socket path, got {address!r}")
    elif address is None:
        address = DEFAULT_ADDRESS
    try:
        parse_address(address)
    except ValueError as exc:
        where = f" (from {source})" if source is not None else ""
        raise UsageError(f"{exc}{where}") from None
    return address, source


def _default_unix_path(source: str) -> str:
    """A per-user private socket path (not a guessable name in a shared /tmp)."""
    label = re.sub(r"[^a-z0-9_-]+", "_", source.lower()).strip("_") or "env"
    filename = f"rlmesh-trio-{label}.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        base = os.path.join(runtime, "rlmesh-trio")
        try:
            os.makedirs(base, mode=0o700, exist_ok=True)
        except OSError:
            pass
        else:
            return os.path.join(base, filename)
    private = tempfile.mkdtemp(prefix="rlmesh-trio-")
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    return os.path.join(private, filename)


def _configure(args: argparse.Namespace, address: str) -> _Config:
    make_env = load_env(args, in_other_processes=args.lane_isolation == "process")
    label = args.env if args.env is not None else args.entrypoint
    edition = args.workflow_edition or os.environ.get("RLMESH_WORKFLOW_EDITION") or None
    options = ServeOptions(
        allow_remote_shutdown=args.allow_remote_shutdown,
        idle_timeout_seconds=args.idle_timeout_seconds,
        max_connections=args.max_connections,
        first_request_timeout_seconds=args.first_request_timeout_seconds,
        drain_timeout_seconds=args.drain_timeout_seconds,
        close_timeout_seconds=args.close_timeout_seconds,
        workflow_edition=edition,
        validation_policy=args.validation_policy,
        auth_token=args.auth_token,
        metrics_address=args.metrics_address,
        event_loop=args.event_loop,
        on_lane_fault=args.on_lane_fault,
        lane_timeout_seconds=args.lane_timeout_seconds,
        max_abandoned_lanes=args.max_abandoned_lanes,
        min_serving_lanes=args.min_serving_lanes,
        max_given_up_lanes=args.max_given_up_lanes,
        lane_isolation=args.lane_isolation,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        tls_client_ca_file=args.tls_client_ca_file,
        reflection=args.reflection,
        record_dataset=args.record_dataset,
        record_append=args.record_append,
        record_drop_faulted=args.record_drop_faulted,
        record_infos=args.record_infos,
        record_video=args.record_video,
        record_video_lanes=args.record_video_lanes or None,
        record_video_every=args.record_video_every,
    )
    return _Config(
        make_env=make_env,
        label=label,
        num_envs=args.num_envs,
        kwargs=dict(args.kwargs_json or {}),
        address=address,
        endpoints=args.endpoints,
        options=options,
        ready_fd=args.ready_fd,
        log_format=args.log_format,
    )


async def _run(config: _Config, witness: CrashWitness) -> int:
    """Serve until stopped; first signal: graceful stop, second: exit at once."""
    startup_error: Exception | None = None
    status = 0
    stopped: list[str] = []

    async def serve(*, task_status: trio.TaskStatus[ServerInfo]) -> None:
        reason = await serve_env(
            config.make_env,
            num_envs=config.num_envs,
            address=config.address,
            options=config.options,
            env_kwargs=config.kwargs,
            endpoints=config.endpoints,
            task_status=task_status,
        )
        stopped.append(reason)

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as serving:
                outer.start_soon(
                    _watch_signals, signals, serving.cancel_scope, config, stopped, witness
                )
                try:
                    info: ServerInfo = await serving.start(serve)
                except Exception as exc:
                    startup_error = exc
                else:
                    lanes = "lane" if info.num_envs == 1 else "lanes"
                    name = info.env_id
                    if name == UNKNOWN_ENV_ID:  # no gymnasium spec: name what was served
                        name = f"{config.label} (no env spec, served as {UNKNOWN_ENV_ID})"
                    secure = " (mTLS)" if info.mtls else " (TLS)" if info.tls else ""
                    count = len(info.addresses)
                    for k, each in enumerate(info.addresses):
                        which = f" (endpoint {k} of {count})" if count > 1 else ""
                        _say(
                            config,
                            f"serving {name} x{info.num_envs} {lanes} on {each}{secure}{which}",
                        )
                    for each in info.metrics_addresses:
                        _say(config, f"metrics on http{each[3:]}/metrics")
                    if count > 1:
                        # What a client made by id reads (RLMESH_TRIO_ADDRESS): copy it.
                        _say(config, f"RLMESH_TRIO_ADDRESS={','.join(info.addresses)}")
                    if config.ready_fd is not None:
                        try:
                            write_ready_fd(config.ready_fd, list(info.addresses))
                        except OSError as exc:
                            print(
                                f"{PROG}: error: cannot write to --ready-fd {config.ready_fd}: "
                                f"{exc.strerror}",
                                file=sys.stderr,
                            )
                            status = 1
                            serving.cancel_scope.cancel()
            outer.cancel_scope.cancel()  # the server stopped: stop watching signals
    if startup_error is not None:
        raise startup_error
    if stopped:  # every way it stopped says why: by itself, or on a signal
        _say(config, f"stopped: {stopped[0]}")
    return status


async def _watch_signals(
    signals: AsyncIterator[int],
    serving: trio.CancelScope,
    config: _Config,
    stopped: list[str],
    witness: CrashWitness,
) -> None:
    count = 0
    async for signum in signals:
        count += 1
        name = signal.Signals(signum).name
        if count == 1:
            _say(config, f"{name}: draining and stopping")
            stopped.append(name)  # said once the drain is over: "stopped: SIGTERM"
            serving.cancel()
        else:
            _say(config, f"second {name}: exiting now")
            sys.stdout.flush()
            witness.dismiss()  # an exit asked for, not a crash: the witness says nothing
            os._exit(128 + signum)
