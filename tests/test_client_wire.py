"""The client's message layer and HTTP/2 core, without a network: requests decode with
the server's own decoder, replies encoded by the server's encoder decode back, the
handshake checks, big messages through flow control, the error family."""

from __future__ import annotations

import functools
import pickle
import time
from typing import Any

import gymnasium as gym
import h2.config
import h2.connection
import h2.events
import numpy as np
import pytest
import trio
from gymnasium import spaces
from support.envs import EchoEnv
from support.refserver import ServerConfig, ServerPool

from rlmesh_trio import RlmeshTrioError, serve_env
from rlmesh_trio._codec import space_to_spec, to_meta_map
from rlmesh_trio._errors import MappedError
from rlmesh_trio._proto.rlmesh.core import v1 as core_v1
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1
from rlmesh_trio._wire import DecodeError, decode_join_request, encode_join_response, frame
from rlmesh_trio._wire._protocol import HANDSHAKE_PATH, JOIN_PATH
from rlmesh_trio.client import (
    ConnectionLostError,
    EndpointClosedError,
    EndpointError,
    EnvError,
    ErrorCode,
    HandshakeError,
    RpcError,
    VectorEnv,
    _grpc,
    open_endpoint,
)
from rlmesh_trio.client._codecs import request_seeds
from rlmesh_trio.client._contract import contract_from_handshake
from rlmesh_trio.client._core import JoinStream, Slot
from rlmesh_trio.client._grpc import GrpcConnection
from rlmesh_trio.client._messages import (
    close_request,
    configure_request,
    decode_reply,
    render_request,
    reset_request,
    step_request,
)
from rlmesh_trio.client._settings import request_timeout_ms

pytestmark = pytest.mark.timeout(60)


def test_requests_decode_with_the_servers_decoder() -> None:
    reset = decode_join_request(
        reset_request(
            "rt-1",
            seeds=[7, -2],
            options={"a": [1, 2.5], "b": None},
            timeout_ms=250,
            env_indices=[2, 0],
        )
    )
    assert reset == env_v1.JoinRequest(
        reset=env_v1.ResetRequest(
            seeds=[7, -2],
            options=to_meta_map({"a": [1, 2.5], "b": None}),
            timeout_ms=250,
            env_indices=[2, 0],
        ),
        request_id="rt-1",
    )
    step = decode_join_request(step_request("rt-2", [b"\x01", b""], env_indices=[1]))
    assert step == env_v1.JoinRequest(
        step=env_v1.StepRequest(
            action=spaces_v1.SpaceValue(leaves=[b"\x01", b""]), env_indices=[1]
        ),
        request_id="rt-2",
    )
    assert decode_join_request(render_request("r", [0])) == env_v1.JoinRequest(
        render=env_v1.RenderRequest(env_indices=[0]), request_id="r"
    )
    assert decode_join_request(close_request("c", "bye")) == env_v1.JoinRequest(
        close=env_v1.CloseEnvsRequest(reason="bye"), request_id="c"
    )
    assert decode_join_request(configure_request("")) == env_v1.JoinRequest(
        configure=env_v1.ConfigureEnvRequest(selected_workflow_edition="2026.06")
    )


def test_replies_encoded_by_the_server_decode_back() -> None:
    infos = {
        "final_info": [{"x": [1, None, "t", b"\x00", {"k": 1.5}]}, {}],
        "_final_info": [True, False],
    }
    episode = env_v1.EpisodeMetadata(
        episode_id="e1",
        seed=-5,
        env_index=1,
        step_count=9,
        cumulative_reward=3.5,
        terminated=True,
        start_timestamp_ns=10,
        end_timestamp_ns=20,
        final_info=to_meta_map({"y": True}),
    )
    data = encode_join_response(
        env_v1.JoinResponse(
            step=env_v1.StepResponse(
                observation=spaces_v1.SpaceValue(leaves=[b"ab", b"c"]),
                rewards=[1.0, -0.5],
                terminated_mask=b"\x01\x00",
                truncated_mask=b"\x00\x00",
                infos=to_meta_map(infos),
                completed_episodes=[episode],
                env_indices=[3, 1],
            ),
            request_id="rt-9",
            endpoint_total_ns=5,
            queue_ns=2,
        )
    )
    reply = decode_reply(data)
    assert (reply.kind, reply.request_id, reply.leaves) == ("step", "rt-9", [b"ab", b"c"])
    assert reply.rewards == [1.0, -0.5] and reply.env_indices == [3, 1]
    assert (reply.terminated, reply.truncated) == (b"\x01\x00", b"\x00\x00")
    assert reply.infos == infos
    assert reply.timings == {"endpoint_total_ns": 5, "queue_ns": 2}
    (ep,) = reply.episodes
    assert (ep.episode_id, ep.seed, ep.env_index, ep.step_count, ep.cumulative_reward) == (
        "e1",
        -5,
        1,
        9,
        3.5,
    )
    assert ep.terminated and not ep.truncated and ep.final_info == {"y": True}
    error = decode_reply(
        encode_join_response(
            env_v1.JoinResponse(
                error=env_v1.EnvError(
                    code=env_v1.EnvErrorCode.TIMEOUT, message="late", is_recoverable=True
                ),
                request_id="rt-3",
            )
        )
    )
    assert (error.kind, error.error_code, error.error_message, error.error_recoverable) == (
        "error",
        1,
        "late",
        True,
    )
    assert decode_reply(b"").kind == ""
    with pytest.raises(DecodeError, match=r"buffer underflow|invalid"):
        decode_reply(b"\x12\x05\x00")


