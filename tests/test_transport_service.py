"""The gRPC transport (``_transport``): its own thread and asyncio loop, driven from Trio.

Everything runs over real loopback sockets (TCP port 0 and a unix socket in tmp_path)
against the real lane engine and the real Endpoint/Session, except where a fake session
pins the action plumbing (ordering, timers, EndStream, stream-end notification). The
clients are the raw HTTP/2 client of ``support.wire`` (on an asyncio loop in a worker
thread; it shows trailers, RST_STREAM and GOAWAY as sent) and the real rlmesh 0.1.0
client where that is cheap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import gymnasium as gym
import hypothesis
import outcome
import pytest
import trio
from hypothesis import strategies as st
from support import envs, h2raw, protobuf, wire

from rlmesh_trio._address import bind, parse_address
from rlmesh_trio._bridge import ReplyInbox, ToLoop
from rlmesh_trio._errors import AlreadyJoinedError, DecodeError
from rlmesh_trio._jobs import CallJob, LaneReply, Phases
from rlmesh_trio._lanes import LaneEngine
from rlmesh_trio._options import ServeOptions, resolve
from rlmesh_trio._proto.rlmesh.core import v1 as core_v1
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1
from rlmesh_trio._serve import ServeHooks, _serve
from rlmesh_trio._session import (
    Action,
    CancelTimer,
    EndStream,
    Post,
    Send,
    Session,
    StartTimer,
)
from rlmesh_trio._transport import TransportService, Wiring
from rlmesh_trio._wire import HEALTH_CHECK_PATH, decode_message

ALREADY_JOINED = str(AlreadyJoinedError())

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")

BOUND = 10.0
"""Generous upper bound, in seconds, for anything that should happen "soon" (shared box)."""

CARTPOLE_ZERO = struct.pack("<q", 0)  # a CartPole action leaf (Discrete: int64)


# --------------------------------------------------------------------------- harness


@dataclass
class Running:
    address: str
    service: TransportService
    engine: LaneEngine
    stopped: trio.Event = field(default_factory=trio.Event)
    """Set once the server stopped (``_serve`` returned, its lanes closed)."""
    ended: list[float] = field(default_factory=list)

    @property
    def stopped_at(self) -> float | None:
        """When the server stopped (Trio time), None until then."""
        return self.ended[0] if self.ended else None


@asynccontextmanager
async def running(
    make_env: Callable[[], gym.Env[Any, Any]] = envs.make_cartpole,
    *,
    options: ServeOptions,
    num_envs: int = 1,
    address: str = "tcp://127.0.0.1:0",
    session_factory: Any = None,
) -> AsyncIterator[Running]:
    """A server started and stopped exactly as ``serve_env`` does (:func:`_serve`: its
    lanes, stop phases and teardown), the transport service exposed through its hooks;
    ``session_factory`` replaces the real session (a scripted one).

    ``options`` start from the ``serve_options`` fixture: each test runs on every loop."""
    resolved = resolve(options)
    engine = LaneEngine(make_env, num_envs, resolved)
    listener = bind(parse_address(address))
    services: list[TransportService] = []

    def wiring(composed: Wiring) -> Wiring:
        if session_factory is None:
            return composed
        return dataclasses.replace(composed, session_factory=session_factory)

    hooks = ServeHooks(wiring=wiring, service=services.append)
    stopped = trio.Event()
    ended: list[float] = []

    async def serve(task_status: trio.TaskStatus[Any]) -> None:
        try:
            await _serve(engine, listener, resolved, task_status, hooks=hooks)
        finally:
            ended.append(trio.current_time())
            stopped.set()

    try:
        async with trio.open_nursery() as nursery:
            info = await nursery.start(serve)
            state = Running(info.address, services[0], engine, stopped, ended)
            try:
                yield state
            finally:
                nursery.cancel_scope.cancel()
    finally:
        listener.cleanup()
    assert not any(t.name == "rlmesh-trio-transport" for t in threading.enumerate())


async def in_thread(coro: Coroutine[Any, Any, T]) -> T:
    """Run an asyncio client session on its own loop in a worker thread."""
    return await trio.to_thread.run_sync(asyncio.run, coro)


async def call_sync(fn: Callable[..., T], *args: Any) -> T:
    return await trio.to_thread.run_sync(functools.partial(fn, *args))


# --------------------------------------------------------------------------- strict decoding


def test_decode_reference_cases() -> None:
    # SPEC §1.10: the reference's exact INTERNAL text for an undecodable unary body.
    with pytest.raises(DecodeError) as info:
        decode_message(env_v1.HandshakeRequest, b"\xff\xff\xff")
    assert str(info.value) == "failed to decode Protobuf message: invalid varint"
    with pytest.raises(DecodeError, match="invalid varint"):
        decode_message(env_v1.JoinRequest, b"\xa0\x01")  # an unknown varint field, no value


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b"\x0a\x05ab", "JoinRequest.reset: buffer underflow"),
        (b"\x0a\x02\x0a\x05", "ResetRequest.seeds: JoinRequest.reset: buffer underflow"),
        (b"\x08\x01", "JoinRequest.reset: invalid wire type: Varint (expected LengthDelimited)"),
        (b"\x0f", "invalid wire type value: 7"),
        (b"\x02\x00", "invalid tag value: 0"),
        (b"\xfc\x01", "unexpected end group tag"),
        (b"\x0a\x02\x2a\x01", "ResetRequest.episode_ids: JoinRequest.reset: buffer underflow"),
        (b"\x59\x00\x00", "buffer underflow"),  # unknown fixed64 field cut short
    ],
)
def test_decode_rejects_malformed(data: bytes, text: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_message(env_v1.JoinRequest, data)
    assert str(info.value).startswith("failed to decode Protobuf message: ")
    assert str(info.value).endswith(text)


def test_decode_rejects_bad_utf8() -> None:
    bad = bytes(env_v1.JoinRequest(request_id="x"))[:-1] + b"\xff"
    with pytest.raises(DecodeError, match="not UTF-8"):
        decode_message(env_v1.JoinRequest, bad)


def test_decode_accepts_well_formed_and_unknown_fields() -> None:
    request = env_v1.JoinRequest(
        step=env_v1.StepRequest(
            action=spaces_v1.SpaceValue(leaves=[b"\x01" * 9, b""]),
            env_indices=[2, 0],
            episode_ids=["a", "b"],
            timeout_ms=2500,
        ),
        request_id="grpc-req-1",
    )
    data = bytes(request)
    assert decode_message(env_v1.JoinRequest, data) == request
    # Unknown fields of every wire type (varint, fixed64, bytes, group, fixed32) are skipped.
    unknown = b"\xc8\x01\x05" + b"\xc9\x01" + b"\x00" * 8 + b"\xca\x01\x01z"
    unknown += b"\xcb\x01\xd0\x01\x01\xcc\x01" + b"\xcd\x01\x00\x00\x00\x00"
    assert decode_message(env_v1.JoinRequest, unknown + data) == request
    # Packed and unpacked repeated scalars are both accepted.
    unpacked = b"\x0a\x04\x20\x02\x20\x00"  # reset.env_indices [2, 0], one by one
    assert decode_message(env_v1.JoinRequest, unpacked).reset.env_indices == [2, 0]  # type: ignore[union-attr]


def test_decode_handshake_roundtrip() -> None:
    request = wire.client_handshake()
    assert decode_message(env_v1.HandshakeRequest, bytes(request)) == request


@hypothesis.given(st.binary(max_size=64))
@hypothesis.settings(max_examples=300, deadline=None)
def test_decode_never_fails_otherwise(data: bytes) -> None:
    """Any input decodes or raises DecodeError -- never another exception."""
    try:
        decode_message(env_v1.JoinRequest, data)
    except DecodeError as exc:
        message = str(exc)
    else:
        return
    assert message.startswith("failed to decode Protobuf message: ")


# --------------------------------------------------------------------------- unary RPCs


async def unary_checks(address: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with wire.WireClient(address) as client:
        out["ok"] = await client.handshake()
        out["mismatch"] = await client.handshake(wire.client_handshake("rlmesh-wire-v0"))
        out["no_base"] = await client.unary(wire.HANDSHAKE, b"")
        out["garbage"] = await client.unary(wire.HANDSHAKE, b"\xff\xff\xff")
        out["shutdown_no_base"] = await client.unary(wire.SHUTDOWN, b"")
        out["shutdown"] = await client.shutdown("please")
        out["unknown"] = await client.unary("/rlmesh.env.v1.EnvService/NoSuchMethod", b"")
        out["gzip"] = await client.unary(
            wire.HANDSHAKE,
            bytes(wire.client_handshake()),
            extra_headers=[("grpc-encoding", "gzip")],
            compressed=True,
        )
        service = protobuf.field(1, b"rlmesh.env.v1.EnvService")
        out["health_all"] = await client.unary(HEALTH_CHECK_PATH, b"")
        out["health_env"] = await client.unary(HEALTH_CHECK_PATH, service)
        out["health_other"] = await client.unary(HEALTH_CHECK_PATH, b"\x0a\x03abc")
        out["health_watch"] = await client.unary("/grpc.health.v1.Health/Watch", b"")
        out["after"] = await client.handshake()
    return out


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_unary_rpcs(transport: str, tmp_path: Path, serve_options: ServeOptions) -> None:
    address = f"unix://{tmp_path}/s.sock" if transport == "unix" else "tcp://127.0.0.1:0"
    async with running(address=address, options=serve_options) as server:
        out = await in_thread(unary_checks(server.address))
        assert not server.stopped.is_set()

    ok = out["ok"].base
    assert ok.compatible
    assert ok.capabilities == {"subset_step": "true"}
    assert out["ok"].env_contract.num_envs == 1
    assert out["ok"].env_contract.spec.id == "CartPole-v1"
    mismatch = out["mismatch"]
    assert not mismatch.base.compatible
    assert mismatch.env_contract is None
    assert mismatch.base.error_message == (
        "protocol generation rlmesh-wire-v0 not compatible with server rlmesh-wire-v1"
    )

    def status(name: str) -> tuple[int | None, str | None]:
        result: wire.UnaryResult = out[name]
        return result.end.status, result.end.message

    assert status("no_base") == (3, "handshake request missing base")
    assert status("garbage") == (13, "failed to decode Protobuf message: invalid varint")
    assert status("shutdown_no_base") == (3, "shutdown request missing base")
    assert out["shutdown"].base.accepted is False
    assert (
        out["shutdown"].base.message == "remote shutdown is disabled for this environment endpoint"
    )
    # Unknown method: trailers-only UNIMPLEMENTED with a content-type and no message.
    assert status("unknown") == (12, None)
    assert out["unknown"].reply is None
    assert (out["unknown"].header("content-type") or "").startswith("application/grpc")
    # SPEC §1.7: compression is refused, and identity advertised.
    assert status("gzip") == (12, "Content is compressed with `gzip` which isn't supported")
    assert out["gzip"].header("grpc-accept-encoding") == "identity"
    assert out["gzip"].header("content-type") == "application/grpc"
    # grpc.health.v1 (beyond the reference): SERVING for "" and our service.
    assert status("health_all") == (0, None)
    assert out["health_all"].reply == b"\x08\x01"
    assert out["health_env"].reply == b"\x08\x01"
    assert status("health_other")[0] == 5  # NOT_FOUND
    assert status("health_watch") == (12, None)
    assert out["after"].base.compatible


# --------------------------------------------------------------------------- Join admission


async def admission_session(address: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with wire.WireClient(address) as client:
        async with client.join() as first:
            # SPEC §1.3: response headers before the client sends anything.
            headers = await first.headers(timeout=5)
            out["headers"] = dict(headers)
            out["configure"] = await first.call(wire.configure())
            out["reset"] = await first.call(wire.reset(seeds=[7]))
            async with client.join() as second:
                out["second"] = await second.wait_end()
                out["second_headers"] = second.response_headers
            # The first is unaffected (a Handshake meanwhile does not matter either).
            await client.handshake()
            out["step"] = await first.call(wire.step([CARTPOLE_ZERO]))
            out["close"] = await first.call(wire.close())
            out["first_end"] = await first.wait_end()
        async with client.join() as third:
            out["third"] = await third.call(wire.reset())
            await third.half_close()
            out["third_end"] = await third.wait_end()
        async with client.join() as fourth:  # admitted again after a half-close
            out["fourth"] = await fourth.call(wire.reset())
    return out


async def test_join_headers_admission_and_close(serve_options: ServeOptions) -> None:
    async with running(options=serve_options) as server:
        out = await in_thread(admission_session(server.address))
    assert out["headers"][":status"] == "200"
    assert out["headers"]["content-type"].startswith("application/grpc")
    assert out["configure"].configure is not None
    assert out["reset"].reset is not None
    assert out["second"] == wire.CallEnd(9, ALREADY_JOINED)
    assert out["second_headers"] is not None  # trailers-only: one header block
    assert out["step"].step is not None
    assert out["close"].close is not None
    assert len(out["close"].close.final_episodes) == 1
    assert out["first_end"] == wire.CallEnd(0, None)
    assert out["third"].reset is not None
    assert out["third_end"] == wire.CallEnd(0, None)
    assert out["fourth"].reset is not None


async def bad_join_requests(address: str, limit: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with wire.WireClient(address) as client:
        async with client.join() as join:
            out["reset"] = await join.call(wire.reset())
            await join.send(b"\xff\xff\xff")
            out["garbage_end"] = await join.wait_end()
        async with client.join() as join:
            # Just under the limit: decoded, then refused by the codec (in-band error).
            under = wire.step([b"\x00" * (limit - 64)])
            assert len(bytes(under)) <= limit
            out["under"] = await join.call(under)
            over = wire.step([b"\x00" * (limit + 1)])
            await join.send(over)
            out["over_end"] = await join.wait_end()
        async with client.join() as join:
            out["after"] = await join.call(wire.reset())
        out["handshake"] = await client.handshake()
    return out


async def test_undecodable_and_oversize_join_requests_end_the_stream_quietly(
    serve_options: ServeOptions,
) -> None:
    limit = 4096
    async with running(
        options=dataclasses.replace(serve_options, max_message_bytes=limit)
    ) as server:
        out = await in_thread(bad_join_requests(server.address, limit))
        assert not server.stopped.is_set()
    assert out["reset"].reset is not None
    # SPEC §1.8/§9: grpc-status 0 and no JoinResponse at all.
    assert out["garbage_end"] == wire.CallEnd(0, None)
    assert out["under"].error is not None
    assert out["under"].error.code == env_v1.EnvErrorCode.INVALID_ACTION
    assert out["over_end"] == wire.CallEnd(0, None)
    assert out["after"].reset is not None
    assert out["handshake"].base.compatible


async def cancel_mid_request(address: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with wire.WireClient(address) as client:
        async with client.join() as join:
            await join.call(wire.reset())
            await join.send(wire.step([struct.pack("<q", 5)]))  # SlowEnv: 0.5 s
            await asyncio.sleep(0.05)
            await join.cancel()  # RST_STREAM while the lane is busy
        async with client.join() as join:  # admitted at once; its reset queues behind
            out["next"] = await join.call(wire.reset())
    return out


async def test_client_cancel_releases_admission(serve_options: ServeOptions) -> None:
    async with running(envs.make_slow, options=serve_options) as server:
        out = await in_thread(cancel_mid_request(server.address))
    assert out["next"].reset is not None


async def test_rlmesh_remote_env(tmp_path: Path, serve_options: ServeOptions) -> None:
    """The real 0.1.0 client, over TCP and over a unix socket."""
    rlmesh_numpy = pytest.importorskip("rlmesh.numpy")

    def session(address: str) -> tuple[Any, ...]:
        env = rlmesh_numpy.RemoteEnv(address)
        try:
            obs, _ = env.reset(seed=3)
            steps = [env.step(1) for _ in range(5)]
            return obs, steps
        finally:
            env.close()

    for address in ("tcp://127.0.0.1:0", f"unix://{tmp_path}/rl.sock"):
        async with running(address=address, options=serve_options) as server:
            obs, steps = await call_sync(session, server.address)
        assert obs.shape == (4,)
        assert [s[1] for s in steps] == [1.0] * 5


# --------------------------------------------------------------------------- Join plumbing


class FakeSession:
    """Scripted session: a request's ``request_id`` names what to answer."""

    instances: list[FakeSession] = []

    def __init__(self, endpoint: Any) -> None:
        self.events: list[tuple[str, Any]] = []
        self.threads: list[str] = []
        self.pending = 0
        self.stream_ends = 0
        self.ended = threading.Event()
        self._finished = False
        FakeSession.instances.append(self)

    def _reply(self, rid: str) -> Send:
        return Send(env_v1.JoinResponse(request_id=rid, configure=env_v1.ConfigureEnvResponse()))

    def on_request(self, request: env_v1.JoinRequest) -> list[Action]:
        rid = request.request_id
        self.events.append(("request", rid))
        if rid == "three":
            return [self._reply("3a"), self._reply("3b"), self._reply("3c")]
        if rid == "timer":
            return [StartTimer(1, 0.05), StartTimer(2, 0.05), CancelTimer(2)]
        if rid == "lane":
            self.pending += 1
            # A job whose reply comes back from the lane thread.
            return [Post(0, CallJob(fn=lambda env: "done", id=41))]
        if rid == "end":
            self._finished = True
            return [self._reply("bye"), EndStream(), self._reply("never")]
        if rid == "burst":
            # Over the client's 64 KiB window, then small ones that must not overtake it.
            return [self._reply("B" * (200 << 10)), self._reply("a"), self._reply("b")]
        if rid == "many":
            return [self._reply(f"m{i:02d}" + "." * (30 << 10)) for i in range(12)]
        return [self._reply(rid)]

    def on_lane_reply(self, reply: LaneReply) -> list[Action]:
        self.pending -= 1
        self.threads.append(threading.current_thread().name)
        self.events.append(("lane", (reply.job_id, reply.outcome.unwrap())))
        return [self._reply(f"lane-{reply.job_id}")]

    def on_timer(self, token: int) -> list[Action]:
        self.events.append(("timer", token))
        return [self._reply(f"timer-{token}")]

    def on_stream_end(self) -> list[Action]:
        self.stream_ends += 1
        self._finished = True
        self.ended.set()
        return [self._reply("stream-end")]

    def on_half_close(self) -> list[Action]:
        return [*self.on_stream_end(), EndStream()]

    @property
    def busy(self) -> bool:
        return self.pending > 0

    @property
    def backlog(self) -> int:
        return self.pending

    @property
    def finished(self) -> bool:
        return self._finished


