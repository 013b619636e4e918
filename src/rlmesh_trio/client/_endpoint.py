"""The Trio client's :class:`Endpoint` (made by :func:`._opening.open_endpoint`).

One HTTP/2 connection on a Trio stream (TCP or unix socket), driven by ``h2`` in this
thread: no asyncio, no helper thread. A reader task routes replies to waiting callers by
``request_id``, so lane-scoped requests from many tasks are in flight at once.
"""

from __future__ import annotations

import contextlib
import math
import socket
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import trio
from gymnasium.vector import AutoresetMode

from .._tls import check_alpn
from .._wire._protocol import HANDSHAKE_PATH, JOIN_PATH
from ._codecs import (
    decode_frame,
    lanes_of,
    late,
    reply_deadline,
    request_seeds,
    step_arrays,
    timeout_of,
)
from ._contract import Contract, contract_from_handshake
from ._core import (
    JoinStream,
    Slot,
    call_failure,
    check_options,
    result_of,
)
from ._errors import ConnectionLostError, EndpointClosedError, EndpointError
from ._grpc import GrpcConnection
from ._messages import (
    Episode,
    close_request,
    configure_request,
    handshake_request,
    render_request,
    reset_request,
    step_request,
)
from ._pool import AsyncPool, Batch
from ._settings import (
    ConnectionSettings,
    Target,
    metadata,
    no_ping_answer,
    tls_failure,
    transport_failure,
)

__all__ = ["Endpoint"]

WRITE_TIMEOUT = 60.0
"""Seconds one socket write may block (a server that stops reading) before the
connection is declared lost."""

_READ_SIZE = 256 * 1024
_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


def _quickack(stream: trio.SocketStream) -> None:
    """Acknowledge what was just read at once (Linux ``TCP_QUICKACK``, which the kernel
    clears again by itself). Servers that leave Nagle on (rlmesh 0.1.0's) otherwise hold
    their next reply until our delayed ACK fires, 40 ms later, whenever two replies are
    in flight; measured: 4 pipelined lanes at 81 env steps/s without it, 1396 with."""
    assert _QUICKACK is not None
    with contextlib.suppress(OSError):
        stream.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)