def _step_reply(infos: dict[str, Any], k: int) -> bytes:
    return encode_join_response(
        env_v1.JoinResponse(
            step=env_v1.StepResponse(
                observation=spaces_v1.SpaceValue(leaves=[b"\x00" * k]),
                rewards=[0.0] * k,
                terminated_mask=b"\x00" * k,
                truncated_mask=b"\x00" * k,
                infos=to_meta_map(infos),
            ),
            request_id="rt-1",
        )
    )


@pytest.mark.parametrize("k", [2, 8])
def test_lanes_empty_infos_decode_the_same_each_time(k: int) -> None:
    # The second decode of an encoding already seen takes the shortcut: equal infos,
    # fresh objects (a caller may keep or change them), flagged as nothing to add.
    for order in (["final_info", "_final_info"], ["_final_info", "final_info"]):
        empty = {"final_info": [{}] * k, "_final_info": [False] * k}
        infos = {key: empty[key] for key in order}
        data = _step_reply(infos, k)
        first, second = decode_reply(data), decode_reply(data)
        for reply in (first, second):
            assert reply.infos == infos and list(reply.infos) == order
            assert reply.empty_lane_infos
        assert second.infos["final_info"][0] is not first.infos["final_info"][0]
        second.infos["final_info"][0]["x"] = 1
        assert decode_reply(data).infos == infos
    # Not empty: a lane's info, a set mask, another key, one lane.
    for infos, lanes in [
        ({"final_info": [{"x": 1}] + [{}] * (k - 1), "_final_info": [True] + [False] * (k - 1)}, k),
        ({"final_info": [{}] * k, "_final_info": [True] + [False] * (k - 1)}, k),
        ({"final_info": [{}] * k, "_final_info": [False] * k, "y": 2}, k),
        ({"final_info": [{}], "_final_info": [False]}, 1),
    ]:
        data = _step_reply(infos, lanes)
        for _ in range(2):
            reply = decode_reply(data)
            assert reply.infos == infos and not reply.empty_lane_infos


def handshake(**base: Any) -> bytes:
    space = space_to_spec(spaces.Discrete(2))
    defaults: dict[str, Any] = {
        "compatible": True,
        "supported_workflow_editions": ["2026.06"],
        "preferred_workflow_edition": "2026.06",
    }
    defaults.update(base)
    return bytes(
        env_v1.HandshakeResponse(
            base=core_v1.HandshakeResponse(**defaults),
            env_contract=core_v1.EnvContract(
                spec=core_v1.EnvSpec(id="X-v0", action_space=space, observation_space=space),
                num_envs=2,
            ),
        )
    )


def test_handshake_checks() -> None:
    contract = contract_from_handshake(handshake())
    assert (contract.env_id, contract.num_envs, contract.action_space) == (
        "X-v0",
        2,
        gym.spaces.Discrete(2),
    )
    with pytest.raises(HandshakeError, match="protocol generation"):
        contract_from_handshake(
            handshake(compatible=False, error_message="protocol generation x not compatible")
        )
    with pytest.raises(HandshakeError, match="no mutual workflow edition"):
        contract_from_handshake(
            handshake(supported_workflow_editions=["2099.01"], preferred_workflow_edition="2099.01")
        )
    with pytest.raises(HandshakeError, match="no env contract"):
        contract_from_handshake(
            bytes(
                env_v1.HandshakeResponse(
                    base=core_v1.HandshakeResponse(
                        compatible=True, supported_workflow_editions=["2026.06"]
                    )
                )
            )
        )
    with pytest.raises(HandshakeError, match="undecodable"):
        contract_from_handshake(b"\x0a\xff")


