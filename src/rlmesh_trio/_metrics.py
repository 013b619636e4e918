"""Prometheus metrics of one server (``ServeOptions.metrics_address``), with prometheus-client.

Each server has its own :class:`~prometheus_client.CollectorRegistry` (two servers in one
process do not mix their numbers) and, when an address is given, its own HTTP endpoint
(prometheus-client's WSGI app on a bounded threading server: at most 16 connections at
once, each with a socket timeout). docs/metrics.md lists every metric.

Hot-path cost: per-lane children are bound once, so a step costs a few counter
increments and two histogram observations on the transport thread.

prometheus-client is the ``metrics`` extra (``pip install '.[metrics]'`` from a clone); asking
for metrics without it is a clear startup error.
"""

from __future__ import annotations

import platform
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from ._address import TcpAddress, parse_address
from ._version import __version__

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

    from ._lanes import LaneStatus
    from ._session import Done, Report

LANE_STATES = ("starting", "serving", "rebuilding", "wedged", "dead", "stopped")

__all__ = ["ServerMetrics", "start_http"]

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
"""Seconds: a CartPole step is ~0.5 ms end to end, an Atari frame a few ms."""


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:  # pragma: no cover - the extra is in the test deps
        raise RuntimeError(
            "metrics need prometheus-client: pip install prometheus-client "
            "(the metrics extra; from a clone of rlmesh-trio: pip install '.[metrics]')"
        ) from exc
    return prometheus_client


def _prometheus_core() -> Any:
    _prometheus()
    import prometheus_client.core

    return prometheus_client.core


class ServerMetrics:
    """The metrics of one server; fed on the transport thread by the Join driver."""

    def __init__(self, num_envs: int, env_id: str) -> None:
        prom = _prometheus()
        self.registry = registry = prom.CollectorRegistry()
        lane = ["lane"]
        self.resets = prom.Counter(
            "rlmesh_trio_lane_resets", "Resets served, per lane", lane, registry=registry
        )
        self.steps = prom.Counter(
            "rlmesh_trio_lane_steps", "Steps served, per lane", lane, registry=registry
        )
        self.errors = prom.Counter(
            "rlmesh_trio_lane_errors",
            "Requests of a lane answered with an EnvError, by code",
            ["lane", "code"],
            registry=registry,
        )
        self.timeouts = prom.Counter(
            "rlmesh_trio_lane_timeouts", "Deadlines (timeout_ms) expired", lane, registry=registry
        )
        self.faults = prom.Counter(
            "rlmesh_trio_lane_faults",
            "Env failures (reset/step/render raised, or its result could not be sent)",
            lane,
            registry=registry,
        )
        self.rejected = prom.Counter(
            "rlmesh_trio_requests_rejected",
            "Requests refused before any lane ran them, by EnvError code",
            ["code"],
            registry=registry,
        )
        self.step_seconds = prom.Histogram(
            "rlmesh_trio_step_seconds",
            "Step requests: server time from request read to reply ready (endpoint_total_ns)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.env_step_seconds = prom.Histogram(
            "rlmesh_trio_env_step_seconds",
            "Step requests: time inside env.step (user_ns; the slowest lane of a request)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_depth = prom.Gauge(
            "rlmesh_trio_queue_depth",
            "Requests of the current Join read and not answered yet",
            registry=registry,
        )
        self.sessions = prom.Counter(
            "rlmesh_trio_sessions", "Join sessions, by outcome", ["outcome"], registry=registry
        )
        self.bytes_in = prom.Counter(
            "rlmesh_trio_received_bytes", "gRPC message bytes received", registry=registry
        )
        self.bytes_out = prom.Counter(
            "rlmesh_trio_sent_bytes", "gRPC message bytes sent (Join replies)", registry=registry
        )
        build = prom.Info("rlmesh_trio_build", "This server's build", registry=registry)
        build.info(
            {
                "version": __version__,
                "python": platform.python_version(),
                "env_id": env_id,
                "num_envs": str(num_envs),
            }
        )
        names = [str(i) for i in range(num_envs)]
        # Children bound once: the hot path does no label lookups.
        self._resets = [self.resets.labels(n) for n in names]
        self._steps = [self.steps.labels(n) for n in names]
        self._timeouts = [self.timeouts.labels(n) for n in names]
        self._faults = [self.faults.labels(n) for n in names]
        self._lanes = _LaneCollector(num_envs)
        registry.register(self._lanes)
        self._recording = _RecordCollector()
        registry.register(self._recording)
        self._admitted = self.sessions.labels("admitted")
        self._refused = self.sessions.labels("refused")

    def watch_lanes(self, status: Callable[[], Sequence[LaneStatus]]) -> None:
        """Read the lanes' supervision state and counters from ``status`` at each scrape."""
        self._lanes.status = status

    def watch_recording(self, counters: Callable[[], Sequence[RecorderCounters]]) -> None:
        """Read the recorders' queues and counters from ``counters`` at each scrape."""
        self._recording.counters = counters

    # -- fed by the transport

    def done(self, item: Done) -> None:
        """A request completed on its lanes."""
        if item.verb == "step":
            for lane in item.lanes:
                self._steps[lane].inc()
            self.step_seconds.observe(item.total_ns / 1e9)
            self.env_step_seconds.observe(item.user_ns / 1e9)
        elif item.verb == "reset":
            for lane in item.lanes:
                self._resets[lane].inc()

    def report(self, item: Report) -> None:
        """An error reply: a fault, a refusal, a timeout."""
        code = item.code.name
        if item.kind == "rejected" and not item.lanes:
            self.rejected.labels(code).inc()
            return
        if item.kind == "truncated":  # answered, as a truncation: no EnvError went out
            for lane in item.lanes:
                self._faults[lane].inc()
            return
        for lane in item.lanes:
            self.errors.labels(str(lane), code).inc()
            if item.kind == "fault":
                self._faults[lane].inc()
            elif item.kind == "timeout":
                self._timeouts[lane].inc()

    def session(self, admitted: bool) -> None:
        (self._admitted if admitted else self._refused).inc()

    def received(self, size: int) -> None:
        self.bytes_in.inc(size)

    def sent(self, size: int) -> None:
        self.bytes_out.inc(size)

    def depth(self, backlog: int) -> None:
        self.queue_depth.set(backlog)

    def exposition(self) -> bytes:
        """The Prometheus text format of everything above."""
        data: bytes = _prometheus().generate_latest(self.registry)
        return data


