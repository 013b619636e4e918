"""Server options (the lifecycle knobs of rlmesh's ``ServeOptions``, plus ours)."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import ssl
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from ._credentials import AUTH_TOKEN_ENV
from ._wire._protocol import WORKFLOW_EDITION

Policy = Literal["warn", "strict", "off"]
"""How soft conformance violations are handled (SPEC §3.7.8)."""

POLICIES: tuple[Policy, ...] = get_args(Policy)

EventLoop = Literal["auto", "uvloop", "asyncio"]
"""The transport thread's event loop: uvloop when installed (``auto``), or one of them."""

EVENT_LOOPS: tuple[EventLoop, ...] = get_args(EventLoop)

FaultPolicy = Literal["error", "rebuild", "truncate"]
"""What a lane does when its env raises or wedges (docs/supervision.md)."""

FAULT_POLICIES: tuple[FaultPolicy, ...] = get_args(FaultPolicy)

LaneIsolation = Literal["thread", "process"]
"""Where a lane's env lives: a thread of the server, or a child process of its own."""

LANE_ISOLATIONS: tuple[LaneIsolation, ...] = get_args(LaneIsolation)

DEFAULT_MAX_ABANDONED_LANES = 8
"""Wedged lane threads the process tolerates before health reports NOT_SERVING."""

DEFAULT_MAX_GIVEN_UP_LANES = 0
"""Lanes given up for good the process tolerates before health reports NOT_SERVING."""


MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Per-message size limit, both directions (SPEC §1.8)."""

DEFAULT_MAX_CONNECTIONS = 1024
"""Connections one endpoint serves at once: far above any trainer's or fleet's (a client
holds one or two), well under a process's usual 1,024-4,096 file descriptors shared with
the lanes' pipes and files."""

DEFAULT_FIRST_REQUEST_TIMEOUT = 30.0
"""Seconds a connection may stay open without beginning a call before it is closed: a
client connects to call (rlmesh's clients, probes and fleets call at once); a
connection that never does only holds a socket and memory. The reference keeps such a
connection forever."""

DEFAULT_CLOSE_TIMEOUT = 5.0
"""Seconds the lanes get, together, to close their envs at server stop."""

DEFAULT_DRAIN_TIMEOUT = 5.0
"""Seconds in-flight requests get to finish after a shutdown was requested."""

STOP_SLACK = 1.0
"""Seconds a stop may take beyond drain and close: the GOAWAY gap, cutting the
connections, unwinding the handlers, closing the transport loop (see :func:`stop_bound`)."""


