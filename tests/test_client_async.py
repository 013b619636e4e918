"""The Trio client against both servers: pipelining, deadlines, cancellation, errors,
a server that vanishes, auth, unix sockets."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import trio
from support import envs
from support.refserver import ServerConfig, ServerPool

from rlmesh_trio import ServeOptions, serve_env
from rlmesh_trio.client import (
    ConnectionLostError,
    Endpoint,
    EndpointClosedError,
    EnvError,
    ErrorCode,
    RpcError,
    open_endpoint,
)

pytestmark = [pytest.mark.interop, pytest.mark.timeout(120)]

KINDS = ["ref", "ours"]
BOUND = 30.0
"""Generous bound (seconds) on any single wait of these tests: they fail, never hang."""


async def server(pool: ServerPool, kind: str, fresh: bool = False, **config: Any) -> Any:
    cfg = ServerConfig(**config)
    if fresh:
        return await trio.to_thread.run_sync(functools.partial(pool.fresh, kind, cfg))
    return await trio.to_thread.run_sync(functools.partial(pool.get, kind, cfg))


@contextlib.asynccontextmanager
async def reopened(address: str) -> AsyncIterator[Endpoint]:
    """``open_endpoint`` right after the previous session on ``address`` ended. The
    server frees its one Join slot in its own time after it ended the stream (the
    reference's is not observable): until then a new Join is refused as BUSY, so it is
    retried (within BOUND), as a user reconnecting would."""
    while True:
        stack = contextlib.AsyncExitStack()
        try:
            ep = await stack.enter_async_context(open_endpoint(address))
        except RpcError as exc:
            if exc.code != ErrorCode.BUSY:
                raise
            await trio.sleep(0.05)  # the server's release of the old Join is not observable
            continue
        async with stack:
            yield ep
        return


@pytest.mark.parametrize("kind", KINDS)
async def test_reset_step_close_follow_the_local_envs(servers: ServerPool, kind: str) -> None:
    srv = await server(servers, kind, entrypoint="support.envs:make_cartpole", num_envs=3)
    local = [envs.make_cartpole() for _ in range(3)]
    with trio.fail_after(BOUND):
        async with open_endpoint(srv.address) as ep:
            assert ep.num_envs == 3
            assert ep.contract.env_id == "CartPole-v1"
            assert ep.contract.subset_step
            assert ep.single_action_space == gym.spaces.Discrete(2)
            assert ep.single_observation_space == local[0].observation_space
            obs, infos = await ep.reset(seeds=[1, 2, 3])
            want = np.stack([env.reset(seed=s)[0] for env, s in zip(local, (1, 2, 3), strict=True)])
            assert obs.dtype == np.float32 and np.array_equal(obs, want)
            assert infos == {"final_info": [{}, {}, {}], "_final_info": [True, True, True]}
            # Lane-scoped: batched in env_indices order.
            obs, rew, term, trunc, infos = await ep.step(np.array([1, 0]), env_indices=[2, 0])
            assert np.array_equal(obs, np.stack([local[2].step(1)[0], local[0].step(0)[0]]))
            assert rew.tolist() == [1.0, 1.0] and not term.any() and not trunc.any()
            obs, rew, term, trunc, infos = await ep.step(np.array([0, 1, 0]))
            assert np.array_equal(
                obs, np.stack([e.step(a)[0] for e, a in zip(local, (0, 1, 0), strict=True)])
            )
            episodes = await ep.aclose()
        assert sorted((e.env_index, e.step_count, e.truncated, e.seed) for e in episodes) == [
            (0, 2, True, 1),
            (1, 1, True, 2),
            (2, 2, True, 3),
        ]
        assert ep.closed
        with pytest.raises(EndpointClosedError):
            await ep.step(np.array([0, 0, 0]))


@pytest.mark.parametrize("kind", KINDS)
async def test_two_tasks_drive_two_lanes_independently(servers: ServerPool, kind: str) -> None:
    """A slow lane-0 step is in flight while another task makes three steps on lane 1:
    replies come back out of order, each to its own caller."""
    srv = await server(servers, kind, entrypoint="support.envs:make_slow", num_envs=2)
    order: list[str] = []
    with trio.fail_after(BOUND):
        async with open_endpoint(srv.address) as ep:
            await ep.reset(seeds=[0, 1])
            slow_sent = trio.Event()

            async def slow() -> None:
                slow_sent.set()
                obs, rew, *_ = await ep.step(np.array([20]), env_indices=[0])  # 2 s
                assert obs.tolist() == [[1.0]] and rew.tolist() == [20.0]
                order.append("slow")

            async def fast() -> None:
                await slow_sent.wait()
                for t in (1, 2, 3):
                    obs, rew, *_ = await ep.step(np.array([0]), env_indices=[1])
                    assert obs.tolist() == [[float(t)]] and rew.tolist() == [0.0]
                    order.append(f"fast{t}")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow)
                nursery.start_soon(fast)
    assert order == ["fast1", "fast2", "fast3", "slow"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_cancelled_call_leaves_the_session_usable(servers: ServerPool, kind: str) -> None:
    srv = await server(servers, kind, entrypoint="support.envs:make_slow", num_envs=2)
    with trio.fail_after(BOUND):
        async with open_endpoint(srv.address) as ep:
            await ep.reset()
            with trio.move_on_after(0.2) as scope:
                await ep.step(np.array([10]), env_indices=[0])  # 1 s on the server
            assert scope.cancelled_caught
            # The abandoned step still ran (lane 0 is at t=1); its reply was dropped.
            obs, rew, *_ = await ep.step(np.array([0]), env_indices=[0])
            assert obs.tolist() == [[2.0]] and rew.tolist() == [0.0]
            with trio.move_on_after(0.1) as scope:
                await ep.step(np.array([5, 5]))  # a whole-vector step, cancelled
            assert scope.cancelled_caught
            obs, rew, *_ = await ep.step(np.array([1, 1]))
            assert obs.tolist() == [[4.0], [2.0]] and rew.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("kind", KINDS)
async def test_timeout_ms_is_a_recoverable_error(servers: ServerPool, kind: str) -> None:
    srv = await server(servers, kind, entrypoint="support.envs:make_slow", num_envs=1)
    with trio.fail_after(BOUND):
        async with open_endpoint(srv.address) as ep:
            await ep.reset()
            with pytest.raises(EnvError) as info:
                await ep.step(np.array([5]), timeout_ms=50)
            assert info.value.code == ErrorCode.TIMEOUT and info.value.is_recoverable
            assert "timed out after 50ms" in info.value.message
            obs, *_ = await ep.step(np.array([0]))
            assert obs.tolist() == [[2.0]]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_fatal_env_error_closes_the_endpoint(servers: ServerPool, kind: str) -> None:
    srv = await server(servers, kind, fresh=True, entrypoint="support.envs:make_boom", num_envs=2)
    with trio.fail_after(BOUND):
        async with open_endpoint(srv.address) as ep:
            await ep.reset(seeds=[0, 1])
            with pytest.raises(EnvError) as info:
                await ep.step(np.array([envs.BOOM_STEP_ACTION]), env_indices=[1])
            error = info.value
            assert (error.code, error.is_recoverable) == (ErrorCode.INTERNAL, False)
            assert error.message == "step failed: RuntimeError: boom in step"
            assert error.request_id
            with pytest.raises(EndpointClosedError) as closed:
                await ep.step(np.array([0, 0]))
            assert closed.value.__cause__ is error
            assert ep.closed
            # The request was lane-scoped, the stream still open: closing it ends the
            # session on the server and reports its episodes.
            episodes = await ep.aclose()
        assert sorted((e.env_index, e.step_count, e.truncated) for e in episodes) == [
            (0, 0, True),
            (1, 0, True),
        ]
        # A recoverable error keeps the session: an action outside the space is refused
        # before it is sent.
        async with reopened(srv.address) as ep:
            await ep.reset()
            with pytest.raises(EnvError) as info:
                await ep.step(np.array([7, 0]))
            assert (info.value.code, info.value.is_recoverable) == (ErrorCode.INVALID_ACTION, True)
            await ep.step(np.array([0, 0]))


@pytest.mark.parametrize("kind", KINDS)
async def test_a_server_that_vanishes_fails_every_caller(servers: ServerPool, kind: str) -> None:
    srv = await server(servers, kind, fresh=True, entrypoint="support.envs:make_slow", num_envs=2)
    with trio.fail_after(BOUND):
        async with open_endpoint(srv.address) as ep:
            await ep.reset()
            errors: list[BaseException] = []

            async def waiting(lane: int) -> None:
                try:
                    await ep.step(np.array([30]), env_indices=[lane])  # 3 s
                except ConnectionLostError as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiting, 0)
                nursery.start_soon(waiting, 1)
                await trio.sleep(0.2)  # both requests on the wire (an env call takes 3 s)
                os.kill(srv.pid, signal.SIGKILL)
            assert len(errors) == 2
            assert all(e.code == ErrorCode.CLOSED and not e.is_recoverable for e in errors)
            with pytest.raises(EndpointClosedError) as closed:
                await ep.step(np.array([0, 0]))
            assert isinstance(closed.value.__cause__, ConnectionLostError)
    await trio.to_thread.run_sync(srv.stop)


async def test_a_frozen_server_is_noticed_by_keepalive(servers: ServerPool) -> None:
    srv = await server(servers, "ours", fresh=True, entrypoint="support.envs:make_slow")
    try:
        with trio.fail_after(BOUND):
            async with open_endpoint(
                srv.address, ping_interval_seconds=0.2, ping_timeout_seconds=0.5
            ) as ep:
                await ep.reset()
                srv.freeze()
                with pytest.raises(ConnectionLostError, match="PING"):
                    await ep.step(np.array([0]))
    finally:
        srv.thaw()
        await trio.to_thread.run_sync(srv.stop)


@pytest.mark.parametrize("kind", KINDS)
async def test_unix_socket_and_a_second_join(servers: ServerPool, kind: str) -> None:
    srv = await server(servers, kind, num_envs=1, transport="unix")
    assert srv.address.startswith("unix://")
    with trio.fail_after(BOUND):
        async with open_endpoint(srv.address) as ep:
            obs, _ = await ep.reset(seeds=5)
            assert np.array_equal(obs[0], envs.make_cartpole().reset(seed=5)[0])
            with pytest.raises(RpcError) as info:
                async with open_endpoint(srv.address):
                    pass
            assert info.value.grpc_status == 9 and info.value.code == ErrorCode.BUSY
            assert info.value.grpc_status_name == "FAILED_PRECONDITION"
            # Both servers' words, named by the status: what a user reads.
            assert str(info.value) == (
                "FAILED_PRECONDITION: environment already has an active Join session; "
                "only one client may be connected at a time"
            )
            await ep.step(np.array([1]))


async def test_connect_failures_are_clear_and_bounded(tmp_path: Any) -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there any more
    with trio.fail_after(BOUND):
        with pytest.raises(ConnectionLostError, match="cannot connect"):
            async with open_endpoint(f"127.0.0.1:{port}"):
                pass
        with pytest.raises(ConnectionLostError, match="cannot connect"):
            async with open_endpoint(f"unix://{tmp_path}/missing.sock"):
                pass
        # A peer that accepts but never speaks HTTP/2: connect_timeout_seconds bounds it.
        silent = trio.socket.socket()
        await silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        try:
            with pytest.raises(ConnectionLostError, match=r"connect_timeout_seconds=0\.5"):
                async with open_endpoint(
                    f"127.0.0.1:{silent.getsockname()[1]}", connect_timeout_seconds=0.5
                ):
                    pass
        finally:
            silent.close()
    with pytest.raises(ValueError, match="unsupported address scheme"):
        async with open_endpoint("http://127.0.0.1:1"):
            pass


async def test_a_peer_that_is_not_an_http2_server() -> None:
    """Bytes that are not HTTP/2 end the connection with a clear error, never a hang."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    async def junk() -> None:
        conn, _ = await listener.accept()
        with conn:
            await conn.send(b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(range(256)) * 4)
            await trio.sleep_forever()

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(junk)
            with pytest.raises(ConnectionLostError, match="HTTP/2 protocol error"):
                async with open_endpoint(f"127.0.0.1:{port}"):
                    pass
            nursery.cancel_scope.cancel()
    listener.close()


async def test_serve_and_client_in_one_nursery_with_a_token() -> None:
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            info = await nursery.start(
                functools.partial(
                    serve_env,
                    envs.make_cartpole,
                    num_envs=2,
                    options=ServeOptions(auth_token="s3cret"),
                )
            )
            with pytest.raises(RpcError) as refused:
                async with open_endpoint(info.address, auth_token="wrong"):
                    pass
            assert refused.value.grpc_status == 16
            assert refused.value.grpc_message == "invalid env token"
            assert refused.value.grpc_status_name == "UNAUTHENTICATED"
            assert str(refused.value) == "UNAUTHENTICATED: invalid env token"
            async with open_endpoint(info.address, auth_token="s3cret") as ep:
                obs, _ = await ep.reset(seeds=[3, 4], env_indices=[1, 0])
                assert obs.shape == (2, 4)
                with pytest.raises(ValueError, match="out of range"):
                    await ep.step(np.array([0]), env_indices=[2])
                with pytest.raises(ValueError, match="2 seeds for 1 lanes"):
                    await ep.reset(seeds=[1, 2], env_indices=[0])
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("kind", KINDS)
async def test_aclose_is_bounded_and_fails_pending_calls(servers: ServerPool, kind: str) -> None:
    """Close waits behind a running lane request on the server; with that request stuck
    (HangEnv: 30 s in a subprocess), close_timeout bounds aclose, the connection is
    closed anyway and the waiting caller is told."""
    srv = await server(servers, kind, fresh=True, entrypoint="support.envs:make_hang", num_envs=2)
    outcome: list[BaseException] = []
    try:
        async with open_endpoint(srv.address, close_timeout_seconds=0.5) as ep:
            await ep.reset()
            sent = trio.Event()

            async def waiting() -> None:
                sent.set()
                try:
                    await ep.step(np.array([0]), env_indices=[0])  # never answered in time
                except EndpointClosedError as exc:
                    outcome.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiting)
                await sent.wait()
                await trio.sleep(0.1)  # the step is on the wire
                with trio.fail_after(15):  # half the hang: aclose did not wait for it
                    assert await ep.aclose() == []
        assert len(outcome) == 1
    finally:
        await trio.to_thread.run_sync(srv.kill)