RecorderCounters = tuple[str, int, int, int, int, int]
"""A recorder's name, queue depth, items and bytes written, put wait (ns), and the lanes
it records no more (its writer failed, or their video stopped)."""


class _RecordCollector:
    """The recorders' queues and counters (issue 33), read at scrape time."""

    def __init__(self) -> None:
        self.counters: Callable[[], Sequence[RecorderCounters]] | None = None

    def collect(self) -> Iterator[Any]:
        if self.counters is None:
            return
        core = _prometheus_core()
        label = ["recorder"]
        depth = core.GaugeMetricFamily(
            "rlmesh_trio_record_queue_depth",
            "Items (episodes, or video frames) queued for the recorder's writer",
            labels=label,
        )
        items = core.CounterMetricFamily(
            "rlmesh_trio_record_items_written",
            "Items the recorder's writer has written (episodes, or video frames and ends)",
            labels=label,
        )
        size = core.CounterMetricFamily(
            "rlmesh_trio_record_written_bytes",
            "Bytes the recorder's files grew by",
            labels=label,
        )
        waited = core.CounterMetricFamily(
            "rlmesh_trio_record_put_wait_seconds",
            "Time the lanes waited for room in the recorder's queue (backpressure)",
            labels=label,
        )
        stopped = core.GaugeMetricFamily(
            "rlmesh_trio_record_lanes_stopped",
            "Lanes the recorder records no more (its writer failed, or their video "
            "stopped): what they play from then on is lost to it",
            labels=label,
        )
        for name, queued, written, nbytes, wait_ns, lost in self.counters():
            depth.add_metric([name], queued)
            items.add_metric([name], written)
            size.add_metric([name], nbytes)
            waited.add_metric([name], wait_ns / 1e9)
            stopped.add_metric([name], lost)
        yield from (depth, items, size, waited, stopped)