@dataclass(frozen=True)
class ServeOptions:
    """How a server behaves over its lifetime. Every field has the reference's default.

    ``allow_remote_shutdown``: accept the Shutdown RPC (also enabled by the
    environment variable ``RLMESH_ALLOW_REMOTE_SHUTDOWN=1|true``).
    ``idle_timeout_seconds``: stop after this long without Join activity (None: never).
    ``max_connections``: connections served at once (more are closed as they come, a
    warning said); ``first_request_timeout_seconds``: a connection that has not begun a
    call this long after it opened (not even sent the HTTP/2 preface) is closed (None:
    never, as the reference). See docs/operations.md, "Hostile clients".
    ``drain_timeout_seconds``: at stop, how long in-flight requests may still finish.
    ``close_timeout_seconds``: at stop, how long the lanes together may take to close
    their envs; a lane still stuck after that is abandoned (and named in the log).
    ``workflow_edition``: the edition the endpoint declares (only ``"2026.06"`` exists).
    ``validation_policy``: ``warn``/``strict``/``off``; None reads
    ``RLMESH_VALIDATION_POLICY`` from the environment like the reference.
    ``auth_token``: when set, every request but the health check must carry
    ``authorization: Bearer <token>`` (else UNAUTHENTICATED "invalid env token"); None
    reads ``RLMESH_TRIO_AUTH_TOKEN``. Never shown in a repr or a log.
    ``metrics_address``: serve Prometheus metrics over HTTP there (``tcp://host:port``,
    port 0 picks one; needs the ``metrics`` extra); None: no metrics.
    ``event_loop``: the transport thread's loop: ``auto`` (uvloop when installed -- a
    dependency on Linux and macOS CPython -- else asyncio's selector loop), ``uvloop``
    or ``asyncio``.
    ``on_lane_fault``: ``error`` (the reference's behaviour: the faulted env stays as the
    exception left it), ``rebuild`` (the lane gets a fresh env from the factory on a fresh
    thread) or ``truncate`` (as rebuild, and a failed step is answered as a truncation
    carrying ``rlmesh_trio.lane_fault``); see docs/supervision.md.
    ``lane_timeout_seconds``: a lane job running longer is wedged (answered TIMEOUT; in
    ``rebuild``/``truncate`` its thread is abandoned and the lane rebuilt). None: only the
    requests' own ``timeout_ms`` bound a job.
    ``max_abandoned_lanes``: how many abandoned (wedged, still running) lane threads the
    process tolerates before grpc.health.v1 reports NOT_SERVING.
    ``max_given_up_lanes``: how many lanes *given up for good* (dead, never rebuilt
    again in this process: one that left more than 8 abandoned threads behind, a process
    lane lost under ``on_lane_fault="error"``, a lane thread that died of an engine bug)
    the process tolerates before grpc.health.v1 reports NOT_SERVING. Default 0: the
    first one, since every whole-vector request fails from then on. For lane-scoped
    clients that can live with some lanes lost: ``num_envs`` (or more) leaves health to
    ``min_serving_lanes`` and ``max_abandoned_lanes`` alone. A lane down only for a
    while (rebuilding, dead until its next rebuild attempt, wedged) is never counted.
    ``min_serving_lanes``: grpc.health.v1 reports NOT_SERVING while fewer lanes than this
    can serve (a lane that is dead, wedged or stopped cannot, for good or for a while;
    one being rebuilt can: its jobs queue for the fresh env). Default 1: NOT_SERVING
    once no lane can serve. At most ``num_envs``.
    ``lane_isolation``: ``thread`` (each env on a thread of the server) or ``process``
    (each env in a child process of its own: a segfault or a GIL-holding env costs the
    other lanes nothing, and pure-Python envs use every core; the factory must pickle).
    ``tls_cert_file`` / ``tls_key_file``: serve TLS (both or neither; PEM; ALPN ``h2``,
    TLS >= 1.2) -- on TCP addresses only. ``tls_client_ca_file``: mTLS -- a client must
    present a certificate signed by this CA (PEM) or the TLS handshake fails. The three
    files are looked at every 10 s while serving: renewed ones are used from the next
    handshake on.
    ``reflection``: serve gRPC server reflection (``grpc.reflection.v1`` and ``v1alpha``),
    so that tools like grpcurl can list and describe the services; needs the
    ``reflection`` extra (protobuf). Off by default; under a token it needs the token.
    ``record_dataset``: write every episode of every lane into the Minari dataset of this
    id (under ``MINARI_DATASETS_PATH``, else Minari's default root; it must not exist
    yet, unless ``record_append``: then an existing dataset of the same env and spaces
    is continued, its episodes untouched); needs the ``record`` extra. ``record_drop_faulted``: drop the episodes the
    server cut (a lane fault, a reset mid-episode, the server's stop) instead of recording
    them truncated. ``record_infos``: record the infos too (an episode whose info
    structure varies keeps its data, not its infos). ``record_video``: a directory for one
    video per recorded episode of ``record_video_lanes`` (None: every lane), every
    ``record_video_every``-th episode of each; the env must render ``rgb_array``
    frames. See docs/recording.md.
    """

    allow_remote_shutdown: bool = False
    idle_timeout_seconds: float | None = None
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    first_request_timeout_seconds: float | None = DEFAULT_FIRST_REQUEST_TIMEOUT
    drain_timeout_seconds: float | None = None
    close_timeout_seconds: float | None = None
    workflow_edition: str | None = None
    validation_policy: Policy | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    auth_token: str | None = field(default=None, repr=False)
    metrics_address: str | None = None
    event_loop: EventLoop = "auto"
    on_lane_fault: FaultPolicy = "error"
    lane_timeout_seconds: float | None = None
    max_abandoned_lanes: int = DEFAULT_MAX_ABANDONED_LANES
    min_serving_lanes: int = 1
    lane_isolation: LaneIsolation = "thread"
    tls_cert_file: str | os.PathLike[str] | None = None
    tls_key_file: str | os.PathLike[str] | None = None
    tls_client_ca_file: str | os.PathLike[str] | None = None
    reflection: bool = False
    max_given_up_lanes: int = DEFAULT_MAX_GIVEN_UP_LANES
    record_dataset: str | None = None
    record_append: bool = False
    record_drop_faulted: bool = False
    record_infos: bool = False
    record_video: str | os.PathLike[str] | None = None
    record_video_lanes: tuple[int, ...] | None = None
    record_video_every: int = 1

    def remote_shutdown_allowed(self, environ: Mapping[str, str] = os.environ) -> bool:
        """The option, or the environment variable (which can only enable it)."""
        if self.allow_remote_shutdown:
            return True
        value = environ.get("RLMESH_ALLOW_REMOTE_SHUTDOWN", "")
        return value.strip().lower() in ("1", "true")

    def resolved_policy(self, environ: Mapping[str, str] = os.environ) -> Policy:
        """The explicit policy, or the one ``RLMESH_VALIDATION_POLICY`` names."""
        if self.validation_policy is not None:
            return self.validation_policy
        return policy_from_env(environ)


