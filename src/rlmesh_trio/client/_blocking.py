"""The blocking driver behind the gymnasium adapters: the same protocol core on a plain
socket, in the caller's thread (no event loop, no helper thread to leak).

Several requests go out together and the driver reads until every one is answered, so a
vector step that resets some lanes and steps the others is one round trip.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Sequence

from ._core import (
    HANDSHAKE_PATH,
    JOIN_PATH,
    JoinState,
    Slot,
    Target,
    call_failure,
    contract_from_handshake,
    metadata,
    result_of,
)
from ._errors import ConnectionLostError, EndpointClosedError, EndpointError
from ._grpc import Call, GrpcConnection
from ._messages import Episode, Reply, close_request, configure_request, handshake_request

__all__ = ["BlockingEndpoint"]

_READ_SIZE = 256 * 1024
_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


class BlockingEndpoint:
    """One joined endpoint driven synchronously."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None,
        connect_timeout: float,
        ping_interval: float,
        ping_timeout: float,
        close_timeout: float,
    ) -> None:
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("ping_interval", ping_interval),
            ("ping_timeout", ping_timeout),
            ("close_timeout", close_timeout),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0")
        self.target = Target.parse(address)
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self._close_timeout = close_timeout
        self._conn = GrpcConnection(self.target.authority, metadata(token))
        self._sock: socket.socket | None = None
        self._closed: list[Episode] | None = None
        self._quickack = False
        deadline = time.monotonic() + connect_timeout
        try:
            self._sock = self._connect(connect_timeout)
            self._flush(deadline)
            contract = contract_from_handshake(
                self._unary(HANDSHAKE_PATH, handshake_request(), deadline)
            )
            join = self._conn.open(JOIN_PATH)
            self.state = JoinState(self._conn, join, contract)
            self.roundtrip([configure_request], ["configure"], deadline=deadline)
        except BaseException:
            self._teardown()
            raise

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
            raise ConnectionLostError(f"cannot connect to {target}: {exc}") from None
        return sock

    # ---- I/O --------------------------------------------------------------------------

    def _flush(self, deadline: float | None = None) -> None:
        data = self._conn.data_to_send()
        if not data or self._sock is None:
            return
        try:
            self._sock.settimeout(
                60.0 if deadline is None else max(0.001, deadline - time.monotonic())
            )
            self._sock.sendall(data)
        except OSError as exc:
            self._conn.lose(f"connection lost while writing: {exc!r}")

    def _pump(self, done: object, deadline: float | None, what: str) -> None:
        """Read until ``done()`` holds; PING after ``ping_interval`` s of silence and
        give up if the PING is not answered in time, or at ``deadline``."""
        sock = self._sock
        assert sock is not None and callable(done)
        ping_deadline: float | None = None
        acked = self._conn.pings_acked
        while not done():
            if self._conn.lost is not None:
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
                    self._conn.lose(
                        f"no answer to a keep-alive PING within {self._ping_timeout:g} s"
                    )
                    self._after()
                    return
                if ping_deadline is None and (deadline is None or time.monotonic() < deadline):
                    acked = self._conn.pings_acked
                    self._conn.ping(b"rlt-ping")
                    ping_deadline = time.monotonic() + self._ping_timeout
                    self._flush()
                continue
            except OSError as exc:
                self._conn.lose(f"connection lost: {exc!r}")
                self._after()
                return
            if data and self._quickack:  # see _endpoint._quickack
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)  # type: ignore[arg-type]
            self._conn.receive(data)
            if self._conn.pings_acked > acked:
                ping_deadline = None
            self._after()
            self._flush()

    def _after(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.process()

    def _unary(self, path: str, payload: bytes, deadline: float) -> bytes | None:
        call: Call = self._conn.open(path)
        self._conn.send(call, payload, end=True)
        self._flush(deadline)
        self._pump(lambda: call.ended, deadline, path.rsplit("/", 1)[-1])
        self._conn.forget(call)
        if call.status == 0 and call.messages:
            return call.messages[0]
        raise call_failure(call, f"{path.rsplit('/', 1)[-1]} failed")

    # ---- requests ---------------------------------------------------------------------

    def roundtrip(
        self,
        builders: Sequence[object],
        kinds: Sequence[str],
        *,
        deadline: float | None = None,
    ) -> list[Reply]:
        """Send one request per builder (``builder(request_id) -> bytes``) at once and
        return their replies in the same order; the first error is raised after all
        have been answered (so none is left in flight)."""
        state = self.state
        slots: list[tuple[str, Slot]] = []
        for build in builders:
            rid = state.next_id()
            assert callable(build)
            slots.append((rid, state.submit(build(rid), rid, _noop)))
        self._flush()
        self._pump(
            lambda: all(s.reply is not None or s.error is not None for _, s in slots),
            deadline,
            "request",
        )
        for _rid, slot in slots:
            if slot.reply is None and slot.error is None:
                state.process()
        replies: list[Reply] = []
        first: BaseException | None = None
        for (_rid, slot), kind in zip(slots, kinds, strict=True):
            try:
                replies.append(result_of(slot, kind))
            except EndpointError as exc:
                if first is None:
                    first = exc
        if first is not None:
            raise first
        return replies

    def close(self, reason: str = "client close") -> list[Episode]:
        if self._closed is not None:
            return self._closed
        episodes: list[Episode] = []
        state = getattr(self, "state", None)
        if state is not None and state.failure is None and not state.join.ended:
            with contextlib.suppress(EndpointError):
                replies = self.roundtrip(
                    [lambda rid: close_request(rid, reason)],
                    ["close"],
                    deadline=time.monotonic() + self._close_timeout,
                )
                episodes = replies[0].episodes
        if state is not None:
            state.closing = True
            state.fail(EndpointClosedError())
        self._teardown()
        self._closed = episodes
        return episodes

    def _teardown(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        self._conn.close()
        with contextlib.suppress(OSError):
            sock.settimeout(1.0)
            sock.sendall(self._conn.data_to_send())
        with contextlib.suppress(OSError):
            sock.close()


def _noop() -> None:
    pass