def test_errors_are_one_family_and_pickle() -> None:
    error = EnvError("boom", code=ErrorCode.INTERNAL, is_recoverable=False, request_id="rt-1")
    # One root for the package; a client error carries what the server answered
    # (is_recoverable), not a server-side default under another name.
    assert isinstance(error, RlmeshTrioError) and not isinstance(error, MappedError)
    recoverable = EnvError("late", code=ErrorCode.TIMEOUT, is_recoverable=True)
    assert recoverable.is_recoverable and not hasattr(recoverable, "recoverable")
    assert not hasattr(RpcError(16, "x"), "env_code")
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), again.code, again.is_recoverable, again.message, again.request_id) == (
        EnvError,
        ErrorCode.INTERNAL,
        False,
        "boom",
        "rt-1",
    )
    assert str(error) == "INTERNAL (fatal): boom"
    rpc = RpcError(16, "invalid env token")
    again_rpc = pickle.loads(pickle.dumps(rpc))
    assert (again_rpc.grpc_status, str(again_rpc)) == (16, "UNAUTHENTICATED: invalid env token")
    assert isinstance(EndpointClosedError(), type(error).__mro__[1])
    assert ErrorCode.of(99) is ErrorCode.UNSPECIFIED


GRPC_STATUSES = {
    0: "OK",
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    11: "OUT_OF_RANGE",
    12: "UNIMPLEMENTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}
"""The gRPC spec's status codes (grpc/doc/statuscodes.md), written out independently."""


@pytest.mark.parametrize(("status", "name"), sorted(GRPC_STATUSES.items()))
def test_an_rpc_error_names_its_grpc_status(status: int, name: str) -> None:
    error = RpcError(status, "the server's words")
    assert (error.grpc_status, error.grpc_status_name, error.grpc_message) == (
        status,
        name,
        "the server's words",
    )
    assert str(error) == error.message == f"{name}: the server's words"
    assert str(RpcError(status, "")) == name
    assert not error.is_recoverable


def test_an_rpc_error_outside_the_standard_statuses_and_its_codes() -> None:
    assert str(RpcError(17, "odd")) == "gRPC status 17: odd"
    assert RpcError(17, "odd").grpc_status_name == "gRPC status 17"
    codes = {status: RpcError(status, "").code for status in GRPC_STATUSES}
    assert codes[1] == ErrorCode.CANCELLED and codes[4] == ErrorCode.TIMEOUT
    assert codes[9] == ErrorCode.BUSY and codes[12] == ErrorCode.UNSUPPORTED
    assert codes[14] == ErrorCode.CLOSED and codes[16] == ErrorCode.UNSPECIFIED


@pytest.mark.parametrize(
    ("seconds", "ms"),
    [
        (None, 0),
        (0, 0),
        (0.0, 0),
        (2.5, 2500),
        (0.001, 1),
        (0.0015, 1),  # whole milliseconds, the rest dropped
        (0.0019999999, 2),  # ... after rounding to the nanosecond
        (1.005, 1005),  # 1.005 * 1000 is 1004.999... in floats
        (0.29, 290),
        (300, 300_000),
        (np.float32(0.25), 250),
    ],
)
def test_request_timeout_seconds_to_the_wires_milliseconds(seconds: Any, ms: int) -> None:
    """As rlmesh 0.1.0's RemoteEnv converts ``request_timeout_seconds`` (the values
    measured on its wire; tests/test_client_gym.py compares the two end to end)."""
    assert request_timeout_ms(seconds) == ms


@pytest.mark.parametrize(
    ("seconds", "error", "match"),
    [
        (0.0004, ValueError, "under the wire's 1 ms resolution"),
        (-1, ValueError, ">= 0"),
        (float("nan"), ValueError, ">= 0"),
        (float("inf"), ValueError, ">= 0"),
        ("1", TypeError, "must be a number"),
        (True, TypeError, "must be a number"),
    ],
)
def test_request_timeout_seconds_refused(seconds: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        request_timeout_ms(seconds)


class _Server:
    """The server's side of one HTTP/2 connection (``h2``), facing a
    :class:`GrpcConnection`: what it sends is fed to the client straight away."""

    def __init__(self, client: GrpcConnection) -> None:
        self.client = client
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.h2.initiate_connection()
        self.pump()

    def pump(self) -> None:
        self.h2.receive_data(self.client.data_to_send())
        data = self.h2.data_to_send()
        if data:  # (no bytes at all would read as the end of the connection)
            self.client.receive(data)

    def goaway_then_send(self, stream_id: int, data: bytes, *, goaway: bool = True) -> None:
        """A graceful GOAWAY (when ``goaway``), then ``data`` on a stream still open (h2
        refuses to send after its own GOAWAY: the frames are reordered by hand)."""
        self.h2.send_data(stream_id, data)
        message = self.h2.data_to_send()
        if goaway:
            self.h2.close_connection(error_code=0, last_stream_id=stream_id)
            self.client.receive(self.h2.data_to_send())
        self.client.receive(message)


def _joined_with_two_requests() -> tuple[_Server, JoinStream, Slot, Slot]:
    """A Join (2 lanes) with a lane-scoped reset of lane 1 and a step of lane 0 waiting."""
    client = GrpcConnection("localhost", [])
    server = _Server(client)
    join = client.open(JOIN_PATH)
    state = JoinStream(client, join, contract_from_handshake(handshake()))
    reset = state.submit(
        reset_request("rt-1", seeds=[], options=None, timeout_ms=0, env_indices=[1]),
        "rt-1",
        lambda: None,
        verb="reset",
        lanes=[1],
    )
    step = state.submit(
        step_request("rt-2", [b"\x00"], env_indices=[0]),
        "rt-2",
        lambda: None,
        verb="step",
        lanes=[0],
    )
    server.pump()
    server.h2.send_headers(join.id, [(":status", "200"), ("content-type", "application/grpc")])
    server.pump()
    return server, state, reset, step


@pytest.mark.parametrize("goaway", [None, 0, 2])
def test_a_connection_cut_after_a_graceful_goaway_is_the_servers_shutdown(
    goaway: int | None,
) -> None:
    """A server that sent GOAWAY(NO_ERROR) and then cut the connection is shutting down:
    each waiting request says so, with the lanes it waited for. Without a GOAWAY the cut
    is a lost connection; a GOAWAY with an error code, the server's error."""
    server, state, reset, step = _joined_with_two_requests()
    if goaway is not None:
        server.h2.close_connection(error_code=goaway, last_stream_id=state.join.id)
        server.pump()
    state.process()
    server.client.receive(b"")  # the server closed the connection
    state.process()
    assert isinstance(reset.error, ConnectionLostError)
    assert isinstance(step.error, ConnectionLostError)
    if goaway == 0:
        assert reset.error.message == (
            "the server is shutting down (GOAWAY received) before lane 1 answered the "
            "reset (the Join stream ended: the server closed the connection)"
        )
        assert step.error.message.startswith(
            "the server is shutting down (GOAWAY received) before lane 0 answered the step"
        )
        assert str(state.failure).endswith(
            "the server is shutting down (GOAWAY received): the Join stream ended: "
            "the server closed the connection"
        )
    elif goaway == 2:
        assert reset.error.message == (
            "the Join stream ended: the server sent GOAWAY (error code 2)"
        )
    else:
        assert reset.error.message == "the Join stream ended: the server closed the connection"
        assert step.error.message == reset.error.message


def _fatal(request_id: str, message: str) -> env_v1.JoinResponse:
    """A fatal INTERNAL in-band error answering ``request_id``."""
    return env_v1.JoinResponse(
        error=env_v1.EnvError(
            code=env_v1.EnvErrorCode.INTERNAL, message=message, is_recoverable=False
        ),
        request_id=request_id,
    )


@pytest.mark.parametrize("goaway", [False, True])
def test_a_lane_stopped_by_the_servers_shutdown(goaway: bool) -> None:
    """rlmesh-trio's server answers the lane jobs its stop cut short "lane <i> stopped
    before answering" (INTERNAL, fatal). After its GOAWAY that is the shutdown, told as
    a lost connection (the server's words kept as the cause); without one it stays the
    env error it says it is."""
    server, state, reset, step = _joined_with_two_requests()
    answer = _fatal("rt-1", "lane 1 stopped before answering")
    server.goaway_then_send(state.join.id, frame(encode_join_response(answer)), goaway=goaway)
    state.process()
    if not goaway:
        assert isinstance(reset.error, EnvError) and reset.error.code == ErrorCode.INTERNAL
        assert reset.error.message == "lane 1 stopped before answering"
        assert isinstance(step.error, EndpointClosedError)
        return
    assert isinstance(reset.error, ConnectionLostError)
    assert reset.error.message == (
        "the server is shutting down (GOAWAY received) before lane 1 answered the reset "
        "(the server said: lane 1 stopped before answering)"
    )
    assert isinstance(reset.error.__cause__, EnvError)
    assert isinstance(step.error, ConnectionLostError)
    assert step.error.message == (
        "the server is shutting down (GOAWAY received) before lane 0 answered the step "
        "(the server's stop cut the requests in flight short)"
    )
    with pytest.raises(EndpointClosedError, match="shutting down"):
        state.check_open()


def test_an_env_error_after_a_graceful_goaway_stays_an_env_error() -> None:
    """Only the server's lane-stopped answer means the shutdown: an env's own failure
    during the drain is still that failure."""
    server, state, reset, _step = _joined_with_two_requests()
    answer = _fatal("rt-1", "reset failed: RuntimeError: boom")
    server.goaway_then_send(state.join.id, frame(encode_join_response(answer)))
    state.process()
    assert isinstance(reset.error, EnvError)
    assert reset.error.message == "reset failed: RuntimeError: boom"


async def test_big_messages_go_through_flow_control() -> None:
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 256, (3, *EchoEnv.SHAPE), dtype=np.uint8)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            info = await nursery.start(functools.partial(serve_env, EchoEnv, num_envs=3))
            async with open_endpoint(info.address) as ep:
                await ep.reset()
                obs, *_ = await ep.step(actions)
                assert np.array_equal(obs, actions)
                obs, *_ = await ep.step(actions[::-1].copy(), env_indices=[2, 1, 0])
                assert np.array_equal(obs, actions[::-1])
            nursery.cancel_scope.cancel()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", [pytest.param("ref", marks=pytest.mark.interop), "ours"])
def test_big_replies_reopen_the_clients_window(servers: ServerPool, kind: str) -> None:
    """5 x 3.75 MiB of replies: past the client's 16 MiB receive window, which the
    client's own WINDOW_UPDATEs reopen (DATA read past h2), against both servers (the
    reference's h2 is the peer most likely to stall on a mistake there)."""
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 256, (3, *EchoEnv.SHAPE), dtype=np.uint8)
    server = servers.get(kind, ServerConfig(entrypoint="support.envs:make_echo", num_envs=3))
    env = VectorEnv(server.address)
    try:
        env.reset()
        for i in range(5):
            batch = actions if i % 2 == 0 else actions[::-1].copy()
            got = env.step(batch)[0]
            assert np.array_equal(got, batch)
    finally:
        env.close()