class _LaneCollector:
    """The lane engine's own counters and states, read at scrape time (nothing per step)."""

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.status: Callable[[], Sequence[LaneStatus]] | None = None

    def collect(self) -> Iterator[Any]:
        core = _prometheus_core()
        lanes = list(self.status()) if self.status is not None else []
        rebuilds = core.CounterMetricFamily(
            "rlmesh_trio_lane_rebuilds", "Lanes rebuilt from the factory", labels=["lane"]
        )
        wedges = core.CounterMetricFamily(
            "rlmesh_trio_lane_wedges",
            "Env calls declared wedged (past lane_timeout_seconds or a request's deadline)",
            labels=["lane"],
        )
        abandoned = core.GaugeMetricFamily(
            "rlmesh_trio_lane_abandoned_threads",
            "Lane threads abandoned in a wedged env call and still running",
            labels=["lane"],
        )
        state = core.GaugeMetricFamily(
            "rlmesh_trio_lane_state",
            "1 for the state each lane is in (serving, rebuilding, wedged, dead, ...)",
            labels=["lane", "state"],
        )
        by_lane = {item.lane: item for item in lanes}
        for index in range(self.num_envs):
            name = str(index)
            item = by_lane.get(index)
            rebuilds.add_metric([name], item.rebuilds if item else 0)
            wedges.add_metric([name], item.wedges if item else 0)
            abandoned.add_metric([name], item.abandoned if item else 0)
            current = item.state if item else "starting"
            for each in LANE_STATES:
                state.add_metric([name, each], 1.0 if each == current else 0.0)
        yield from (rebuilds, wedges, abandoned, state)


METRICS_MAX_CONNECTIONS = 16
"""Scrapes served at once; a connection beyond them is closed as soon as it is accepted,
so a flood of connections holds neither threads nor file descriptors (which the gRPC
listener shares)."""

METRICS_SOCKET_TIMEOUT = 10.0
"""Seconds a metrics connection may sit idle (a slow or half-open client) before it is
dropped; a scrape of a server's metrics is a few KiB and takes milliseconds."""


def _bounded_server_class() -> type[WSGIServer]:
    """A threading WSGI server (the kind prometheus-client's own ``start_http_server``
    runs) with a bound on concurrent connections."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIServer

    class BoundedWSGIServer(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        block_on_close = False
        allow_reuse_address = True
        max_connections = METRICS_MAX_CONNECTIONS
        request_queue_size = 128  # accepted and closed fast; socketserver's 5 drops SYNs

        def server_activate(self) -> None:
            self._slots = threading.BoundedSemaphore(self.max_connections)
            self.refused = 0
            super().server_activate()

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self._slots.acquire(blocking=False):
                self.refused += 1
                self.shutdown_request(request)  # closed at once: no thread, no fd kept
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self._slots.release()
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                self._slots.release()

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a client that timed out or went away: nothing to report

    return BoundedWSGIServer


def _quiet_handler_class() -> type[WSGIRequestHandler]:
    from wsgiref.simple_server import WSGIRequestHandler

    class QuietHandler(WSGIRequestHandler):
        timeout = METRICS_SOCKET_TIMEOUT  # socket timeout of every connection

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per scrape is noise

    return QuietHandler


def start_http(metrics: ServerMetrics, address: str) -> tuple[WSGIServer, threading.Thread, str]:
    """Serve ``metrics`` over HTTP at ``address`` (``tcp://host:port``; port 0 picks one).

    prometheus-client's WSGI app, on a threading server of at most
    :data:`METRICS_MAX_CONNECTIONS` connections, each with a
    :data:`METRICS_SOCKET_TIMEOUT` socket timeout. Returns the server, its daemon
    thread and the bound address. Stop it with ``server.shutdown()`` then
    ``server.server_close()``.
    """
    parsed = parse_address(address)
    if not isinstance(parsed, TcpAddress):
        raise ValueError(f"the metrics address must be tcp://host:port, got {address!r}")
    from wsgiref.simple_server import make_server

    prom = _prometheus()
    server_class = _bounded_server_class()
    infos = socket.getaddrinfo(
        parsed.host, parsed.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    server_class.address_family = infos[0][0]
    server = make_server(
        parsed.host,
        parsed.port,
        prom.make_wsgi_app(metrics.registry),
        server_class,
        handler_class=_quiet_handler_class(),
    )
    thread = threading.Thread(target=server.serve_forever, name="rlmesh-trio-metrics", daemon=True)
    thread.start()
    # a TCP server: (host, port), or (host, port, flowinfo, scope_id) for IPv6
    host, port = cast("tuple[str, int]", server.server_address[:2])
    shown = f"[{host}]" if ":" in host else host
    return server, thread, f"tcp://{shown}:{port}"