async def test_a_server_stopping_during_a_step_says_it_is_shutting_down() -> None:
    """The server stops (drain 0.2 s) while a 3 s step is in flight: it sends GOAWAY,
    answers the cut-short lane job "lane 0 stopped before answering" and closes. The
    caller is told the server is shutting down, not an INTERNAL env error; the wire
    is the server's as ever (the client reads its GOAWAY)."""
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            server_scope = trio.CancelScope()

            async def run_server(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                with server_scope:
                    await serve_env(
                        envs.make_slow,
                        options=ServeOptions(drain_timeout_seconds=0.2, close_timeout_seconds=0.5),
                        task_status=task_status,
                    )

            info = await nursery.start(run_server)
            async with open_endpoint(info.address) as ep:
                await ep.reset()
                sent = trio.Event()

                async def stop_server() -> None:
                    await sent.wait()
                    await trio.sleep(0.2)  # the step is on the wire (it takes 3 s)
                    server_scope.cancel()

                nursery.start_soon(stop_server)
                sent.set()
                with pytest.raises(ConnectionLostError) as lost:
                    await ep.step(np.array([30]))
                assert lost.value.message == (
                    "the server is shutting down (GOAWAY received) before lane 0 answered "
                    "the step (the server said: lane 0 stopped before answering)"
                )
                assert isinstance(lost.value.__cause__, EnvError)
                assert ep.closed
                with pytest.raises(EndpointClosedError, match="shutting down"):
                    await ep.step(np.array([0]))