@pytest.mark.parametrize(
    "space",
    [
        spaces.Box(-1.0, 1.0, (2, 3), np.float32),
        spaces.Box(0, 255, (4,), np.uint8),
        spaces.Box(0, 1, (3,), np.bool_),
        spaces.Box(-1.0, 1.0, (), np.float32),
        spaces.Discrete(5, start=-2),
        spaces.MultiBinary((2, 2)),
        spaces.MultiDiscrete([3, 4]),
    ],
    ids=repr,
)
def test_the_fixed_leaf_fast_path_equals_the_general_codec(space: gym.spaces.Space[Any]) -> None:
    """Single-leaf spaces skip the per-lane conversion; the bytes and the batches must be
    exactly those of the general path (the package codec + gymnasium's batching)."""
    from rlmesh_trio.client._codecs import Codecs, _own
    from rlmesh_trio.client._contract import Contract

    codecs = Codecs(Contract("X-v0", 3, None, "DISABLED", {}, {}, space, space))
    assert codecs.fast_action is not None and codecs.fast_observation is not None
    batched = gym.vector.utils.batch_space(space, 3)
    batched.seed(1)
    for _ in range(5):
        actions = batched.sample()
        rows = list(gym.vector.utils.iterate(batched, actions))
        general = codecs.action.encode_batch(rows)
        assert codecs.encode_actions(actions, 3) == general
        fast = codecs.observation_batch(general, 3)
        slow = gym.vector.utils.concatenate(
            space,
            codecs.observation.decode(general, 3),
            gym.vector.utils.create_empty_array(space, 3),
        )
        assert fast.dtype == slow.dtype and fast.shape == slow.shape and np.array_equal(fast, slow)
        assert fast.flags.writeable
        # Each lane's value as the env hands it: a 0-d array for a Box of shape ().
        for mine, owned in zip(
            codecs.observations(general, 3),
            [_own(space, v) for v in codecs.observation.decode(general, 3)],
            strict=True,
        ):
            assert type(mine) is type(owned) and np.array_equal(mine, owned)
            assert np.asarray(mine).dtype == np.asarray(owned).dtype
    # Values the fast path does not take go through the general conversion and checks.
    if isinstance(space, spaces.Discrete):
        assert codecs.encode_actions([1.0, 2.0, 0.0], 3) == codecs.action.encode_batch([1, 2, 0])
    with pytest.raises(EnvError) as info:
        codecs.encode_actions(np.zeros((2, 9)), 3)
    assert (info.value.code, info.value.is_recoverable) == (ErrorCode.INVALID_ACTION, True)
    with pytest.raises(Exception, match="malformed reply"):
        codecs.observation_batch([b"\x00"], 3)