def _one_of(values: tuple[str, ...]) -> str:
    """``'a', 'b' or 'c'``: a Literal's values, as an error lists them."""
    *head, last = map(repr, values)
    return f"{', '.join(head)} or {last}" if head else last


def policy_from_env(environ: Mapping[str, str] = os.environ) -> Policy:
    """``strict`` and ``off`` (any case) select those; anything else means ``warn``."""
    value = environ.get("RLMESH_VALIDATION_POLICY", "").strip().lower()
    if value == "strict":
        return "strict"
    if value == "off":
        return "off"
    return "warn"


@dataclass(frozen=True)
class Recording:
    """The recording options, validated (see :class:`ServeOptions`)."""

    dataset: str | None = None
    append: bool = False
    """Continue ``dataset`` if it exists (its env and spaces must be the served ones)."""
    drop_faulted: bool = False
    infos: bool = False
    video: str | None = None
    video_lanes: frozenset[int] | None = None
    """The lanes recorded to video (None: all)."""
    video_every: int = 1


_DATASET_ID = re.compile(r"(?:[^/\s]+/)*[^/\s]+-v\d+")
"""A Minari dataset id: ``[NAMESPACE/]NAME-vVERSION``, the version required (Minari's
own parser fails on an id without one with a ``TypeError`` about ``None``)."""


def _recording(options: ServeOptions) -> Recording | None:
    dataset, video = options.record_dataset, options.record_video
    if dataset is not None and (not isinstance(dataset, str) or not dataset):
        raise ValueError(f"record_dataset must be a Minari dataset id or None, got {dataset!r}")
    if dataset is not None and not _DATASET_ID.fullmatch(dataset):
        raise ValueError(
            f"record_dataset {dataset!r} is not a Minari dataset id: it takes the form "
            "NAME-vVERSION or NAMESPACE/NAME-vVERSION, the version required (e.g. "
            "rlmesh/cartpole-eval-v0)"
        )
    every = options.record_video_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"record_video_every must be an int >= 1, got {every!r}")
    lanes = options.record_video_lanes
    if lanes is not None:
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in lanes):
            raise ValueError(f"record_video_lanes must be lane indices >= 0, got {lanes!r}")
        if not lanes:
            raise ValueError("record_video_lanes must name at least one lane (None: all)")
    if video is None and (lanes is not None or every != 1):
        raise ValueError("record_video_lanes and record_video_every need record_video (a DIR)")
    if dataset is None and (
        options.record_drop_faulted or options.record_infos or options.record_append
    ):
        raise ValueError(
            "record_append, record_drop_faulted and record_infos need record_dataset (an id)"
        )
    if dataset is None and video is None:
        return None
    return Recording(
        dataset=dataset,
        append=bool(options.record_append),
        drop_faulted=bool(options.record_drop_faulted),
        infos=bool(options.record_infos),
        video=None if video is None else os.fspath(video),
        video_lanes=None if lanes is None else frozenset(lanes),
        video_every=every,
    )


