"""Everything that lives on the transport loop: the method table, the one error-to-status
mapping every handler goes through, health, the idle timer and the stop phases.

Loop thread only (not thread-safe).

What it serves (SPEC §1):

* ``/rlmesh.env.v1.EnvService/Handshake`` and ``/Shutdown`` -- unary, answered by the
  :class:`~rlmesh_trio._session.Endpoint`;
* ``/rlmesh.env.v1.EnvService/Join`` -- the bidi stream (:mod:`._join`); one at a time;
* ``/grpc.health.v1.Health/Check`` -- SERVING for ``""`` and ``"rlmesh.env.v1.EnvService"``
  while listening, NOT_SERVING while stopping (beyond the reference, which has none);
* anything else -- ``UNIMPLEMENTED``; a compressed request -- ``UNIMPLEMENTED``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import hmac
import logging
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import outcome
from grpclib.const import Cardinality, Status
from grpclib.const import Handler as MethodHandler
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

from .._bridge import ToLoop, Worker
from .._credentials import protect_credentials
from .._errors import (
    MISSING_MESSAGE,
    AlreadyJoinedError,
    MessageTooLarge,
    RequestTooLarge,
    RlmeshTrioError,
    ServerStoppingError,
    UnknownMethodError,
    UnknownServiceError,
    grpc_status,
)
from .._logging import RateLimit
from .._options import Resolved
from .._session import Endpoint, Session
from .._tls import HANDSHAKE_TIMEOUT as TLS_HANDSHAKE_TIMEOUT
from .._tls import RELOAD_INTERVAL as TLS_RELOAD_INTERVAL
from .._tls import ReloadingServerContext
from .._wire import (
    HANDSHAKE_PATH,
    HEALTH_CHECK_PATH,
    HEALTH_NOT_SERVING,
    HEALTH_SERVING,
    JOIN_PATH,
    SERVICE_NAME,
    SHUTDOWN_PATH,
    decode_handshake_request,
    decode_health_request,
    decode_shutdown_request,
)
from .._wire import encode_health_response as health_response
from ._connection import Connection
from ._dispatch import Dispatcher
from ._flood import ServerBudget
from ._join import OFF_LOOP_DECODE_BYTES, JoinCall, JoinContext
from ._quiet import quiet_call_ends
from ._reflection import ReflectionServices
from ._routes import ReplyRoutes
from ._shim import (
    MethodTable,
    RawCodec,
    read_message,
    server_config,
)
from ._writer import reset_if_open

if TYPE_CHECKING:
    from .._lanes import LaneEngine
    from .._metrics import ServerMetrics

log = logging.getLogger("rlmesh_trio.transport")


HEALTH_MAX_BYTES = 4096
"""The largest HealthCheckRequest read (a service name of a few KiB); a bigger one is
RESOURCE_EXHAUSTED before its body is buffered. The health check needs no token."""

UNARY_SLICE_SECONDS = 0.002
"""Reading the messages after a unary request's first gives the loop back this often,
for :data:`UNARY_PAUSE_SECONDS` (a timer: under uvloop, ``sleep(0)`` lets no other
connection's bytes in, measured: a client's 8 MB Handshake stalled another's steps
for a second)."""

UNARY_PAUSE_SECONDS = 0.001

GOAWAY_GAP = 0.05
"""Seconds between the two GOAWAY frames of a stop (like the reference: first with
last-stream 2^31-1, then with the real last stream id)."""

INFLIGHT_GRACE = 0.2
"""Seconds beyond ``close_timeout`` a request in flight when the drain ended may take to
be answered (the lanes finish their current job within the close timeout)."""

CUT_TIMEOUT = 0.3
"""Seconds the request handlers get to unwind once the connections were cut."""

LOOP_CLOSE_TIMEOUT = 0.2
"""Seconds the loop's leftover tasks get when the transport thread closes it."""

TRIM_DELAY = 1.0
"""Seconds after a big message until the allocator is asked to give memory back."""

STOP_MARGIN = 0.1
"""Seconds of the stop bound kept for scheduling (reporting back to Trio)."""

_MAX_STREAM_ID = 2**31 - 1


@dataclass(frozen=True, slots=True, eq=False)
class Wiring:
    """One server's parts, composed once (:func:`rlmesh_trio._serve.compose`, which the
    tests call too) and handed unchanged from :class:`~._service.TransportService` to
    :class:`LoopServer`. Real types all: the transport stands above the session, the
    lanes and the metrics (docs/architecture.md, Layers), so it may name them.
    """

    options: Resolved
    endpoint: Endpoint
    """Answers Handshake and Shutdown; every Join's session belongs to it."""
    lanes: LaneEngine
    """Takes the Joins' jobs (``post``), is told of a wedge (``wedged``), says whether the
    server is healthy (``healthy``), and is closed once the drain is over (``close``)."""
    session_factory: Callable[[Endpoint], Session]
    """A fresh session for each Join (``Session``; with ``observe=True`` for metrics)."""
    metrics: ServerMetrics | None = None
    """The server's Prometheus metrics (None: not asked for)."""