@pytest.mark.parametrize(
    ("space", "wide"),
    [
        (spaces.Box(-5, 5, (2,), np.int8), [[300, -129], [256, 1]]),
        (spaces.Box(0, 1000, (2,), np.uint16), [[-1, 70000], [1, 2]]),
        (spaces.Box(-5, 5, (2,), np.int32), [[2**31, 0], [0, 0]]),
    ],
    ids=lambda v: str(getattr(v, "dtype", "")),
)
def test_integer_actions_the_wire_dtype_cannot_hold_are_refused_not_wrapped(
    space: spaces.Box, wide: list[list[int]]
) -> None:
    """An integer Box narrower than the actions' array: values it can hold take the fast
    path; a value it cannot hold is refused as the general path refuses it (300 sent as
    an int8 would arrive as 44)."""
    from rlmesh_trio.client._codecs import Codecs
    from rlmesh_trio.client._contract import Contract

    codecs = Codecs(Contract("X-v0", 2, None, "DISABLED", {}, {}, space, space))
    fits = np.array([[1, -1 if space.dtype.kind == "i" else 2], [3, 4]], np.int64)
    assert codecs.encode_actions(fits, 2) == codecs.action.encode_batch(list(fits))
    for array in (np.array(wide, np.int64), wide):
        with pytest.raises(EnvError) as info:
            codecs.encode_actions(array, 2)
        assert (info.value.code, info.value.is_recoverable) == (ErrorCode.INVALID_ACTION, True)
        assert "not representable" in info.value.message