class Endpoint:
    """A joined rlmesh-wire-v1 endpoint; made by :func:`open_endpoint`.

    Batched arguments and results are in ``env_indices`` order (leading dimension
    ``len(env_indices)``, or ``num_envs`` when ``env_indices`` is None), as gymnasium
    vector envs batch them. Requests with ``env_indices`` are lane-scoped: the server
    runs them concurrently and they may complete in any order; without, they address the
    whole vector and the server serialises them. (Its constructor is internal: it takes
    the parsed target, the connection's settings and its TLS context from
    :func:`open_endpoint`.)
    """

    def __init__(
        self,
        target: Target,
        settings: ConnectionSettings,
        *,
        tls: ssl.SSLContext | None = None,
        batch_size: int | None = None,
        autoreset_mode: AutoresetMode = AutoresetMode.NEXT_STEP,
    ) -> None:
        self._pool_args = (batch_size, autoreset_mode)
        self._pool: AsyncPool | None = None
        self._target = target
        self._conn = GrpcConnection(
            target.authority, metadata(settings.auth_token), tls=tls is not None
        )
        self._tls = tls
        self._stream: trio.abc.Stream | None = None
        self._socket_stream: trio.SocketStream | None = None
        self._outbuf = bytearray()
        self._sending = False
        self._read_scope: trio.CancelScope | None = None
        self._quickack = False
        self._unary: dict[int, trio.Event] = {}
        self._state: JoinStream | None = None
        self._ping_interval = settings.ping_interval_seconds
        self._ping_timeout = settings.ping_timeout_seconds
        self._close_timeout = settings.close_timeout_seconds
        self._received = trio.Event()
        """Set by the next read (or loss) of the connection: :meth:`_wait_stream_end`."""
        self._reader_done = trio.Event()
        self._closed: list[Episode] | None = None

    # ---- public surface ------------------------------------------------------------

    @property
    def contract(self) -> Contract:
        """What the endpoint serves (id, num_envs, spaces, modes, capabilities)."""
        return self._joined().contract

    @property
    def num_envs(self) -> int:
        """How many lanes (sub-envs) the endpoint serves."""
        return self._joined().contract.num_envs

    @property
    def single_observation_space(self) -> gym.spaces.Space[Any]:
        """One lane's observation space (from the contract)."""
        return self._joined().contract.observation_space

    @property
    def single_action_space(self) -> gym.spaces.Space[Any]:
        """One lane's action space (from the contract)."""
        return self._joined().contract.action_space

    @property
    def address(self) -> str:
        """Where the endpoint is (``tcp://host:port`` or ``unix:///path``)."""
        return str(self._target)

    @property
    def closed(self) -> bool:
        """The endpoint takes no more requests (closed, or failed by a fatal error)."""
        state = self._state
        return state is None or state.failure is not None or state.closing

    def pop_completed_episodes(self) -> list[Episode]:
        """Episodes the server reported in step replies since the last call (finished
        ones with their ``final_info``, and interrupted ones); at most the latest 65536
        are kept between calls."""
        state = self._joined()
        episodes = list(state.completed)
        state.completed.clear()
        return episodes

    async def reset(
        self,
        *,
        seeds: int | Sequence[int | None] | None = None,
        options: Mapping[str, Any] | None = None,
        env_indices: Sequence[int] | None = None,
        timeout_ms: int | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the addressed lanes; returns ``(observations, infos)``.

        ``seeds``: None, an int (lane i of the request gets ``seed + i``, as gymnasium),
        or one int per addressed lane. ``options`` reach every addressed env's
        ``reset(options=...)``. ``timeout_ms``: the server's deadline for the env call
        (0/None: none) — a late one answers TIMEOUT (recoverable).
        """
        state = self._joined()
        lanes = lanes_of(env_indices, state.contract.num_envs)
        k = state.contract.num_envs if lanes is None else len(lanes)
        pool = self._pooled().core
        pool.check_idle(lanes, "reset()")
        rid = state.next_id()
        timeout = timeout_of(timeout_ms)
        payload = reset_request(
            rid,
            seeds=request_seeds(seeds, k),
            options=check_options(options),
            timeout_ms=timeout,
            env_indices=lanes or (),
        )
        reply = result_of(await self._call(payload, rid, "reset", timeout, lanes), "reset")
        observations = state.codecs.observation_batch(reply.leaves, k)
        pool.note_reset(lanes or range(k), pool.rows(observations, k))
        return observations, reply.infos

    async def step(
        self,
        actions: Any,
        *,
        env_indices: Sequence[int] | None = None,
        timeout_ms: int | None = None,
    ) -> tuple[
        Any, np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], dict[str, Any]
    ]:
        """Step the addressed lanes with batched ``actions``; returns
        ``(observations, rewards, terminated, truncated, infos)``."""
        state = self._joined()
        lanes = lanes_of(env_indices, state.contract.num_envs)
        k = state.contract.num_envs if lanes is None else len(lanes)
        pool = self._pooled().core
        pool.check_idle(lanes, "step()")
        leaves = state.codecs.encode_actions(actions, k)
        rid = state.next_id()
        timeout = timeout_of(timeout_ms)
        payload = step_request(rid, leaves, timeout_ms=timeout, env_indices=lanes or ())
        reply = result_of(await self._call(payload, rid, "step", timeout, lanes), "step")
        rewards, terminated, truncated = step_arrays(reply, k)
        state.completed.extend(reply.episodes)
        observations = state.codecs.observation_batch(reply.leaves, k)
        rows = pool.rows(observations, k)
        pool.note_step(lanes or range(k), rows, terminated | truncated)
        return observations, rewards, terminated, truncated, reply.infos

    @property
    def batch_size(self) -> int:
        """How many lanes :meth:`recv` returns (``open_endpoint(batch_size=)``)."""
        return self._pooled().core.batch_size

    async def send(
        self,
        actions: Any,
        env_indices: Sequence[int] | None = None,
        *,
        timeout_ms: int | None = None,
    ) -> None:
        """Step the lanes ``env_indices`` (None: all), one lane-scoped request each,
        and return once they are written; :meth:`recv` returns the results.

        ``actions`` are batched in ``env_indices`` order. A lane that finished its
        episode is reset instead (autoreset NEXT_STEP, its action ignored); SAME_STEP
        resets it with the step; DISABLED refuses it until :meth:`reset`. A lane with
        a request in flight, or a result not yet received, is refused
        (:class:`LaneBusyError`); nothing is sent then. See docs/client.md.
        """
        await self._pooled().send(actions, env_indices, timeout_ms)

    async def recv(self) -> Batch:
        """The next ``batch_size`` lanes that finished (all of those in flight if
        fewer are), as ``(observations, rewards, terminated, truncated, infos)``
        batched in lane order; ``infos["env_id"]`` names the lanes. A lane's error is
        raised (:class:`LaneError` for a recoverable env error: that lane is idle
        again; the other lanes' results wait for the next call). Cancelling it loses
        nothing: the results come with the next call."""
        return await self._pooled().recv()

    async def render(
        self, lane: int = 0, *, timeout_ms: int | None = None
    ) -> np.ndarray[Any, Any] | None:
        """Lane ``lane``'s frame as an ``(H, W, 3)`` uint8 array (``(H, W, 4)`` for an RGBA
        frame, ``(H, W)`` for a gray one); None if the env renders nothing (no render
        mode). The 0.1.0 servers render lane 0 only."""
        state = self._joined()
        lanes_of([lane], state.contract.num_envs)
        rid = state.next_id()
        timeout = timeout_of(timeout_ms)
        payload = render_request(rid, [int(lane)], timeout_ms=timeout)
        slot = await self._call(payload, rid, "render", timeout, [int(lane)])
        return decode_frame(result_of(slot, "render"))

    async def aclose(self, reason: str = "client close") -> list[Episode]:
        """Close the session: the server reports every episode not yet reported
        (interrupted and active ones, ``truncated=True``) and they are returned, and ends
        the Join stream. Then the connection is closed. After a fatal env error that
        left the stream open (a lane-scoped request's), the session is closed the same
        way. Idempotent; bounded by the endpoint's close timeout."""
        if self._closed is not None:
            return self._closed
        episodes: list[Episode] = []
        state = self._state
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self._close_timeout):
                if (
                    state is not None
                    and not state.closing
                    and not state.join.ended
                    and self._conn.lost is None
                ):
                    rid = state.next_id()
                    try:
                        slot = state.submit(close_request(rid, reason), rid, _noop, verb="close")
                        self._arm_keepalive()
                        state.closing = True
                        await self._flush()
                        await self._wait_slot(slot, rid)
                        episodes = result_of(slot, "close").episodes
                        # The server ends the stream after its reply: once it has, its
                        # session is over and a new Join is admitted at once.
                        await self._wait_stream_end(state)
                    except EndpointError:
                        pass
            if state is not None:
                state.closing = True
                state.fail(EndpointClosedError())
            await self._shutdown()  # bounded on its own (1 s), even after a close timeout
        self._closed = episodes
        return episodes

    # ---- driver -------------------------------------------------------------------

    def _pooled(self) -> AsyncPool:
        self._joined()
        assert self._pool is not None
        return self._pool

    def _joined(self) -> JoinStream:
        if self._state is None:
            raise EndpointClosedError("the endpoint is not joined")
        return self._state

    async def _start(self, nursery: trio.Nursery) -> None:
        target = self._target
        try:
            if target.path is not None:
                self._stream = await trio.open_unix_socket(target.path)
            else:
                assert target.host is not None and target.port is not None
                tcp = await trio.open_tcp_stream(target.host, target.port)
                self._stream = self._socket_stream = tcp
                self._quickack = _QUICKACK is not None
        except OSError as exc:
            raise ConnectionLostError(f"cannot connect to {target}: {exc}") from None
        if self._tls is not None:
            await self._secure()
        nursery.start_soon(self._reader)
        await self._flush()  # connection preface and SETTINGS
        contract = contract_from_handshake(
            await self._unary_call(HANDSHAKE_PATH, handshake_request())
        )
        join = self._conn.open(JOIN_PATH)
        self._state = state = JoinStream(self._conn, join, contract)
        rid = state.next_id()
        slot = state.submit(configure_request(rid), rid, _noop, verb="configure")
        self._arm_keepalive()
        await self._flush()
        await self._wait_slot(slot, rid)
        result_of(slot, "configure")
        batch_size, autoreset_mode = self._pool_args
        self._pool = AsyncPool(self, batch_size=batch_size, autoreset_mode=autoreset_mode)

    async def _secure(self) -> None:
        """The TLS handshake (bounded by the caller's connect timeout); ALPN must say h2."""
        assert self._tls is not None and self._socket_stream is not None
        target = self._target
        stream = trio.SSLStream(self._socket_stream, self._tls, server_hostname=target.host)
        self._stream = stream
        try:
            await stream.do_handshake()
            check_alpn(stream.selected_alpn_protocol(), str(target))
        except (trio.BrokenResourceError, OSError) as exc:
            raise tls_failure(target, exc) from None
        except ConnectionError as exc:
            raise ConnectionLostError(str(exc)) from None

    async def _unary_call(self, path: str, payload: bytes) -> bytes | None:
        call = self._conn.open(path)
        event = self._unary[call.id] = trio.Event()
        try:
            self._conn.send(call, payload, end=True)
            self._arm_keepalive()
            await self._flush()
            await event.wait()
        finally:
            self._unary.pop(call.id, None)
            self._conn.forget(call)
        if call.status == 0 and call.messages:
            return call.messages[0]
        raise call_failure(
            call, f"{path.rsplit('/', 1)[-1]} failed", shutting_down=self._conn.shutting_down
        )

    async def _call(
        self, payload: bytes, rid: str, verb: str, timeout_ms: int, lanes: Sequence[int] | None
    ) -> Slot:
        """Send a request (to ``lanes``; None: every lane) and wait for its reply: within
        ``timeout_ms`` plus the grace when it has one (else :class:`RequestTimeoutError`,
        the reply abandoned)."""
        state = self._joined()
        slot = state.submit(payload, rid, _noop, verb=verb, lanes=lanes)
        self._arm_keepalive()
        await self._flush()
        limit = reply_deadline(timeout_ms)
        with trio.move_on_after(math.inf if limit is None else limit) as scope:
            await self._wait_slot(slot, rid)
        if scope.cancelled_caught:
            raise late(verb, timeout_ms)
        return slot

    async def _wait_slot(self, slot: Slot, rid: str) -> None:
        if slot.reply is not None or slot.error is not None:
            return
        event = trio.Event()
        slot.wake = event.set
        try:
            await event.wait()
        finally:
            if slot.reply is None and slot.error is None and self._state is not None:
                self._state.abandon(rid)

    async def _wait_stream_end(self, state: JoinStream) -> None:
        while not state.join.ended and self._conn.lost is None:
            self._received = event = trio.Event()
            await event.wait()

    async def _flush(self) -> None:
        """Write whatever the connection has to send; a write never stops half-way.

        Bytes are appended to one buffer in the order h2 produced them; one task at a
        time writes it out and keeps going until it is empty, so the others return at
        once (no checkpoint when there is nothing to do).
        """
        self._outbuf += self._conn.data_to_send()
        if self._sending or not self._outbuf or self._stream is None:
            return
        self._sending = True
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(WRITE_TIMEOUT) as scope:
                while self._outbuf:
                    chunk = bytes(self._outbuf)
                    self._outbuf.clear()
                    await self._stream.send_all(chunk)
                    self._outbuf += self._conn.data_to_send()
            if scope.cancelled_caught:
                self._lose(f"the server did not read for {WRITE_TIMEOUT:g} s")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._lose(transport_failure(self._conn, exc, "connection lost while writing"))
        finally:
            self._sending = False

    def _lose(self, why: str) -> None:
        self._conn.lose(why)
        self._after_receive()

    def _after_receive(self) -> None:
        self._received.set()
        if self._state is not None:
            self._state.process()
        for stream_id, event in list(self._unary.items()):
            call = self._conn._calls.get(stream_id)
            if call is None or call.ended or self._conn.lost is not None:
                event.set()

    def _waiting(self) -> bool:
        return bool(self._unary) or bool(self._state is not None and self._state.pending)

    def _arm_keepalive(self) -> None:
        """A request went out: the reader's silence clock starts now if it was idle."""
        scope = self._read_scope
        if scope is not None and scope.deadline == math.inf:
            scope.deadline = trio.current_time() + self._ping_interval

    async def _reader(self) -> None:
        """Read, feed h2, route replies; keep-alive PINGs while requests wait."""
        stream = self._stream
        assert stream is not None
        acked = 0
        ping_deadline = math.inf
        try:
            while self._conn.lost is None:
                if ping_deadline < math.inf:
                    timeout = max(0.0, ping_deadline - trio.current_time())
                else:
                    timeout = self._ping_interval if self._waiting() else math.inf
                data = None
                with trio.CancelScope() as scope:
                    scope.deadline = trio.current_time() + timeout
                    self._read_scope = scope
                    data = await stream.receive_some(_READ_SIZE)
                self._read_scope = None
                if data and self._quickack and self._socket_stream is not None:
                    _quickack(self._socket_stream)
                if data is None:
                    if ping_deadline < math.inf:
                        self._lose(no_ping_answer(self._ping_interval, self._ping_timeout))
                        break
                    if not self._waiting():
                        continue
                    acked = self._conn.pings_acked
                    self._conn.ping(b"rlt-ping")
                    ping_deadline = trio.current_time() + self._ping_timeout
                    await self._flush()
                    continue
                self._conn.receive(bytes(data))
                if self._conn.pings_acked > acked:
                    ping_deadline = math.inf
                self._after_receive()
                await self._flush()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self._lose(transport_failure(self._conn, exc, "connection lost"))
        finally:
            if self._conn.lost is None:
                self._lose("the connection was closed")
            self._reader_done.set()

    async def _shutdown(self) -> None:
        if self._stream is None:
            return
        self._conn.close()
        data = self._conn.data_to_send()  # GOAWAY
        if data and not self._sending:  # (a write still in progress: just close)
            with (
                contextlib.suppress(
                    trio.BrokenResourceError,
                    trio.ClosedResourceError,
                    trio.BusyResourceError,
                    OSError,
                ),
                trio.move_on_after(1.0),
            ):
                await self._stream.send_all(data)
        with (
            contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError),
            trio.move_on_after(1.0),  # TLS: close_notify; closed even when cut short
        ):
            await self._stream.aclose()
        self._after_receive()


def _noop() -> None:
    pass