@dataclass(frozen=True)
class Resolved:
    """:class:`ServeOptions` validated, with every default and environment variable applied.

    Built once, by :func:`resolve`, before anything is started; everything downstream
    (lanes, transport, serve) reads these numbers and never validates again.
    """

    allow_remote_shutdown: bool
    idle_timeout: float | None
    max_connections: int
    first_request_timeout: float | None
    drain_timeout: float
    close_timeout: float
    workflow_edition: str
    policy: Policy
    max_message_bytes: int
    auth_token: str | None = field(default=None, repr=False)
    metrics_address: str | None = None
    event_loop: Literal["uvloop", "asyncio"] = "asyncio"
    on_lane_fault: FaultPolicy = "error"
    lane_timeout: float | None = None
    max_abandoned_lanes: int = DEFAULT_MAX_ABANDONED_LANES
    min_serving_lanes: int = 1
    lane_isolation: LaneIsolation = "thread"
    reflection: bool = False
    tls: TlsFiles | None = None
    """The server's certificate, key and (mTLS) client CA; None: plaintext."""
    max_given_up_lanes: int = DEFAULT_MAX_GIVEN_UP_LANES
    record: Recording | None = None
    """What the server records (None: nothing)."""

    @property
    def mtls(self) -> bool:
        """Clients must present a certificate signed by the configured client CA."""
        return self.tls is not None and self.tls.client_ca_file is not None

    @property
    def stop_bound(self) -> float:
        """See :func:`stop_bound`."""
        return stop_bound(self.drain_timeout, self.close_timeout)