def test_the_public_error_codes_are_the_protocols() -> None:
    """``ErrorCode`` mirrors ``rlmesh.env.v1.EnvErrorCode`` member for member."""
    assert {code.name: int(code) for code in ErrorCode} == {
        code.name: int(code) for code in env_v1.EnvErrorCode
    }


class _StubJoin:
    """What ``JoinStream.process`` reads of a Join call: the replies read, its end."""

    def __init__(self) -> None:
        import collections

        self.messages: collections.deque[bytes] = collections.deque()
        self.ended = False
        self.status = None
        self.status_message = ""


class _StubConn:
    lost = None
    shutting_down = False

    def __init__(self) -> None:
        self.cancelled: list[object] = []

    def cancel(self, call: object) -> None:
        self.cancelled.append(call)

    def send(self, call: object, payload: bytes, end: bool = False) -> None:
        pass


def test_a_reply_to_a_request_never_sent_is_a_protocol_error() -> None:
    """Issue 19, finding 7: a reply whose request_id the endpoint never sent (the late
    replies of cancelled calls excepted) fails the endpoint as a malformed reply."""
    from rlmesh_trio.client._core import JoinStream

    conn, join = _StubConn(), _StubJoin()
    state = JoinStream(conn, join, contract_from_handshake(handshake()))  # type: ignore[arg-type]
    kept = state.submit(b"", "rt-1", lambda: None)
    state.submit(b"", "rt-2", lambda: None)
    state.abandon("rt-2")  # a cancelled call: its late reply is dropped
    configure = env_v1.JoinResponse(configure=env_v1.ConfigureEnvResponse())
    for rid in ("rt-2", "rt-1"):
        configure.request_id = rid
        join.messages.append(encode_join_response(configure))
    state.process()
    assert state.failure is None and kept.reply is not None and not state.abandoned
    waiting = state.submit(b"", "rt-3", lambda: None)
    configure.request_id = "rt-99"
    join.messages.append(encode_join_response(configure))
    state.process()
    assert state.failure is not None and state.failure.code == ErrorCode.INTERNAL
    assert "a reply to request_id 'rt-99', never sent" in str(state.failure)
    assert isinstance(waiting.error, EndpointError) and conn.cancelled == [join]


@pytest.mark.parametrize("chunk", [1, 7, 100, 1 << 20])
def test_data_frames_read_past_h2_in_any_chunking(chunk: int) -> None:
    # Response headers, DATA (read by GrpcConnection itself once the headers came) and
    # trailers, fed in pieces of ``chunk`` bytes: the same messages and ending, and the
    # frames h2 must judge (headers, trailers, END_STREAM) still reach it.
    client = GrpcConnection("localhost", [])
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()
    client.receive(server.data_to_send())
    call = client.open(JOIN_PATH)
    client.send(call, b"hello")
    server.receive_data(client.data_to_send())
    server.send_headers(call.id, [(":status", "200"), ("content-type", "application/grpc")])
    messages = [bytes([i]) * (i * 997 % 40000) for i in range(1, 12)]
    for message in messages:
        server.send_data(call.id, frame(message))
    server.send_data(call.id, frame(b"last"), end_stream=False)
    server.send_headers(call.id, [("grpc-status", "0")], end_stream=True)
    data = server.data_to_send()
    for i in range(0, len(data), chunk):
        client.receive(data[i : i + chunk])
    assert client.lost is None
    assert list(call.messages) == [*messages, b"last"]
    assert call.ended and call.status == 0


