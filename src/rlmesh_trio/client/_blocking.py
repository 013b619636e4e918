"""The blocking driver behind the gymnasium adapters: the same protocol core on a plain
socket, in the caller's thread (no event loop, no helper thread to leak).

Several requests go out together and the driver reads until every one is answered, so a
vector step that resets some lanes and steps the others is one round trip.

A :class:`BlockingEndpoint` that becomes garbage without ``close()`` drops its connection
from a finalizer (:meth:`BlockingConnection.drop`: no request, no wait), so the server
frees its one Join session at once; docs/client.md has the rule.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._tls import check_alpn
from .._wire._protocol import HANDSHAKE_PATH, JOIN_PATH
from ._codecs import late, reply_deadline
from ._contract import Contract, contract_from_handshake
from ._core import JoinStream, Slot, call_failure, result_of
from ._errors import ConnectionLostError, EndpointClosedError, EndpointError, EnvError
from ._grpc import Call, GrpcConnection
from ._messages import Episode, Reply, close_request, configure_request, handshake_request
from ._settings import (
    ConnectionSettings,
    Target,
    metadata,
    no_ping_answer,
    tls_context,
    tls_failure,
    transport_failure,
)

__all__ = ["BlockingConnection", "BlockingEndpoint", "Submitted", "handshake", "unary_result"]

_READ_SIZE = 256 * 1024
_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


class BlockingConnection:
    """One HTTP/2 connection driven synchronously: connect (TCP or unix; TLS when asked),
    write what h2 has, read until a condition holds (keep-alive PINGs while waiting),
    unary calls. ``after`` runs after every read (the endpoint routes Join replies)."""

    def __init__(self, target: Target, settings: ConnectionSettings) -> None:
        self.target = target
        self._tls = tls_context(target, settings.tls)
        self._ping_interval = settings.ping_interval_seconds
        self._ping_timeout = settings.ping_timeout_seconds
        self.conn = GrpcConnection(
            target.authority, metadata(settings.auth_token), tls=self._tls is not None
        )
        self.after: Callable[[], None] = _noop
        self.reads = 0
        """How many reads :meth:`pump` has fed to the connection (a vector over several
        endpoints waits for the next read of whichever socket has data)."""
        self._quickack = False
        self.sock: socket.socket | None = self._connect(settings.connect_timeout_seconds)

    def _connect(self, timeout: float) -> socket.socket:
        target = self.target
        try:
            if target.path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(timeout)
                    sock.connect(target.path)
                except BaseException:
                    sock.close()
                    raise
            else:
                assert target.host is not None and target.port is not None
                sock = socket.create_connection((target.host, target.port), timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._quickack = _QUICKACK is not None
        except OSError as exc:
            raise ConnectionLostError(f"cannot connect to {target}: {exc}") from exc
        if self._tls is None:
            return sock
        try:
            # The socket's timeout (connect_timeout) bounds the handshake too.
            secure = self._tls.wrap_socket(sock, server_hostname=target.host)
        except (OSError, ValueError) as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                raise ConnectionLostError(
                    f"TLS handshake with {target}: no answer within {timeout:g} s"
                ) from None
            raise tls_failure(target, exc) from None
        try:
            check_alpn(secure.selected_alpn_protocol(), str(target))
        except ConnectionError as exc:
            secure.close()
            raise ConnectionLostError(str(exc)) from None
        return secure

    @property
    def ping_interval_seconds(self) -> float:
        return self._ping_interval

    def flush(self, deadline: float | None = None) -> None:
        data = self.conn.data_to_send()
        if not data or self.sock is None:
            return
        try:
            self.sock.settimeout(
                60.0 if deadline is None else max(0.001, deadline - time.monotonic())
            )
            self.sock.sendall(data)
        except OSError as exc:
            self._lose_to(exc, "connection lost while writing")

    def _lose_to(self, exc: OSError, what: str) -> None:
        self.conn.lose(transport_failure(self.conn, exc, what))

    def pump(self, done: Callable[[], bool], deadline: float | None, what: str) -> None:
        """Read until ``done()`` holds; PING after ``ping_interval`` s of silence and
        give up if the PING is not answered in time, or at ``deadline``."""
        sock = self.sock
        assert sock is not None
        conn = self.conn
        ping_deadline: float | None = None
        acked = conn.pings_acked
        while not done():
            if conn.lost is not None:
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise ConnectionLostError(f"{what}: no answer in time")
            limit = ping_deadline if ping_deadline is not None else now + self._ping_interval
            if deadline is not None:
                limit = min(limit, deadline)
            try:
                sock.settimeout(max(0.001, limit - now))
                data = sock.recv(_READ_SIZE)
            except TimeoutError:
                if ping_deadline is not None and time.monotonic() >= ping_deadline:
                    conn.lose(no_ping_answer(self._ping_interval, self._ping_timeout))
                    self.after()
                    return
                if ping_deadline is None and (deadline is None or time.monotonic() < deadline):
                    acked = conn.pings_acked
                    conn.ping(b"rlt-ping")
                    ping_deadline = time.monotonic() + self._ping_timeout
                    self.flush()
                continue
            except OSError as exc:
                self._lose_to(exc, "connection lost")
                self.after()
                return
            if data and self._quickack:  # see _endpoint._quickack
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)  # type: ignore[arg-type]
            self.reads += 1
            conn.receive(data)
            if conn.pings_acked > acked:
                ping_deadline = None
            self.after()
            self.flush()

    def unary(self, path: str, payload: bytes, deadline: float) -> Call:
        """One unary call, answered (or ended) by ``deadline``; the ended :class:`Call`."""
        call: Call = self.conn.open(path)
        self.conn.send(call, payload, end=True)
        self.flush(deadline)
        self.pump(lambda: call.ended, deadline, path.rsplit("/", 1)[-1])
        self.conn.forget(call)
        return call

    def close(self) -> None:
        """GOAWAY (bounded to 1 s) and close the socket. Idempotent."""
        sock, self.sock = self.sock, None
        if sock is None:
            return
        self.conn.close()
        with contextlib.suppress(OSError):
            sock.settimeout(1.0)
            sock.sendall(self.conn.data_to_send())
        with contextlib.suppress(OSError):
            sock.close()

    def drop(self) -> None:
        """Close without waiting for anything: GOAWAY only if the socket takes it at once,
        then close. Never blocks, so it may run on any thread, from a finalizer or the
        cycle collector (in a Trio program's thread too). Idempotent."""
        sock, self.sock = self.sock, None
        if sock is None:
            return
        self.conn.close()
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(self.conn.data_to_send())
        with contextlib.suppress(OSError):
            sock.close()


def handshake(address: str, settings: ConnectionSettings) -> Contract:
    """What the endpoint at ``address`` serves: one Handshake on a connection of its
    own, closed after (no Join: the endpoint's session is not taken)."""
    settings.check(closing=False)
    target = Target.parse(address)
    connect_timeout_seconds = settings.connect_timeout_seconds
    deadline = time.monotonic() + connect_timeout_seconds
    link = BlockingConnection(target, settings)
    try:
        link.flush(deadline)
        try:
            call = link.unary(HANDSHAKE_PATH, handshake_request(), deadline)
        except ConnectionLostError:
            if time.monotonic() < deadline or link.conn.lost is not None:
                raise
            raise ConnectionLostError(
                f"no Handshake answer from {target} within "
                f"connect_timeout_seconds={connect_timeout_seconds:g}"
            ) from None
        return contract_from_handshake(unary_result(call, shutting_down=link.conn.shutting_down))
    finally:
        link.close()


def unary_result(call: Call, *, shutting_down: bool = False) -> bytes | None:
    """The reply of an OK unary call; raises what ended it otherwise."""
    if call.status == 0 and call.messages:
        return call.messages[0]
    raise call_failure(call, f"{call.path.rsplit('/', 1)[-1]} failed", shutting_down=shutting_down)


_OPEN: weakref.WeakSet[BlockingEndpoint] = weakref.WeakSet()
"""This process's blocking endpoints that are neither closed nor finalized."""


def _collect_abandoned(target: Target) -> None:
    """Let the cycle collector finalize an unclosed client of ``target`` that is garbage.

    An endpoint admits one Join session. A client of it that this process still holds
    open is either in use (the new Join is refused whatever we do) or garbage kept only by
    a reference cycle (a wrapper that raised in its constructor, say), which nothing but
    the collector frees; its finalizer then drops the connection before we ask."""
    if _holds(str(target)):
        gc.collect()


def _holds(address: str) -> bool:
    # A function of its own: no strong reference to an endpoint outlives it (the
    # collector must find the garbage ones unreferenced).
    return any(str(ep.target) == address for ep in list(_OPEN))


@dataclass(frozen=True)
class Submitted:
    """Requests written by :meth:`BlockingEndpoint.submit_each`, not yet answered."""

    slots: list[tuple[str, Slot]]
    kinds: list[str]
    deadline: float | None
    timeout_ms: int | None


class BlockingEndpoint:
    """One joined endpoint driven synchronously.

    Garbage without :meth:`close`: a finalizer drops the connection (no Close request,
    never blocking; on whatever thread drops the last reference or runs the collector),
    so the server frees the session at once. Not at interpreter exit: an endpoint still
    referenced then may be in use on another thread; the OS closes its socket.
    """

    def __init__(self, address: str, settings: ConnectionSettings) -> None:
        settings.check()
        self.target = Target.parse(address)
        self._close_timeout = settings.close_timeout_seconds
        self._closed: list[Episode] | None = None
        _collect_abandoned(self.target)
        deadline = time.monotonic() + settings.connect_timeout_seconds
        self._link = BlockingConnection(self.target, settings)
        # The finalizer holds the connection, never the endpoint (nor anything that
        # refers back to it), or the endpoint could never become garbage.
        self._finalizer = weakref.finalize(self, self._link.drop)
        self._finalizer.atexit = False
        _OPEN.add(self)
        self._conn = self._link.conn
        try:
            self._link.flush(deadline)
            try:
                call = self._link.unary(HANDSHAKE_PATH, handshake_request(), deadline)
                contract = contract_from_handshake(
                    unary_result(call, shutting_down=self._conn.shutting_down)
                )
                join = self._conn.open(JOIN_PATH)
                self.state = JoinStream(self._conn, join, contract)
                self._link.after = self.state.process
                self.roundtrip([configure_request], ["configure"], deadline=deadline)
            except ConnectionLostError:
                if time.monotonic() < deadline or self._conn.lost is not None:
                    raise
                raise ConnectionLostError(
                    f"no session with {self.target} within "
                    f"connect_timeout_seconds={settings.connect_timeout_seconds:g}"
                ) from None
        except BaseException:
            self._shut()
            raise

    # ---- requests ---------------------------------------------------------------------

    def roundtrip(
        self,
        builders: Sequence[object],
        kinds: Sequence[str],
        *,
        deadline: float | None = None,
        timeout_ms: int | None = None,
        lanes: Sequence[Sequence[int] | None] | None = None,
    ) -> list[Reply]:
        """Send one request per builder (``builder(request_id) -> bytes``) at once and
        return their replies in the same order; the first error is raised after all
        have been answered (so none is left in flight)."""
        replies: list[Reply] = []
        for answer in self.roundtrip_each(
            builders, kinds, deadline=deadline, timeout_ms=timeout_ms, lanes=lanes
        ):
            if isinstance(answer, EndpointError):
                raise answer
            replies.append(answer)
        return replies

    def roundtrip_each(
        self,
        builders: Sequence[object],
        kinds: Sequence[str],
        *,
        deadline: float | None = None,
        timeout_ms: int | None = None,
        lanes: Sequence[Sequence[int] | None] | None = None,
    ) -> list[Reply | EndpointError]:
        """As :meth:`roundtrip`, but each request's reply or error, in order.
        ``timeout_ms``: the requests' own deadline; a request not answered within it plus
        the grace gets :class:`RequestTimeoutError` (its reply abandoned). ``lanes``: the
        lanes each request addresses (None: every lane; omitted: none, a session
        request), to name them in errors."""
        return self.finish(
            self.submit_each(builders, kinds, timeout_ms=timeout_ms, lanes=lanes, deadline=deadline)
        )

    def submit_each(
        self,
        builders: Sequence[object],
        kinds: Sequence[str],
        *,
        deadline: float | None = None,
        timeout_ms: int | None = None,
        lanes: Sequence[Sequence[int] | None] | None = None,
    ) -> Submitted:
        """The first half of :meth:`roundtrip_each`: the requests written, not waited
        for (:meth:`finish` reads their answers). A vector env over several endpoints
        submits to each before it finishes any, so that they all work at once."""
        state = self.state
        if timeout_ms:
            limit = reply_deadline(timeout_ms)
            assert limit is not None
            mine = time.monotonic() + limit
            deadline = mine if deadline is None else min(deadline, mine)
        slots: list[tuple[str, Slot]] = []
        for i, (build, kind) in enumerate(zip(builders, kinds, strict=True)):
            rid = state.next_id()
            assert callable(build)
            addressed = () if lanes is None else lanes[i]
            slots.append((rid, state.submit(build(rid), rid, _noop, verb=kind, lanes=addressed)))
        self._link.flush()
        return Submitted(slots, list(kinds), deadline, timeout_ms)

    def finish(self, submitted: Submitted) -> list[Reply | EndpointError]:
        """The second half of :meth:`roundtrip_each`: read until every request of
        ``submitted`` is answered (or its deadline passed); each one's reply or error."""
        state = self.state
        slots, kinds, timeout_ms = submitted.slots, submitted.kinds, submitted.timeout_ms
        try:
            self._link.pump(
                lambda: all(s.reply is not None or s.error is not None for _, s in slots),
                submitted.deadline,
                "request",
            )
        except ConnectionLostError:
            if timeout_ms is None or self._link.conn.lost is not None:
                raise
            # Past the caller's own deadline (timeout_ms plus the grace): give up.
            for rid, slot in slots:
                if slot.reply is None and slot.error is None:
                    state.abandon(rid)
                    slot.error = late(kinds[0] if len(set(kinds)) == 1 else "request", timeout_ms)
        for _rid, slot in slots:
            if slot.reply is None and slot.error is None:
                state.process()
        answers: list[Reply | EndpointError] = []
        for (_rid, slot), kind in zip(slots, kinds, strict=True):
            try:
                answers.append(result_of(slot, kind))
            except EndpointError as exc:
                answers.append(exc)
        return answers

    def flush(self) -> None:
        """Write the requests submitted to :attr:`state` (the pool's sends)."""
        self._link.flush()

    def wait(self, done: Callable[[], bool], deadline: float | None) -> None:
        """Read until ``done()`` holds, the connection is lost, or ``deadline``
        (``time.monotonic()``) passes."""
        try:
            self._link.pump(done, deadline, "recv")
        except ConnectionLostError:
            if deadline is None or self._conn.lost is not None:
                raise
        if self._conn.lost is not None:
            self.state.process()  # the pending requests fail with the connection

    @property
    def link(self) -> BlockingConnection:
        """The connection (its socket, for a wait over several endpoints)."""
        return self._link

    def close(self, reason: str = "client close") -> list[Episode]:
        if self._closed is not None:
            return self._closed
        episodes: list[Episode] = []
        state = getattr(self, "state", None)
        if (
            state is not None
            and (state.failure is None or isinstance(state.failure, EnvError))
            and not state.join.ended
            and self._conn.lost is None
        ):
            # Also after a fatal env error that left the stream open (see aclose).
            deadline = time.monotonic() + self._close_timeout
            with contextlib.suppress(EndpointError):
                replies = self.roundtrip(
                    [lambda rid: close_request(rid, reason)], ["close"], deadline=deadline
                )
                episodes = replies[0].episodes
                # The server ends the stream after its reply: then a new Join is admitted.
                self._link.pump(lambda: state.join.ended, deadline, "close")
        if state is not None:
            state.closing = True
            state.fail(EndpointClosedError())
        self._shut()
        self._closed = episodes
        return episodes

    def _shut(self) -> None:
        """Close the connection; nothing left for the finalizer."""
        self._link.close()
        self._finalizer.detach()
        _OPEN.discard(self)

    def _forsake(self) -> None:
        """In a forked child: this endpoint's connection is the parent's. Close the
        child's copy of its socket, sending nothing (a GOAWAY or a Close from here would
        end the parent's session), and never finalize it."""
        self._finalizer.detach()
        sock, self._link.sock = self._link.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        why = "this client was opened by the parent process (a fork): open one here"
        self._conn.lose(why)
        state = getattr(self, "state", None)
        if state is not None:
            state.fail(ConnectionLostError(why))

    def _teardown(self) -> None:
        """Drop the connection now, as the finalizer would (no request, never blocks):
        for an owner's own finalizer."""
        self._finalizer()
        _OPEN.discard(self)


def _noop() -> None:
    pass


def _after_fork_in_child() -> None:
    """A forked child (``multiprocessing``'s fork, ``AsyncVectorEnv`` of a trainer)
    inherits every open client's socket. An HTTP/2 connection has one peer: the child
    closes its copies without writing a byte, so the parent's sessions go on, and a
    parent that closes its client really closes the connection."""
    for ep in list(_OPEN):
        ep._forsake()
    _OPEN.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