def _libc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)``: hand freed heap pages back to the OS (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


_TRIM = _libc_trim()


class LoopServer:
    """The loop side of one server: connections, handlers, idle timer, stop."""

    def __init__(
        self,
        wiring: Wiring,
        loop: asyncio.AbstractEventLoop,
        *,
        on_stop_begin: Callable[[], None] | None,
    ) -> None:
        options = wiring.options
        self.loop = loop
        self.wiring = wiring
        self.lanes = wiring.lanes
        self.metrics = wiring.metrics
        self.to_loop = ToLoop(loop.call_soon_threadsafe)
        self.endpoint = wiring.endpoint
        self.max_message_bytes = options.max_message_bytes
        self.options = options
        self._on_stop_begin = on_stop_begin
        self.closing = False
        self._stop_accepted = False  # a Shutdown was accepted (its stop may not have begun)
        self.reading = True  # Join streams read requests (until the drain is over)
        self.stop_reason: str | None = None
        self._drain_joins = True
        self._stop_requested = asyncio.Event()
        self._changed = asyncio.Event()  # a unary call or a Join ended, or busy changed
        self.protocols: set[Connection] = set()
        quiet_call_ends()  # grpclib's traceback per handler a GOAWAY cut off: one line
        self.budget = ServerBudget(loop.time)
        """What every connection spends together: frames, unfinished header blocks."""
        self.join: JoinCall | None = None
        self._busy: set[JoinCall] = set()  # Join sessions with work in flight
        self._unary_calls = 0
        self._unary_reading = 0  # of those, the ones waiting for their request's data
        self._idle_handle: asyncio.TimerHandle | None = None
        self._trim_handle: asyncio.TimerHandle | None = None
        self._tls: ReloadingServerContext | None = None
        self._tls_handle: asyncio.TimerHandle | None = None
        self.worker = Worker("rlmesh-trio-decode")
        self.report_limit = RateLimit(clock=loop.time)  # rejected-request warnings
        token = options.auth_token
        protect_credentials(token)  # hpack's DEBUG lines would print the header
        self._expected_authorization = None if token is None else f"Bearer {token}".encode("ascii")
        self.codec = RawCodec()
        self.config, self.h2_config = server_config()
        unary = Cardinality.UNARY_UNARY
        self.mapping = MethodTable(
            {
                HANDSHAKE_PATH: MethodHandler(self._unary(self._handshake), unary, bytes, bytes),
                SHUTDOWN_PATH: MethodHandler(self._unary(self._shutdown), unary, bytes, bytes),
                JOIN_PATH: MethodHandler(
                    self._mapped(self._join), Cardinality.STREAM_STREAM, bytes, bytes
                ),
                HEALTH_CHECK_PATH: MethodHandler(
                    self._unary(self._health_check), unary, bytes, bytes
                ),
            },
            fallback=MethodHandler(
                self._mapped(self._unknown), Cardinality.STREAM_STREAM, bytes, bytes
            ),
        )
        if options.reflection:
            reflection = ReflectionServices()  # RuntimeError without protobuf: at startup
            for path, handler in reflection.handlers():
                self.mapping[path] = MethodHandler(
                    self._mapped(handler), Cardinality.STREAM_STREAM, bytes, bytes
                )

    # -- lifecycle

    async def serve(self, sock: socket.socket, on_listening: Callable[[], None]) -> None:
        tls = self.options.tls
        if sock.family == socket.AF_UNIX:
            server = await self.loop.create_unix_server(self._make_protocol, sock=sock)
        elif tls is None:
            server = await self.loop.create_server(self._make_protocol, sock=sock)
        else:
            # TLS (and mTLS: CERT_REQUIRED) on the loop's own SSL transport; a failed
            # handshake closes that connection only (asyncio logs it at DEBUG).
            self._tls = ReloadingServerContext(
                tls.cert_file,
                tls.key_file,
                tls.client_ca_file,
                on_problem=lambda why: log.warning(
                    "the TLS files changed but cannot be used (%s): serving the previous "
                    "certificate",
                    why,
                ),
                on_reload=lambda: log.info("TLS files changed: certificate reloaded"),
            )
            server = await self.loop.create_server(
                self._make_protocol,
                sock=sock,
                ssl=self._tls.context,
                ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT,
            )
            self._watch_tls()
        try:
            if not self._stop_requested.is_set():
                on_listening()
                self._arm_idle()
            await self._stop_requested.wait()
        finally:
            await self._stop(server)

    def _watch_tls(self) -> None:
        """Look at the TLS files every :data:`~rlmesh_trio._tls.RELOAD_INTERVAL` s."""
        if self._tls is None or self.closing:
            return
        self._tls.check()
        self._tls_handle = self.loop.call_later(TLS_RELOAD_INTERVAL, self._watch_tls)

    def _make_protocol(self) -> Connection:
        return Connection(
            Dispatcher(self, self.mapping, self.codec, frozenset({JOIN_PATH})),
            self.config,
            self.h2_config,
            self.protocols,
            self.budget,
            max_connections=self.options.max_connections,
            first_request_timeout=self.options.first_request_timeout,
        )

    def request_stop(self, reason: str, *, drain: bool = True) -> None:
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        self._drain_joins = drain
        log.info("transport stopping: %s", reason)
        if self._on_stop_begin is not None:
            self._on_stop_begin()
        self._stop_requested.set()

    async def _stop(self, server: asyncio.AbstractServer) -> None:
        """Stop in phases, every wait bounded, the whole within the stop bound.

        1. Close the listener, send GOAWAY (twice, like the reference).
        2. Drain (graceful stops only): open streams are served as usual, new requests
           included, until they all ended or ``drain_timeout`` passed.
        3. Read no more requests and tell the owner (``on_drained``: the lanes start
           closing now); a request still in flight gets its reply if it completes within
           ``close_timeout`` (+ :data:`INFLIGHT_GRACE`).
        4. Cut the connections (no trailers: clients see UNAVAILABLE) and let the
           handlers unwind (:data:`CUT_TIMEOUT`).
        """
        options = self.options
        # Every phase is bounded by what is left of the stop bound (less what closing the
        # loop may take after us), so the whole stop meets it.
        deadline = self.loop.time() + options.stop_bound - LOOP_CLOSE_TIMEOUT - STOP_MARGIN

        def left(phase: float) -> float:
            return max(0.0, min(phase, deadline - self.loop.time()))

        self.closing = True
        self._cancel_idle()
        if self._tls_handle is not None:
            self._tls_handle.cancel()
        server.close()
        for proto in list(self.protocols):
            proto.send_goaway(_MAX_STREAM_ID)
        await asyncio.sleep(GOAWAY_GAP)
        for proto in list(self.protocols):
            proto.send_goaway(proto.dispatcher.last_stream_id)
        if self._drain_joins:
            try:
                await asyncio.wait_for(self._until(self._streams_done), left(options.drain_timeout))
            except TimeoutError:
                log.info(
                    "drain bound of %.3g s expired with %d stream(s) open",
                    options.drain_timeout,
                    self._in_flight() + (self.join is not None),
                )
        self.reading = False
        if self.join is not None:
            self.join.stop_reading()
        self._notify_drained()
        inflight = left(options.close_timeout + INFLIGHT_GRACE)
        try:
            await asyncio.wait_for(self._until(self._nothing_in_flight), inflight)
        except TimeoutError:
            log.warning("requests still in flight %.3g s after the drain; cutting them", inflight)
        handlers = [proto.dispatcher for proto in self.protocols]
        for proto in list(self.protocols):
            proto.cut()
        waits = [self.loop.create_task(handler.wait_closed()) for handler in handlers]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=left(CUT_TIMEOUT))
            for task in pending:
                task.cancel()
            if pending:
                log.warning("request handlers did not unwind within %.3g s", CUT_TIMEOUT)
        self.worker.close()
        self._cancel_trim()
        # Python >= 3.12: wait_closed() waits for every connection; they are cut, but bound it.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.wait_closed(), left(CUT_TIMEOUT))

    def _in_flight(self) -> int:
        """Unary calls being answered (not the ones waiting for their client's request:
        the stop cuts those)."""
        return self._unary_calls - self._unary_reading

    def _streams_done(self) -> bool:
        return not self._in_flight() and self.join is None

    def _nothing_in_flight(self) -> bool:
        return not self._in_flight() and (self.join is None or self.join.idle)

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self._changed.clear()
            await self._changed.wait()

    def _notify_drained(self) -> None:
        """The drain is over: the lanes start closing (a request in flight is answered)."""
        try:
            self.lanes.close()
        except Exception:
            log.exception("closing the lanes after the drain failed")

    @functools.cached_property
    def join_context(self) -> JoinContext:
        """What every Join of this server needs of it (built once, at the first Join)."""
        routes = ReplyRoutes(self.lanes.post, self.endpoint.num_envs, self.to_loop)
        return JoinContext(
            loop=self.loop,
            new_session=functools.partial(self.wiring.session_factory, self.endpoint),
            num_envs=self.endpoint.num_envs,
            max_message_bytes=self.max_message_bytes,
            protocols=self.protocols,
            routes=routes,
            wedged=self.lanes.wedged,
            report_limit=self.report_limit,
            metrics=self.metrics,
            worker=self.worker,
            to_loop=self.to_loop,
            big_message_done=self.big_message_done,
            activity=self.join_activity,
            reading=lambda: self.reading,
            left=self._session_left if self.lanes.recording is not None else None,
        )

    def _session_left(self) -> None:
        """A Join session ended while the server goes on (not its stop): the recorders
        cut the episodes it left open as the session's (``session_close``)."""
        stopping = self.closing or self.stop_reason is not None or self._stop_accepted
        if not stopping and (recording := self.lanes.recording) is not None:
            recording.session_closed()

    # -- work off the loop, memory

    async def off_loop(self, fn: Callable[[Any], Any], data: Any) -> Any:
        """``fn(data)`` on the worker thread; the loop serves meanwhile."""
        future: asyncio.Future[Any] = self.loop.create_future()

        def done(result: outcome.Outcome[Any]) -> None:
            if not future.done():
                if isinstance(result, outcome.Error):
                    future.set_exception(result.error)
                else:
                    future.set_result(result.unwrap())

        self.worker.submit(lambda: fn(data), self.to_loop, done)
        return await future

    def big_message_done(self) -> None:
        """A big message was read or sent: soon, hand the freed heap back to the OS."""
        if _TRIM is None or self._trim_handle is not None:
            return
        self._trim_handle = self.loop.call_later(TRIM_DELAY, self._trim)

    def _trim(self) -> None:
        self._trim_handle = None
        if _TRIM is not None:
            _TRIM()

    def _cancel_trim(self) -> None:
        if self._trim_handle is not None:
            self._trim_handle.cancel()
            self._trim_handle = None

    # -- idle timer (SPEC §10.4)

    def join_activity(self, call: JoinCall) -> None:
        """After every Join event: track busy sessions, re-arm the idle timer."""
        if call.session.busy and call.attached:
            self._busy.add(call)
        else:
            self._busy.discard(call)
        self._changed.set()
        self._arm_idle()

    def _arm_idle(self) -> None:
        self._cancel_idle()
        idle = self.options.idle_timeout
        if idle is None or self.closing or self._busy:
            return
        self._idle_handle = self.loop.call_later(idle, self._idle_expired)

    def _cancel_idle(self) -> None:
        if self._idle_handle is not None:
            self._idle_handle.cancel()
            self._idle_handle = None

    def _idle_expired(self) -> None:
        self._idle_handle = None
        if not self._busy:
            # An open but silent Join does not hold the server: cut it at once.
            self.request_stop(f"idle for {self.options.idle_timeout:g} s", drain=False)

    # -- the one mapping of errors to gRPC statuses

    def _mapped(
        self, handler: Callable[[Stream[bytes, bytes]], Awaitable[None]]
    ) -> Callable[[Stream[bytes, bytes]], Awaitable[None]]:
        """Every handler runs inside this: an exception becomes the call's gRPC status."""

        async def mapped(stream: Stream[bytes, bytes]) -> None:
            try:
                await handler(stream)
            except (GRPCError, asyncio.CancelledError):
                raise
            except Exception as exc:
                if not isinstance(exc, RlmeshTrioError):  # a bug of ours: log it whole
                    log.exception("the %s handler failed", handler.__name__.lstrip("_"))
                code, message = grpc_status(exc)
                raise GRPCError(Status(code), message or None) from None

        return mapped

    def _unary(
        self, handler: Callable[[Stream[bytes, bytes]], Awaitable[None]]
    ) -> Callable[[Stream[bytes, bytes]], Awaitable[None]]:
        mapped = self._mapped(handler)

        async def counted(stream: Stream[bytes, bytes]) -> None:
            self._unary_calls += 1
            try:
                await mapped(stream)
            finally:
                self._unary_calls -= 1
                self._changed.set()

        return counted

    def authorized(self, path: str | None, authorization: str | None) -> bool:
        """With a token configured, every call but the health check must carry it.

        Compared in constant time (``hmac.compare_digest``), as bytes; the token is
        never logged.
        """
        expected = self._expected_authorization
        if expected is None or path == HEALTH_CHECK_PATH:
            return True
        # Header values arrive decoded as latin-1: this gives back the bytes sent.
        given = (authorization or "").encode("latin-1")
        return hmac.compare_digest(given, expected)

    # -- handlers

    async def _read_unary(
        self, stream: Stream[bytes, bytes], limit: int | None = None
    ) -> bytes | bytearray | None:
        """The request's next message; None at its end. A call waiting here for its
        client holds no stop: :meth:`_in_flight`."""
        self._unary_reading += 1
        self._changed.set()
        try:
            return await read_message(stream, self.max_message_bytes if limit is None else limit)
        except MessageTooLarge as exc:
            if limit is None:  # an EnvService call: the reference's status and words
                raise RequestTooLarge(exc) from None
            raise
        finally:
            self._unary_reading -= 1
            self._changed.set()

    async def _decode_unary(
        self,
        stream: Stream[bytes, bytes],
        decode: Callable[[Any], Any],
        limit: int | None = None,
        *,
        to_the_end: bool = True,
    ) -> Any:
        """The request of a unary call, read to the end of the request stream
        (``to_the_end``; else its first message only).

        Messages after the first are read and decoded as the first one is, then
        dropped: the reference's answer to one that is cut short, flagged compressed,
        too long or undecodable is that error's status, not the reply. Reading them
        gives the loop back every :data:`UNARY_SLICE_SECONDS` (grpclib's buffered reads
        do not), so a request of a million messages stalls no other call.
        """
        data = await self._read_unary(stream, limit)
        if data is None:
            raise GRPCError(Status.INTERNAL, MISSING_MESSAGE)
        request = await self._decoded(data, decode)
        if to_the_end:
            # A wall clock, not the loop's: uvloop's time() stands still within a callback.
            slice_end = time.monotonic() + UNARY_SLICE_SECONDS
            while (more := await self._read_unary(stream, limit)) is not None:
                if more:
                    await self._decoded(more, decode)
                if time.monotonic() >= slice_end:
                    await asyncio.sleep(UNARY_PAUSE_SECONDS)
                    slice_end = time.monotonic() + UNARY_SLICE_SECONDS
        return request

    async def _decoded(self, data: bytes | bytearray, decode: Callable[[Any], Any]) -> Any:
        if len(data) > OFF_LOOP_DECODE_BYTES:
            return await self.off_loop(decode, data)
        return decode(data)

    async def _handshake(self, stream: Stream[bytes, bytes]) -> None:
        request = await self._decode_unary(stream, decode_handshake_request)
        response = self.endpoint.handshake(request)
        await stream.send_message(bytes(response))
        await stream.send_trailing_metadata()

    async def _shutdown(self, stream: Stream[bytes, bytes]) -> None:
        request = await self._decode_unary(stream, decode_shutdown_request)
        response, stop = self.endpoint.shutdown(request)
        self._stop_accepted = self._stop_accepted or stop  # before the client can know it
        await stream.send_message(bytes(response))
        await stream.send_trailing_metadata()
        if stop:
            self.request_stop("remote shutdown accepted")

    async def _health_check(self, stream: Stream[bytes, bytes]) -> None:
        # Bounded to a few KiB: the health check needs no token, so it is anyone's.
        # Answered at its first message: the reference has no health service to follow,
        # and a probe's answer waits for nothing (more is never read).
        service = await self._decode_unary(
            stream, decode_health_request, HEALTH_MAX_BYTES, to_the_end=False
        )
        if service not in ("", SERVICE_NAME):
            raise UnknownServiceError(service)
        unhealthy = self.closing or not self.lanes.healthy
        status = HEALTH_NOT_SERVING if unhealthy else HEALTH_SERVING
        await stream.send_message(health_response(status))
        await stream.send_trailing_metadata()
        # Answered before the client's END_STREAM (RFC 9113 §8.1): RST_STREAM(NO_ERROR),
        # else the stream stays half-open and such calls add up to h2's limit, which
        # then closes the connection with every call on it.
        reset_if_open(stream)

    async def _unknown(self, stream: Stream[bytes, bytes]) -> None:
        raise UnknownMethodError()

    async def _join(self, stream: Stream[bytes, bytes]) -> None:
        if self.closing or self.join is not None:
            if self.metrics is not None:
                self.metrics.session(admitted=False)
            raise ServerStoppingError() if self.closing else AlreadyJoinedError()
        if self.metrics is not None:
            self.metrics.session(admitted=True)
        call = JoinCall(self.join_context, stream)
        self.join = call
        self._arm_idle()
        try:
            await call.run()
        finally:
            self.join = None
            self._changed.set()
            self._arm_idle()