def test_data_read_past_h2_gives_its_window_back() -> None:
    # 20 MiB on one stream through a 16 MiB receive window: the client's own
    # WINDOW_UPDATEs (connection and stream) let the server send all of it.
    client = GrpcConnection("localhost", [])
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()
    client.receive(server.data_to_send())
    call = client.open(JOIN_PATH)
    server.receive_data(client.data_to_send())
    server.send_headers(call.id, [(":status", "200"), ("content-type", "application/grpc")])
    message = frame(b"\x01" * (1 << 20))
    sent = 0
    while sent < 20:
        window = server.local_flow_control_window(call.id)
        assert window >= len(message), f"the window was not given back after {sent} MiB"
        for i in range(0, len(message), server.max_outbound_frame_size):
            server.send_data(call.id, message[i : i + server.max_outbound_frame_size])
        client.receive(server.data_to_send())
        server.receive_data(client.data_to_send())  # the client's WINDOW_UPDATEs
        sent += 1
    assert client.lost is None and len(call.messages) == 20


def test_data_frames_written_past_h2_as_h2_writes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # The same requests through GrpcConnection's own DATA frames and through
    # h2.send_data: the same bytes on the wire and the same flow-control windows after.
    def run() -> tuple[bytes, int, int]:
        client = GrpcConnection("localhost", [])
        server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        server.initiate_connection()
        client.receive(server.data_to_send())
        call = client.open(JOIN_PATH)
        for size in (5, 300, 40000, 70000):
            client.send(call, bytes([size % 251]) * size)
        client.send(call, b"end", end=True)
        wire = client.data_to_send()
        conn = client._h2
        return wire, conn.outbound_flow_control_window, conn.local_flow_control_window(call.id)

    calls: list[int] = []
    real_send_data = h2.connection.H2Connection.send_data

    def counted(self: Any, stream_id: int, data: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(data))
        return real_send_data(self, stream_id, data, *args, **kwargs)

    monkeypatch.setattr(h2.connection.H2Connection, "send_data", counted)
    fast = run()
    through_h2 = len(calls)
    calls.clear()
    monkeypatch.setattr(
        GrpcConnection,
        "_send_data",
        lambda self, stream_id, chunk: self._h2.send_data(stream_id, chunk.tobytes()),
    )
    assert run() == fast
    # the fast run did write its messages past h2 (at most the last, END_STREAM frame
    # went through it), the slow one through h2 -- where this h2 and the environment
    # leave the direct path on (the client checks both, per frame)
    probe = GrpcConnection("localhost", [])
    direct = _grpc._DIRECT_DATA and isinstance(getattr(probe._h2, "_data_to_send", None), bytearray)
    if direct:
        assert through_h2 <= 1 and len(calls) > through_h2 + 3


# ---- close waits for the server's end of the Join ------------------------------------


def _lanes_handshake() -> bytes:
    """A 2-lane endpoint as rlmesh-trio serves one (autoreset DISABLED: the client
    autoresets)."""
    response = env_v1.HandshakeResponse.parse(handshake(capabilities={"subset_step": "true"}))
    assert response.env_contract is not None
    response.env_contract.autoreset_mode = core_v1.AutoresetMode.DISABLED
    return bytes(response)


class _LateEnder:
    """A one-connection server (h2, on Trio) that answers the Handshake, Configure and
    Close, then ends the Join stream ``end_after`` seconds after its Close reply (None:
    never). It notes when it ended the stream and when the client closed."""

    def __init__(self, end_after: float | None) -> None:
        self.end_after = end_after
        self.ended_at: float | None = None
        self.client_gone_at: float | None = None
        self._answering: set[int] = set()  # streams whose response headers went out
        self._sending = trio.Lock()  # the reading loop and a late end both write

    async def _flush(self, conn: h2.connection.H2Connection, stream: trio.SocketStream) -> None:
        async with self._sending:
            await stream.send_all(conn.data_to_send())

    async def serve(self, listener: trio.SocketListener) -> None:
        async with listener, await listener.accept() as stream:
            await self._serve(stream)

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        conn.initiate_connection()
        paths: dict[int, str] = {}
        buffers: dict[int, bytes] = {}
        async with trio.open_nursery() as nursery:
            try:
                await self._flush(conn, stream)
                while data := await stream.receive_some(65536):
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.RequestReceived):
                            paths[event.stream_id] = dict(event.headers)[":path"]
                            buffers[event.stream_id] = b""
                        elif isinstance(event, h2.events.DataReceived):
                            conn.acknowledge_received_data(
                                event.flow_controlled_length, event.stream_id
                            )
                            buffers[event.stream_id] += event.data
                            if paths[event.stream_id] == JOIN_PATH:
                                self._join(conn, event.stream_id, buffers, nursery, stream)
                        elif (
                            isinstance(event, h2.events.StreamEnded)
                            and paths.get(event.stream_id) == HANDSHAKE_PATH
                        ):
                            self._reply(conn, event.stream_id, _lanes_handshake(), end=True)
                    await self._flush(conn, stream)
            except trio.BrokenResourceError:
                pass
            self.client_gone_at = trio.current_time()
            nursery.cancel_scope.cancel()

    def _join(
        self,
        conn: h2.connection.H2Connection,
        stream_id: int,
        buffers: dict[int, bytes],
        nursery: trio.Nursery,
        stream: trio.SocketStream,
    ) -> None:
        data = buffers[stream_id]
        while len(data) >= 5 and len(data) >= 5 + int.from_bytes(data[1:5], "big"):
            size = int.from_bytes(data[1:5], "big")
            request = env_v1.JoinRequest().parse(data[5 : 5 + size])
            data = data[5 + size :]
            response = env_v1.JoinResponse(request_id=request.request_id)
            if request.configure is not None:
                response.configure = env_v1.ConfigureEnvResponse()
            else:
                assert request.close is not None, request
                response.close = env_v1.CloseEnvsResponse()
                nursery.start_soon(self._end_later, conn, stream_id, stream)
            self._reply(conn, stream_id, bytes(response), end=False)
        buffers[stream_id] = data

    def _reply(
        self, conn: h2.connection.H2Connection, stream_id: int, message: bytes, *, end: bool
    ) -> None:
        if stream_id not in self._answering:
            self._answering.add(stream_id)
            conn.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
        conn.send_data(stream_id, frame(message))
        if end:
            conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)

    async def _end_later(
        self, conn: h2.connection.H2Connection, stream_id: int, stream: trio.SocketStream
    ) -> None:
        if self.end_after is None:
            await trio.sleep_forever()
        await trio.sleep(self.end_after)
        conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)
        self.ended_at = trio.current_time()
        await self._flush(conn, stream)