def rid(reply: env_v1.JoinResponse | None) -> str | None:
    return None if reply is None else reply.request_id


async def plumbing_session(address: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with wire.WireClient(address) as client:
        async with client.join() as join:
            await join.send(wire.configure(request_id="three"))
            out["three"] = [rid(await join.recv()) for _ in range(3)]
            await join.send(wire.configure(request_id="timer"))
            out["timer"] = rid(await join.recv())
            await join.send(wire.configure(request_id="lane"))
            out["lane"] = rid(await join.recv())
            await join.send(wire.configure(request_id="end"))
            out["end"] = rid(await join.recv())
            await join.send(wire.configure(request_id="after-end"))  # never answered
            out["end_status"] = await join.wait_end()
        async with client.join() as join:
            out["second"] = await join.call(wire.configure(request_id="x"))
            await join.half_close()
            # Sends the session returns from on_stream_end still go out after a half-close.
            out["second_last"] = rid(await join.recv())
            out["second_end"] = await join.wait_end()
        async with client.join() as join:
            out["third"] = await join.call(wire.configure(request_id="y"))
        # leaving the block reset the stream (client cancel)
        await asyncio.sleep(0.1)
        out["final"] = await client.handshake()
    return out


async def test_action_plumbing_with_a_scripted_session(serve_options: ServeOptions) -> None:
    FakeSession.instances = []
    async with running(session_factory=FakeSession, options=serve_options) as server:
        out = await in_thread(plumbing_session(server.address))
        first, second, third = FakeSession.instances
        # The client's cancel of the third stream reached its session.
        assert await trio.to_thread.run_sync(third.ended.wait, BOUND)
    assert out["three"] == ["3a", "3b", "3c"]  # in order
    assert out["timer"] == "timer-1"  # timer 2 was cancelled
    assert out["lane"] == "lane-41"
    assert first.threads == ["rlmesh-trio-transport"]  # hopped onto the transport loop
    assert ("lane", (41, "done")) in first.events
    assert out["end"] == "bye"  # sends before EndStream go out, later ones do not
    assert out["end_status"] == wire.CallEnd(0, None)
    assert ("request", "after-end") not in first.events
    assert first.stream_ends == 0  # the session ended the stream itself
    assert second.stream_ends == 1  # half-close
    assert out["second_last"] == "stream-end"
    assert out["second_end"] == wire.CallEnd(0, None)
    assert third.stream_ends == 1  # cancel
    assert out["final"].base.compatible


async def test_tcp_nodelay_on_accepted_connections(serve_options: ServeOptions) -> None:
    async with running(options=serve_options) as server:
        loop_server = server.service._loop_server
        assert loop_server is not None

        async def nodelay_flags() -> list[int]:
            return [
                proto._transport.get_extra_info("socket").getsockopt(  # type: ignore[union-attr]
                    socket.IPPROTO_TCP, socket.TCP_NODELAY
                )
                for proto in loop_server.protocols
            ]

        async def probe(address: str) -> list[int]:
            async with wire.WireClient(address) as client:
                await client.handshake()
                loop_server = server.service._loop_server
                assert loop_server is not None
                future = asyncio.run_coroutine_threadsafe(nodelay_flags(), loop_server.loop)
                return await asyncio.wrap_future(future)

        flags = await in_thread(probe(server.address))
    assert flags
    assert all(flags)


# --------------------------------------------------------------------------- lifecycle


async def shutdown_with_open_join(address: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with wire.WireClient(address) as client:
        async with client.join() as join:
            out["reset"] = await join.call(wire.reset(seeds=[3]))
            out["shutdown"] = await client.shutdown("bye")
            await asyncio.sleep(0.2)
            out["goaway"] = client.goaway
            # Open streams keep being served during the drain (SPEC §10.2).
            out["step"] = await join.call(wire.step([CARTPOLE_ZERO]))
            out["close"] = await join.call(wire.close())
            out["join_end"] = await join.wait_end()
        out["closed_at"] = time.monotonic()
    return out


async def test_shutdown_accepted_drains_open_join_then_stops(serve_options: ServeOptions) -> None:
    options = dataclasses.replace(
        serve_options, allow_remote_shutdown=True, drain_timeout_seconds=30.0
    )
    async with running(options=options) as server:
        started = trio.current_time()
        out = await in_thread(shutdown_with_open_join(server.address))
        with trio.fail_after(BOUND):
            await server.stopped.wait()
        assert server.service.stop_reason == "remote shutdown accepted"
        # It stopped once the Join ended, long before the 30 s drain bound.
        assert server.stopped_at is not None
        assert server.stopped_at - started < BOUND
    assert out["shutdown"].base.accepted
    assert out["shutdown"].base.message == "shutdown accepted: bye"
    assert out["goaway"] is not None
    assert out["goaway"].error_code == 0
    assert out["goaway"].last_stream_id == 3  # the second GOAWAY names the real last stream
    assert out["step"].step is not None
    assert out["close"].close is not None
    assert out["join_end"] == wire.CallEnd(0, None)


async def drain_inflight(address: str, units: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with wire.joined(address, wire.reset()) as join:
        await join.send(wire.step([struct.pack("<q", units)]))  # SlowEnv: units * 0.1 s
        await asyncio.sleep(0.05)
        out["shutdown"] = await join.client.shutdown("drain test")
        out["inflight"] = await join.recv(timeout=BOUND)
        out["next"] = await join.recv(timeout=BOUND)  # the stream is cut, no status
        out["end"] = join.end
    return out


@pytest.mark.parametrize(("units", "drain"), [(4, 1.0), (6, 0.2)])
async def test_drain_delivers_an_inflight_reply_then_cuts(
    units: int, drain: float, serve_options: ServeOptions
) -> None:
    """SPEC §10.3: the in-flight reply is delivered, also when the env call outlives the
    drain (then within the close timeout, while the lanes close), then the stream is cut."""
    options = dataclasses.replace(
        serve_options, allow_remote_shutdown=True, drain_timeout_seconds=drain
    )
    async with running(envs.make_slow, options=options) as server:
        out = await in_thread(drain_inflight(server.address, units))
        with trio.fail_after(BOUND):
            await server.stopped.wait()
    assert out["shutdown"].base.accepted
    assert out["inflight"] is not None
    assert out["inflight"].step is not None
    assert out["next"] is None
    assert out["end"].status is None  # cut without trailers (client sees UNAVAILABLE)


async def test_drain_and_close_bounds_cut_a_wedged_request(serve_options: ServeOptions) -> None:
    release = threading.Event()
    drain, close = 0.3, 0.3
    options = dataclasses.replace(
        serve_options,
        allow_remote_shutdown=True,
        drain_timeout_seconds=drain,
        close_timeout_seconds=close,
    )

    async def wedged(address: str) -> tuple[Any, wire.CallEnd | None]:
        async with wire.joined(address, wire.reset()) as join:
            await join.send(wire.step([struct.pack("<q", 1)]))  # blocks on `release`
            await asyncio.sleep(0.05)
            await join.client.shutdown()
            reply = await join.recv(timeout=BOUND)
            if reply is not None:
                assert await join.recv(timeout=BOUND) is None
            return reply, join.end

    try:
        async with running(functools.partial(envs.HangEnv, release), options=options) as server:
            started = trio.current_time()
            reply, end = await in_thread(wedged(server.address))
            with trio.fail_after(BOUND):
                await server.stopped.wait()
            assert server.stopped_at is not None
            elapsed = server.stopped_at - started
            assert drain <= elapsed < server.service.stop_timeout
            release.set()  # let the abandoned lane thread finish
    finally:
        release.set()
    # The lane was abandoned at the close deadline: its job is answered as an error (the
    # session's mapping of LaneBrokenError, which may end the stream), or the stream is cut.
    assert end is not None
    if reply is None:
        assert end.status is None
    else:
        assert reply.error is not None
        assert end.status in (None, 0)


async def test_idle_timeout_ignores_handshakes_and_cuts_a_silent_join(
    serve_options: ServeOptions,
) -> None:
    idle = 0.5
    options = dataclasses.replace(serve_options, idle_timeout_seconds=idle)

    async def activity(address: str) -> dict[str, Any]:
        out: dict[str, Any] = {"handshakes": 0}
        async with wire.WireClient(address) as client, client.join() as join:
            out["reset"] = await join.call(wire.reset())
            out["reset_done"] = time.monotonic()
            # Only Handshakes from now on: they do not count as activity.
            try:
                while time.monotonic() - out["reset_done"] < BOUND:
                    await client.handshake()
                    out["handshakes"] += 1
                    await asyncio.sleep(0.05)
            except (TimeoutError, AssertionError, ConnectionError):
                pass
            out["join_next"] = await join.recv(timeout=BOUND)
            out["join_end"] = join.end
        return out

    async with running(options=options) as server:
        out = await in_thread(activity(server.address))
        with trio.fail_after(BOUND):
            await server.stopped.wait()
        assert server.service.stop_reason == f"idle for {idle:g} s"
    assert out["reset"].reset is not None
    assert out["handshakes"] >= 2
    assert out["join_next"] is None
    assert out["join_end"].status is None  # the silent Join was cut


async def test_idle_timeout_waits_for_an_inflight_request(serve_options: ServeOptions) -> None:
    options = dataclasses.replace(serve_options, idle_timeout_seconds=0.3)

    async def slow_reset(address: str) -> env_v1.JoinResponse:
        async with wire.WireClient(address) as client, client.join() as join:
            # SlowEnv.reset sleeps 1 s: longer than the idle timeout.
            return await join.call(wire.reset(options={"sleep": 1.0}))

    async with running(envs.make_slow, options=options) as server:
        reply = await in_thread(slow_reset(server.address))
        with trio.fail_after(BOUND):
            await server.stopped.wait()
    assert reply.reset is not None


async def test_idle_timeout_with_no_activity_at_all(serve_options: ServeOptions) -> None:
    async with running(
        options=dataclasses.replace(serve_options, idle_timeout_seconds=0.2)
    ) as server:
        start = trio.current_time()
        with trio.fail_after(BOUND):
            await server.stopped.wait()
        assert server.stopped_at is not None
        assert server.stopped_at - start >= 0.15


async def test_cancel_is_bounded_with_an_open_join_and_a_wedged_lane(
    serve_options: ServeOptions,
) -> None:
    release = threading.Event()
    options = dataclasses.replace(
        serve_options, drain_timeout_seconds=0.2, close_timeout_seconds=0.5
    )
    client_done = threading.Event()

    async def hold(address: str) -> None:
        async with wire.joined(address, wire.reset()) as join:
            await join.send(wire.step([struct.pack("<q", 1)]))
            await join.recv(timeout=BOUND)
        client_done.set()

    try:
        with trio.CancelScope() as outer:
            async with (
                running(functools.partial(envs.HangEnv, release), options=options) as server,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(in_thread, hold(server.address))
                await trio.sleep(0.3)
                start = trio.current_time()
                outer.cancel()
        elapsed = trio.current_time() - start
        assert elapsed < server.service.stop_timeout + 0.5 + 1.0  # + lane teardown
        assert client_done.is_set()
    finally:
        release.set()


async def test_request_stop_from_another_thread_and_reply_after_stop(
    serve_options: ServeOptions,
) -> None:
    FakeSession.instances = []
    async with running(session_factory=FakeSession, options=serve_options) as server:

        async def join_once(address: str) -> None:
            async with wire.WireClient(address) as client, client.join() as join:
                await join.call(wire.configure(request_id="hello"))

        await in_thread(join_once(server.address))
        join = server.service  # the inbox of a finished Join: a late lane reply lands there
        await call_sync(join.request_stop, "from a thread")
        with trio.fail_after(BOUND):
            await server.stopped.wait()
        assert server.service.stop_reason == "from a thread"
    # A lane answering after the transport is gone must not raise.
    stray = ReplyInbox(ToLoop(_closed_loop_call), lambda reply: None)
    stray.put(LaneReply(99, 0, outcome.Value(None), Phases()))


def _closed_loop_call(*args: Any) -> None:
    raise RuntimeError("Event loop is closed")


async def test_startup_failure_is_raised_from_run(serve_options: ServeOptions) -> None:
    engine_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # not a stream socket
    # Nothing is ever served: neither an endpoint nor lanes are asked anything.
    wiring = Wiring(
        options=resolve(serve_options),
        endpoint=object(),  # type: ignore[arg-type]
        lanes=object(),  # type: ignore[arg-type]
        session_factory=Session,
    )
    try:
        service = TransportService(wiring, listener=engine_sock)
        async with trio.open_nursery() as nursery:
            with pytest.raises(ValueError, match="Stream Socket was expected"):
                await nursery.start(service.run)
    finally:
        engine_sock.close()
    assert not service.listening


def test_bad_options_are_refused() -> None:
    for options in (
        ServeOptions(drain_timeout_seconds=-1),
        ServeOptions(idle_timeout_seconds=0),
    ):
        with pytest.raises(ValueError, match="must be"):
            resolve(options)


@pytest.mark.parametrize(
    ("token", "where"),
    [("café", "character 4 is U+00E9"), ("a b", "character 2 is U+0020"), ("x\ty", "U+0009")],
)
def test_a_token_no_client_can_present_is_refused_at_startup(token: str, where: str) -> None:
    """Issue 17, finding 3: a non-ASCII token was accepted and could never be presented
    (a header value is bytes; the error names the position, never the token)."""
    with pytest.raises(ValueError, match="visible ASCII") as info:
        resolve(ServeOptions(auth_token=token))
    assert where in str(info.value)
    assert token not in str(info.value)
    assert resolve(ServeOptions(auth_token="A-z_0.9~+/=:!")).auth_token == "A-z_0.9~+/=:!"


async def test_handshake_request_shape_from_core(serve_options: ServeOptions) -> None:
    """A Handshake without peer info or editions is still compatible (SPEC §6.3)."""
    bare = env_v1.HandshakeRequest(
        base=core_v1.HandshakeRequest(protocol_generation="rlmesh-wire-v1")
    )

    async def go(address: str) -> env_v1.HandshakeResponse:
        async with wire.WireClient(address) as client:
            return await client.handshake(bare)

    async with running(options=serve_options) as server:
        reply = await in_thread(go(server.address))
    assert reply.base.compatible
    assert reply.base.preferred_workflow_edition == "2026.06"


# --------------------------------------------------------------------------- auth


async def auth_session(address: str, token: str | None) -> dict[str, Any]:
    headers = [] if token is None else [("authorization", token)]
    out: dict[str, Any] = {}
    async with wire.WireClient(address) as client:
        result = await client.unary(
            wire.HANDSHAKE, bytes(wire.client_handshake()), extra_headers=headers
        )
        out["handshake"] = result.end
        async with client.join(headers) as join:
            await join.send(wire.configure())
            reply = await join.recv()
            out["join"] = (None if reply is None else wire.reply_kind(reply), join.end)
        health = await client.unary(HEALTH_CHECK_PATH, b"")  # never needs the token
        out["health"] = (health.end, health.reply)
    return out


async def test_auth_token_refuses_every_call_without_it_but_health(
    serve_options: ServeOptions,
) -> None:
    options = dataclasses.replace(serve_options, auth_token="s3cret")
    assert "s3cret" not in repr(options) and "s3cret" not in repr(resolve(options))
    async with running(options=options) as server:
        missing = await in_thread(auth_session(server.address, None))
        wrong = await in_thread(auth_session(server.address, "Bearer nope"))
        bare = await in_thread(auth_session(server.address, "s3cret"))
        right = await in_thread(auth_session(server.address, "Bearer s3cret"))
    refused = wire.CallEnd(16, "invalid env token")
    for out in (missing, wrong, bare):
        assert out["handshake"] == refused
        assert out["join"] == (None, refused)
        assert out["health"] == (wire.CallEnd(0), b"\x08\x01")
    assert right["handshake"] == wire.CallEnd(0)
    assert right["join"][0] == "configure"
    assert right["health"] == (wire.CallEnd(0), b"\x08\x01")


async def test_auth_token_through_a_grpc_library_client(serve_options: ServeOptions) -> None:
    """grpclib's generated stub (a real gRPC client) with and without the metadata."""
    from grpclib.client import Channel
    from grpclib.exceptions import GRPCError

    async def call(address: str, metadata: dict[str, str] | None) -> Any:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        channel = Channel(host, int(port))
        try:
            stub = env_v1.EnvServiceStub(channel)
            return await stub.handshake(wire.client_handshake(), metadata=metadata, timeout=10)
        except GRPCError as exc:
            return (int(exc.status.value), exc.message)
        finally:
            channel.close()

    options = dataclasses.replace(serve_options, auth_token="tok")
    async with running(options=options) as server:
        refused = await in_thread(call(server.address, None))
        accepted = await in_thread(call(server.address, {"authorization": "Bearer tok"}))
    assert refused == (16, "invalid env token")
    assert accepted.base.compatible


def test_auth_token_from_the_environment() -> None:
    assert resolve(ServeOptions(), {"RLMESH_TRIO_AUTH_TOKEN": "x"}).auth_token == "x"
    assert resolve(ServeOptions(), {}).auth_token is None
    assert resolve(ServeOptions(auth_token="a"), {"RLMESH_TRIO_AUTH_TOKEN": "x"}).auth_token == "a"
    with pytest.raises(ValueError, match="auth_token"):
        resolve(ServeOptions(auth_token=" "))


# --------------------------------------------------------------------------- fast path


async def ordered_bursts(address: str) -> list[str]:
    out: list[str] = []
    async with wire.WireClient(address) as client, client.join() as join:
        # The first alone (its reply goes out at once, the direct path), then the rest
        # in a burst: the replies of one read go out together, and these, with the big
        # one behind them, overflow the window (the queued path).
        await join.send(wire.configure(request_id="first"))
        reply = await join.recv()
        assert reply is not None, join.end
        out.append(reply.request_id[:3])
        for rid in ("burst", "many", "last"):
            await join.send(wire.configure(request_id=rid))
        # A request over OFF_LOOP_DECODE_BYTES is decoded on the worker thread while
        # the requests behind it wait in the reader: the replies keep the order.
        await join.send(wire.configure(request_id="L" * (1536 << 10)))
        await join.send(wire.configure(request_id="after-big"))
        while len(out) < 1 + 3 + 12 + 1 + 2:
            reply = await join.recv()
            assert reply is not None, join.end
            out.append(reply.request_id[:3])
    return out


async def test_replies_keep_their_order_across_the_direct_and_queued_paths(
    monkeypatch: pytest.MonkeyPatch, serve_options: ServeOptions
) -> None:
    from rlmesh_trio._transport import _writer

    paths: list[bool] = []
    try_send = _writer.StreamSender.try_send

    def counted(self: _writer.StreamSender, message: bytes) -> bool:
        sent = try_send(self, message)
        paths.append(sent)
        return sent

    monkeypatch.setattr(_writer.StreamSender, "try_send", counted)
    FakeSession.instances = []
    async with running(session_factory=FakeSession, options=serve_options) as server:
        out = await in_thread(ordered_bursts(server.address))
    many = [f"m{i:02d}"[:3] for i in range(12)]
    assert out == ["fir", "BBB", "a", "b", *many, "las", "LLL", "aft"]
    assert True in paths and False in paths  # both paths were taken


async def saturate(
    address: str, total: int, probe: Callable[[], dict[str, Any]], release: threading.Event
) -> dict[str, Any]:
    """Pipeline ``total`` 100 KiB lane steps at a wedged lane until the server stops
    taking them; ``probe()`` the server then; release the lane; collect every reply."""
    pad = "x" * (100 << 10)
    async with wire.joined(address, wire.reset(seeds=[0]), timeout=30) as join:
        sent = 0

        async def sender() -> None:
            nonlocal sent
            for i in range(total):
                request = wire.step([CARTPOLE_ZERO], env_indices=[0], request_id=f"{i:03d}{pad}")
                await join.send(request)
                sent += 1

        task = asyncio.get_running_loop().create_task(sender())
        stream_id = join.stream.id
        deadline = time.monotonic() + BOUND
        # Blocked: the server's window for the stream has no room for one more request
        # (the client's h2 state, updated by every WINDOW_UPDATE the server sends), and
        # the server has read what reached it (its reader paused: it will grant no more).
        while True:
            blocked = join.client._conn.local_flow_control_window(stream_id) < len(pad)
            server = probe()
            if task.done() or (blocked and server["paused"]):
                break
            assert time.monotonic() < deadline, ("never blocked", server)
            await asyncio.sleep(0.01)
        out: dict[str, Any] = {"blocked": not task.done(), "sent_when_blocked": sent}
        out["server"] = server
        release.set()
        ids = []
        while len(ids) < total:
            reply = await join.recv(timeout=BOUND)
            assert reply is not None and reply.error is None, (reply, join.end)
            ids.append(int(reply.request_id[:3]))
        await task
        out["ids"] = ids
    return out


async def test_a_saturated_session_stops_acknowledging_requests(
    monkeypatch: pytest.MonkeyPatch, serve_options: ServeOptions
) -> None:
    """REQUEST_BACKLOG: past it the reader consumes nothing and sends no WINDOW_UPDATE,
    so the client can send one flow-control window more and then waits; nothing is
    lost, and reading resumes as the lane catches up."""
    from rlmesh_trio._transport import _join

    monkeypatch.setattr(_join, "REQUEST_BACKLOG", 4)
    release = threading.Event()
    total = 80  # 8 MB of requests: twice grpclib's 4 MiB stream window

    async with running(lambda: envs.HangEnv(release), num_envs=1, options=serve_options) as server:
        loop_server = server.service._loop_server
        assert loop_server is not None

        def probe() -> dict[str, Any]:
            join = loop_server.join
            assert join is not None and join.reader is not None
            return {
                "paused": join.reader.paused,
                "backlog": join.session.backlog,
                "buffered": join.reader.buffered,
            }

        try:
            out = await in_thread(saturate(server.address, total, probe, release))
        finally:
            release.set()
    assert out["blocked"], out
    assert out["server"]["paused"] and out["server"]["backlog"] == 4, out["server"]
    # What the client could send beyond the 4 read: at most the stream's 4 MiB window.
    assert out["server"]["buffered"] <= 4 << 20, out["server"]
    assert 4 < out["sent_when_blocked"] < total, out
    assert out["ids"] == list(range(total))  # every request answered, in order


async def reset_while_saturated(address: str, release: threading.Event) -> dict[str, Any]:
    """Fill the server's windows with requests it does not read, reset the stream, then
    use the same connection again: the reset stream's window must come back."""
    pad = "x" * (100 << 10)
    out: dict[str, Any] = {}
    async with wire.WireClient(address, timeout=BOUND) as client:
        async with client.join() as join:
            await join.call(wire.reset(seeds=[0]))

            async def sender() -> None:
                for i in range(80):
                    step = wire.step([CARTPOLE_ZERO], env_indices=[0], request_id=f"{i}{pad}")
                    await join.send(step)

            task = asyncio.get_running_loop().create_task(sender())
            deadline = time.monotonic() + BOUND
            while client._conn.outbound_flow_control_window >= len(pad):
                assert not task.done() and time.monotonic() < deadline, "never blocked"
                await asyncio.sleep(0.01)
            out["connection_window_blocked"] = client._conn.outbound_flow_control_window
            task.cancel()
        # The Join was reset (RST_STREAM CANCEL); the connection is still open.
        out["handshake"] = await client.handshake()
        release.set()
        async with client.join() as again:
            # More than the connection window had left: sendable only once it came back.
            out["second_join"] = await again.call(wire.reset(seeds=[1], request_id=pad))
    return out


async def test_a_reset_stream_gives_the_connection_its_window_back(
    monkeypatch: pytest.MonkeyPatch, serve_options: ServeOptions
) -> None:
    from rlmesh_trio._transport import _join

    monkeypatch.setattr(_join, "REQUEST_BACKLOG", 4)
    release = threading.Event()
    async with running(lambda: envs.HangEnv(release), num_envs=1, options=serve_options) as server:
        try:
            out = await in_thread(reset_while_saturated(server.address, release))
        finally:
            release.set()
    assert out["connection_window_blocked"] < 100 << 10
    assert out["handshake"].base.compatible
    assert out["second_join"].reset is not None, out["second_join"]


async def test_replies_of_one_callback_leave_in_one_data_frame(
    monkeypatch: pytest.MonkeyPatch, serve_options: ServeOptions
) -> None:
    """Coalescing: the three replies one request produces are handed to h2 as one
    payload (one DATA frame, one socket write), the messages intact and in order."""
    from rlmesh_trio._transport import _writer

    payloads: list[bytes] = []
    try_send = _writer.StreamSender.try_send

    def recorded(self: _writer.StreamSender, payload: bytes) -> bool:
        payloads.append(bytes(payload))
        return try_send(self, payload)

    monkeypatch.setattr(_writer.StreamSender, "try_send", recorded)
    FakeSession.instances = []

    async def three(address: str) -> list[str | None]:
        async with wire.WireClient(address) as client, client.join() as join:
            await join.send(wire.configure(request_id="three"))
            return [rid(await join.recv()) for _ in range(3)]

    async with running(session_factory=FakeSession, options=serve_options) as server:
        got = await in_thread(three(server.address))
    assert got == ["3a", "3b", "3c"]
    assert len(payloads) == 1
    messages, data = [], payloads[0]
    while data:
        length = int.from_bytes(data[1:5], "big")
        messages.append(env_v1.JoinResponse.parse(data[5 : 5 + length]).request_id)
        data = data[5 + length :]
    assert messages == ["3a", "3b", "3c"]


class BlindClient:
    """An h2 client that learns the server's windows, then never reads the socket again
    and sends requests on a Join within them."""

    def __init__(self, port: int) -> None:
        import h2.config
        import h2.connection
        import h2.events
        from h2.settings import SettingCodes

        self.sock = sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(BOUND)
        sock.connect(("127.0.0.1", port))
        self.conn = conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        # Grant the server all the window it could want: only the socket holds it back.
        conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
        conn.increment_flow_control_window(2**31 - 1 - 65535)
        conn.send_headers(1, h2raw.request_fields(wire.JOIN))
        sock.sendall(conn.data_to_send())
        seen: set[type] = set()
        wanted = {h2.events.ResponseReceived, h2.events.SettingsAcknowledged}
        while not wanted <= seen:
            for event in conn.receive_data(sock.recv(65536)):
                seen.add(type(event))
            sock.sendall(conn.data_to_send())

    def send(self, requests: list[bytes]) -> None:
        conn = self.conn
        for message in requests:
            payload = struct.pack(">?I", False, len(message)) + message
            assert conn.local_flow_control_window(1) >= len(payload)
            size = conn.max_outbound_frame_size
            for pos in range(0, len(payload), size):
                conn.send_data(1, payload[pos : pos + size])
            self.sock.sendall(conn.data_to_send())


async def test_direct_writes_stop_when_the_socket_is_full(serve_options: ServeOptions) -> None:
    """A client that grants a huge window and then never reads the socket: the replies
    written at once stop at the transport's high-water mark and the rest wait in the
    Join's outbox, which REPLY_BACKLOG_BYTES bounds (test_hostile.py holds that bound)."""
    FakeSession.instances = []
    pad = "y" * (100 << 10)
    count = 30  # 3 MB of replies, far more than the shrunk socket buffers hold
    requests = [bytes(wire.configure(request_id=f"{i:02d}{pad}")) for i in range(count)]
    async with running(session_factory=FakeSession, options=serve_options) as server:
        loop_server = server.service._loop_server
        assert loop_server is not None
        port = int(server.address.rsplit(":", 1)[1])

        async def snapshot(shrink: bool) -> dict[str, Any]:
            join = loop_server.join
            assert join is not None and join.sender is not None
            transport = join.sender._transport
            if shrink:
                sock = transport.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            return {
                "answered": len(FakeSession.instances[0].events),
                "write_buffer": transport.get_write_buffer_size(),
                "outbox": join.outbox_bytes,
                "write_ready": join.sender._connection.write_ready.is_set(),
            }

        def on_loop(shrink: bool) -> dict[str, Any]:
            future = asyncio.run_coroutine_threadsafe(snapshot(shrink), loop_server.loop)
            return future.result(BOUND)

        client = await call_sync(BlindClient, port)
        try:
            await call_sync(on_loop, True)  # before any reply: a small socket buffer
            await call_sync(client.send, requests)
            deadline = time.monotonic() + BOUND
            snap = await call_sync(on_loop, False)
            while snap["answered"] < count:
                assert time.monotonic() < deadline, snap
                await trio.sleep(0.01)
                snap = await call_sync(on_loop, False)
        finally:
            client.sock.close()
    assert not snap["write_ready"], snap  # the transport asked us to stop writing
    assert snap["outbox"] > 0, snap  # ... and the replies after that waited
    # Written at once: at most the high-water mark plus one loop callback's replies.
    assert snap["write_buffer"] <= 64 * 1024 + 2 * (101 << 10), snap