@dataclass(frozen=True)
class TlsFiles:
    """The server's TLS files, as absolute paths, checked loadable by :func:`resolve`."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def context(self) -> ssl.SSLContext:
        """A fresh server context from the files, read now."""
        from ._tls import server_context

        return server_context(self.cert_file, self.key_file, self.client_ca_file)


def tls_files(options: ServeOptions) -> TlsFiles | None:
    """``options``' TLS files, checked (both or neither, readable, loadable), or None.
    Raises ``ValueError`` naming the file or field at fault."""
    cert, key, ca = options.tls_cert_file, options.tls_key_file, options.tls_client_ca_file
    if cert is None and key is None:
        if ca is not None:
            raise ValueError(
                "tls_client_ca_file needs tls_cert_file and tls_key_file (mTLS is TLS first)"
            )
        return None
    if cert is None or key is None:
        given, missing = ("tls_cert_file", "tls_key_file")[:: 1 if key is None else -1]
        raise ValueError(f"{given} needs {missing} too (TLS takes both, or neither)")
    from ._tls import server_context

    server_context(cert, key, ca)  # raises ValueError naming the file that cannot be used
    return TlsFiles(
        os.path.abspath(os.fspath(cert)),
        os.path.abspath(os.fspath(key)),
        None if ca is None else os.path.abspath(os.fspath(ca)),
    )


def stop_bound(drain_timeout: float, close_timeout: float) -> float:
    """Seconds from the start of a stop until ``serve_env`` has returned, at most.

    ``drain_timeout`` (open streams finish) + ``close_timeout`` (the lanes close their
    envs while a request still in flight is answered) + :data:`STOP_SLACK`. Enforced: every
    phase is bounded by what is left of it.
    """
    return drain_timeout + close_timeout + STOP_SLACK


def _seconds(name: str, value: object, *, zero_ok: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value < math.inf
    if ok and (value >= 0 if zero_ok else value > 0):  # type: ignore[operator]
        return
    bound = ">= 0" if zero_ok else "> 0"
    raise ValueError(f"{name} must be a finite number {bound} or None, got {value!r}")


def resolve(options: ServeOptions, environ: Mapping[str, str] = os.environ) -> Resolved:
    """Validate ``options`` and resolve defaults and environment variables.

    Raises ``TypeError`` for a non-ServeOptions, ``ValueError`` naming the bad field.
    """
    if not isinstance(options, ServeOptions):
        raise TypeError(f"options must be a ServeOptions, got {type(options).__name__}")
    for name in ("drain_timeout_seconds", "close_timeout_seconds"):
        value = getattr(options, name)
        if value is not None:
            _seconds(name, value, zero_ok=True)
    if options.idle_timeout_seconds is not None:
        _seconds("idle_timeout_seconds", options.idle_timeout_seconds, zero_ok=False)
    if options.first_request_timeout_seconds is not None:
        _seconds(
            "first_request_timeout_seconds", options.first_request_timeout_seconds, zero_ok=False
        )
    conns = options.max_connections
    if isinstance(conns, bool) or not isinstance(conns, int) or conns < 1:
        raise ValueError(f"max_connections must be an int >= 1, got {conns!r}")
    size = options.max_message_bytes
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"max_message_bytes must be an int >= 1, got {size!r}")
    if options.validation_policy is not None and options.validation_policy not in POLICIES:
        raise ValueError(
            f"validation_policy must be {', '.join(map(repr, POLICIES))} or None, "
            f"got {options.validation_policy!r}"
        )
    edition = options.workflow_edition or WORKFLOW_EDITION
    if edition != WORKFLOW_EDITION:
        raise ValueError(
            f"workflow edition {edition!r} is not implemented (implements [{WORKFLOW_EDITION!r}])"
        )
    token = options.auth_token
    if token is None:
        token = environ.get(AUTH_TOKEN_ENV) or None
    if token is not None and (not isinstance(token, str) or not token.strip()):
        raise ValueError("auth_token must be a non-empty string or None")
    if token is not None:
        check_token(token)
    metrics = options.metrics_address
    if metrics is not None:
        from ._address import TcpAddress, parse_address

        # Any TCP form rlmesh accepts (tcp://host:port, host:port, port), resolved once.
        if not isinstance(metrics, str) or not isinstance(parse_address(metrics), TcpAddress):
            raise ValueError(f"metrics_address must be tcp://host:port or None, got {metrics!r}")
        metrics = str(parse_address(metrics))
    loop = options.event_loop
    if loop not in EVENT_LOOPS:
        raise ValueError(f"event_loop must be {_one_of(EVENT_LOOPS)}, got {loop!r}")
    if loop != "asyncio":
        available = importlib.util.find_spec("uvloop") is not None
        if loop == "uvloop" and not available:
            raise ValueError("event_loop='uvloop' needs uvloop (pip install uvloop)")
        loop = "uvloop" if available else "asyncio"
    if options.on_lane_fault not in FAULT_POLICIES:
        raise ValueError(
            f"on_lane_fault must be {_one_of(FAULT_POLICIES)}, got {options.on_lane_fault!r}"
        )
    if options.lane_timeout_seconds is not None:
        _seconds("lane_timeout_seconds", options.lane_timeout_seconds, zero_ok=False)
    if options.lane_isolation not in LANE_ISOLATIONS:
        raise ValueError(
            f"lane_isolation must be {_one_of(LANE_ISOLATIONS)}, got {options.lane_isolation!r}"
        )
    if options.lane_isolation == "process" and sys.platform == "win32":
        raise ValueError("lane_isolation='process' needs a POSIX system")
    cap = options.max_abandoned_lanes
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
        raise ValueError(f"max_abandoned_lanes must be an int >= 0, got {cap!r}")
    floor = options.min_serving_lanes
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
        raise ValueError(f"min_serving_lanes must be an int >= 1, got {floor!r}")
    lost = options.max_given_up_lanes
    if isinstance(lost, bool) or not isinstance(lost, int) or lost < 0:
        raise ValueError(f"max_given_up_lanes must be an int >= 0, got {lost!r}")
    tls = tls_files(options)
    drain, close, idle = (
        options.drain_timeout_seconds,
        options.close_timeout_seconds,
        options.idle_timeout_seconds,
    )
    return Resolved(
        allow_remote_shutdown=options.remote_shutdown_allowed(environ),
        idle_timeout=None if idle is None else float(idle),
        max_connections=options.max_connections,
        first_request_timeout=None
        if options.first_request_timeout_seconds is None
        else float(options.first_request_timeout_seconds),
        drain_timeout=DEFAULT_DRAIN_TIMEOUT if drain is None else float(drain),
        close_timeout=DEFAULT_CLOSE_TIMEOUT if close is None else float(close),
        workflow_edition=edition,
        policy=options.resolved_policy(environ),
        max_message_bytes=size,
        auth_token=token,
        metrics_address=metrics,
        event_loop=loop,
        on_lane_fault=options.on_lane_fault,
        lane_timeout=None
        if options.lane_timeout_seconds is None
        else float(options.lane_timeout_seconds),
        max_abandoned_lanes=cap,
        min_serving_lanes=floor,
        max_given_up_lanes=lost,
        lane_isolation=options.lane_isolation,
        tls=tls,
        reflection=bool(options.reflection),
        record=_recording(options),
    )


def check_token(token: str) -> None:
    """A bearer token must be visible ASCII (``!`` to ``~``): it travels as an HTTP/2
    header value, where a client cannot present anything else byte for byte.

    The error names the position of the first character refused, never the token.
    """
    for position, char in enumerate(token):
        if not "!" <= char <= "~":
            raise ValueError(
                f"auth_token must be visible ASCII characters ('!' to '~', no spaces): "
                f"character {position + 1} is U+{ord(char):04X}"
            )