CLOSE_TIMEOUTS = {0.5: 5.0, None: 1.5}
"""The client's close timeout for a server that ends the Join 0.5 s after its Close reply
(generous), and for one that never does (what the close then takes)."""


@pytest.mark.parametrize("end_after", [0.5, None])
async def test_aclose_waits_for_the_servers_end_of_the_join_within_its_timeout(
    end_after: float | None,
) -> None:
    """After the Close reply, the connection is closed only once the server ended the
    Join (then its session is over: a new Join is admitted at once), or at the close
    timeout if it never does."""
    server = _LateEnder(end_after)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve, listeners[0])
            timeout = CLOSE_TIMEOUTS[end_after]
            async with open_endpoint(f"127.0.0.1:{port}", close_timeout_seconds=timeout) as ep:
                started = trio.current_time()
                assert await ep.aclose() == []
                took = trio.current_time() - started
    assert server.client_gone_at is not None
    if end_after is None:
        assert server.ended_at is None
        assert 1.5 <= took < 1.5 + 5.0  # the close timeout (and the 1 s shutdown bound)
    else:
        assert server.ended_at is not None
        assert server.client_gone_at >= server.ended_at
        assert end_after <= took < 5.0


@pytest.mark.parametrize("end_after", [0.5, None])
async def test_blocking_close_waits_for_the_servers_end_of_the_join_within_its_timeout(
    end_after: float | None,
) -> None:
    server = _LateEnder(end_after)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    def session() -> float:
        envs = VectorEnv(f"127.0.0.1:{port}", close_timeout_seconds=CLOSE_TIMEOUTS[end_after])
        started = time.monotonic()
        envs.close()
        return time.monotonic() - started

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve, listeners[0])
            took = await trio.to_thread.run_sync(session)
    assert server.client_gone_at is not None
    if end_after is None:
        assert server.ended_at is None
        assert 1.5 <= took < 1.5 + 5.0
    else:
        assert server.ended_at is not None
        assert server.client_gone_at >= server.ended_at
        assert end_after <= took < 5.0


SEED_CASES = [
    # (seeds for 3 lanes, what the Trio endpoint sends or the error it raises)
    (None, []),
    (5, [5, 6, 7]),
    (np.int64(2), [2, 3, 4]),
    ([None, None, None], []),
    ((1, 2, 3), [1, 2, 3]),
    ([None, 1.5, 2], (ValueError, "all ints or all None")),  # the mix, before the seeds
    ([None, None, 2**64], (ValueError, "all ints or all None")),
    ([1, 2], (ValueError, "2 seeds for 3 lanes")),
    ([1, 2, 2**63], (ValueError, "does not fit the protocol's int64 seeds")),
    ([1, 2, 1.5], (TypeError, "float")),
    (2**63 - 2, (ValueError, "does not fit")),  # the third lane's seed is 2**63
]


@pytest.mark.parametrize(("seeds", "expected"), SEED_CASES)
def test_the_endpoints_seeds(seeds: Any, expected: Any) -> None:
    if isinstance(expected, list):
        assert request_seeds(seeds, 3) == expected
    else:
        error, words = expected
        with pytest.raises(error, match=words):
            request_seeds(seeds, 3)
