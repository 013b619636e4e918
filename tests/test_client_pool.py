"""EnvPool-style ``send`` / ``recv`` on both faces (``VectorEnv(batch_size=)`` and
``open_endpoint(batch_size=)``) against both servers: a full batch's transcript is
``SyncVectorEnv``'s (and ``VectorEnv.step``'s); with a smaller batch every lane's own
trajectory is that env's alone, whatever the order of arrival; refusals, lane errors,
deadlines, cancellation, and a server that dies while ``recv`` waits."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import trio
import trio.testing
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from support import envs
from support.refserver import ServerConfig, ServerPool
from test_client_gym import WireInfos, same

from rlmesh_trio.client import (
    ConnectionLostError,
    EndpointClosedError,
    EnvError,
    ErrorCode,
    LaneBusyError,
    LaneError,
    VectorEnv,
    open_endpoint,
)

pytestmark = [pytest.mark.interop, pytest.mark.timeout(240)]

KINDS = ["ref", "ours"]
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BOUND = 60.0
"""Bound (seconds) on any one Trio test's waits: they fail, never hang."""

UNEVEN = ServerConfig(
    entrypoint="support.uneven:make",
    num_envs=4,
    env=(("RLT_UNEVEN_MIN_MS", "0.2"), ("RLT_UNEVEN_MAX_MS", "6")),
)
"""Four CartPole lanes whose steps take uneven times (so replies overtake each other)."""

CASES: dict[str, tuple[str, Callable[[], gym.Env[Any, Any]], int]] = {
    "cartpole": ("support.envs:make_cartpole", envs.make_cartpole, 3),
    "nested": ("support.envs:make_nested", envs.make_nested, 3),
}


async def serve(pool: ServerPool, kind: str, *, fresh: bool = False, **config: Any) -> Any:
    """A server of the module's pool (a fresh one: its own), from a Trio test."""
    get = pool.fresh if fresh else pool.get
    return await trio.to_thread.run_sync(functools.partial(get, kind, ServerConfig(**config)))


def without_env_id(batch: Any) -> Any:
    """A batch without its ``env_id`` entries (checked to be the lanes it names)."""
    *head, infos = batch
    rest = {k: v for k, v in infos.items() if k not in ("env_id", "_env_id")}
    assert infos["env_id"].dtype == np.int32 and infos["_env_id"].all()
    return (*head, rest)


def unbatch(infos: dict[str, Any], j: int) -> dict[str, Any]:
    """Entry ``j``'s own info from gymnasium's batched layout."""
    out: dict[str, Any] = {}
    for key, value in infos.items():
        if key.startswith("_") or not infos.get(f"_{key}", np.zeros(j + 1, bool))[j]:
            continue
        out[key] = unbatch(value, j) if isinstance(value, dict) else value[j]
    return out


def lane_results(batch: Any) -> list[tuple[int, tuple[Any, ...]]]:
    """Each lane's ``(obs, reward, terminated, truncated, info)`` in a batch."""
    obs, rewards, terminated, truncated, infos = batch
    lanes = [int(i) for i in infos["env_id"]]
    return [
        (
            lane,
            (
                obs[j],
                float(rewards[j]),
                bool(terminated[j]),
                bool(truncated[j]),
                {k: v for k, v in unbatch(infos, j).items() if k != "env_id"},
            ),
        )
        for j, lane in enumerate(lanes)
    ]


def alone(
    factory: Callable[[], gym.Env[Any, Any]],
    mode: AutoresetMode,
    seed: int,
    actions: list[Any],
    *,
    with_reset: bool = True,
) -> list[tuple[Any, ...]]:
    """One env alone (a one-env ``SyncVectorEnv``, for the autoreset semantics): its
    reset and then each step's result, unbatched."""
    local = SyncVectorEnv([lambda: WireInfos(factory())], autoreset_mode=mode)
    try:
        obs, info = local.reset(seed=seed)
        out: list[tuple[Any, ...]] = []
        if with_reset:
            out.append((obs[0], 0.0, False, False, unbatch(info, 0)))
        for action in actions:
            o, r, te, tr, i = local.step(np.array([action]))
            out.append((o[0], float(r[0]), bool(te[0]), bool(tr[0]), unbatch(i, 0)))
        return out
    finally:
        local.close()


def full_batch_transcript(env: VectorEnv, actions: list[Any], seed: int) -> list[Any]:
    env.async_reset(seed=seed)
    obs, rewards, terminated, truncated, infos = without_env_id(env.recv())
    assert not rewards.any() and not terminated.any() and not truncated.any()
    transcript: list[Any] = [(obs, infos)]  # as reset() returns them
    for action in actions:
        env.send(action)
        batch = env.recv()
        assert batch[4]["env_id"].tolist() == list(range(env.num_envs))
        transcript.append(without_env_id(batch))
    return transcript


def vector_transcript(env: gym.vector.VectorEnv, actions: list[Any], seed: int) -> list[Any]:
    return [env.reset(seed=seed), *(env.step(action) for action in actions)]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_full_batch_transcript_equals_sync_vector_env(
    servers: ServerPool, kind: str, case: str, mode: AutoresetMode
) -> None:
    entrypoint, factory, lanes = CASES[case]
    server = servers.get(kind, ServerConfig(entrypoint=entrypoint, num_envs=lanes))  # type: ignore[arg-type]
    local = SyncVectorEnv([lambda: WireInfos(factory()) for _ in range(lanes)], autoreset_mode=mode)
    local.action_space.seed(5)
    actions = [local.action_space.sample() for _ in range(60)]
    vector = VectorEnv(server.address, autoreset_mode=mode)
    try:
        expected = vector_transcript(vector, actions, seed=21)
    finally:
        vector.close()
    pool = VectorEnv(server.address, autoreset_mode=mode, batch_size=lanes)
    try:
        assert pool.batch_size == lanes
        got = full_batch_transcript(pool, actions, seed=21)
        same(expected, got)
        same(vector_transcript(local, actions, seed=21), got)
        # With nothing in flight, step() still steps the whole vector.
        same(pool.step(actions[0]), local.step(actions[0]))
    finally:
        pool.close()
        local.close()


def drive_lanes(
    send: Callable[[Any, list[int]], None],
    recv: Callable[[], Any],
    first: list[tuple[int, tuple[Any, ...]]],
    actions: dict[int, list[Any]],
) -> tuple[dict[int, list[tuple[Any, ...]]], list[list[int]]]:
    """Feed each lane its own scripted actions as its results come back; every lane's
    results in the order it had them, and the lanes of every batch."""
    trajectories: dict[int, list[tuple[Any, ...]]] = {lane: [] for lane in actions}
    batches: list[list[int]] = []
    arrived = first
    while True:
        to_send = []
        for lane, result in arrived:
            trajectories[lane].append(result)
            if len(trajectories[lane]) <= len(actions[lane]):
                to_send.append(lane)
        if to_send:
            send(
                np.array([actions[lane][len(trajectories[lane]) - 1] for lane in to_send]),
                to_send,
            )
        try:
            batch = recv()
        except RuntimeError:  # nothing in flight: every lane is through its script
            return trajectories, batches
        batches.append([int(i) for i in batch[4]["env_id"]])
        arrived = lane_results(batch)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("kind", KINDS)
def test_small_batch_each_lane_is_its_env_alone(
    servers: ServerPool, kind: str, mode: AutoresetMode
) -> None:
    server = servers.get(kind, UNEVEN)  # type: ignore[arg-type]
    rng = np.random.default_rng(3)
    actions = {lane: [int(a) for a in rng.integers(0, 2, 70)] for lane in range(4)}
    env = VectorEnv(server.address, autoreset_mode=mode, batch_size=2)
    try:
        env.async_reset(seed=40)
        first = lane_results(env.recv()) + lane_results(env.recv())
        trajectories, batches = drive_lanes(env.send, env.recv, first, actions)
    finally:
        env.close()
    assert all(len(b) <= 2 and b == sorted(b) for b in batches)
    for lane in range(4):
        expected = alone(envs.make_cartpole, mode, 40 + lane, actions[lane])
        same(expected, trajectories[lane])


@pytest.mark.parametrize("kind", KINDS)
async def test_trio_face_batches_of_one(servers: ServerPool, kind: str) -> None:
    server = await trio.to_thread.run_sync(functools.partial(servers.get, kind, UNEVEN))
    rng = np.random.default_rng(8)
    actions = {lane: [int(a) for a in rng.integers(0, 2, 40)] for lane in range(4)}
    trajectories: dict[int, list[tuple[Any, ...]]] = {lane: [] for lane in range(4)}
    with trio.fail_after(BOUND):
        async with open_endpoint(server.address, batch_size=1) as ep:
            assert ep.batch_size == 1
            await ep.reset(seeds=7)
            await ep.send(np.array([actions[lane][0] for lane in range(4)]), [0, 1, 2, 3])
            while True:
                try:
                    batch = await ep.recv()
                except RuntimeError:
                    break
                ((lane, result),) = lane_results(batch)
                trajectories[lane].append(result)
                t = len(trajectories[lane])
                if t < len(actions[lane]):
                    await ep.send(np.array([actions[lane][t]]), [lane])
    for lane in range(4):
        expected = alone(envs.make_cartpole, AutoresetMode.NEXT_STEP, 7 + lane, actions[lane])
        same(expected[1:], trajectories[lane])


@pytest.mark.parametrize("kind", KINDS)
def test_recv_returns_the_lanes_that_finish_first(servers: ServerPool, kind: str) -> None:
    server = servers.get(kind, ServerConfig(entrypoint="support.envs:make_slow", num_envs=3))  # type: ignore[arg-type]
    env = VectorEnv(server.address, batch_size=1)
    try:
        env.async_reset()
        assert sorted(int(env.recv()[4]["env_id"][0]) for _ in range(3)) == [0, 1, 2]
        # Lane 0 sleeps 2 s, lanes 1 and 2 not at all: they come back first, and
        # lane 0 is refused while its step is in flight.
        env.send(np.array([20, 0, 0]), [0, 1, 2])
        with pytest.raises(LaneBusyError, match=r"lanes \[0\]"):
            env.send(np.array([0]), [0])
        firsts = {int(env.recv()[4]["env_id"][0]) for _ in range(2)}
        assert firsts == {1, 2}
        _obs, rewards, *_, infos = env.recv()
        assert infos["env_id"].tolist() == [0] and rewards.tolist() == [20.0]
    finally:
        env.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fewer_in_flight_than_a_batch(servers: ServerPool, kind: str) -> None:
    server = servers.get(kind, ServerConfig(num_envs=4))  # type: ignore[arg-type]
    env = VectorEnv(server.address, batch_size=3)
    try:
        env.async_reset(seed=1, env_indices=[2, 0])
        obs, rewards, terminated, truncated, infos = env.recv()
        assert infos["env_id"].tolist() == [0, 2] and obs.shape == (2, 4)
        assert rewards.tolist() == [0.0, 0.0] and not terminated.any() and not truncated.any()
        local = envs.make_cartpole()
        assert np.array_equal(obs[0], local.reset(seed=1)[0])  # seed + lane index
        assert np.array_equal(obs[1], local.reset(seed=3)[0])
        with pytest.raises(ValueError, match=r"lanes \[1\] were never reset"):
            env.send(np.array([0, 1]), [0, 1])
        with pytest.raises(RuntimeError, match="no lane is in flight"):
            env.recv()
    finally:
        env.close()


@pytest.mark.parametrize("kind", KINDS)
def test_refusals(servers: ServerPool, kind: str) -> None:
    server = servers.get(kind, ServerConfig(num_envs=3))  # type: ignore[arg-type]
    for bad in (0, 4):
        with pytest.raises(ValueError, match=r"batch_size must be in 1\.\.num_envs=3"):
            VectorEnv(server.address, batch_size=bad)
    env = VectorEnv(server.address, batch_size=2)
    try:
        env.reset(seed=0)
        with pytest.raises(RuntimeError, match="batch_size=2 < num_envs use send"):
            env.step(np.zeros(3, np.int64))
        with pytest.raises(ValueError, match="expected actions for 2 lanes"):
            env.send(np.zeros(3, np.int64), [0, 1])
        with pytest.raises(ValueError, match="duplicate env_index"):
            env.send(np.zeros(2, np.int64), [1, 1])
        env.send(np.zeros(2, np.int64), [0, 1])
        with pytest.raises(LaneBusyError, match=r"lanes \[1\]") as busy:
            env.send(np.zeros(2, np.int64), [1, 2])
        assert busy.value.code == ErrorCode.BUSY and busy.value.is_recoverable
        with pytest.raises(LaneBusyError):
            env.reset(seed=0)
        with pytest.raises(LaneBusyError):
            env.async_reset(env_indices=[0])
        assert env.recv()[4]["env_id"].tolist() == [0, 1]
        env.send(np.zeros(1, np.int64), [2])  # lane 2 was refused above: nothing was sent
        assert env.recv()[4]["env_id"].tolist() == [2]
    finally:
        env.close()


@pytest.mark.parametrize("kind", KINDS)
def test_disabled_autoreset_waits_for_a_reset(servers: ServerPool, kind: str) -> None:
    server = servers.get(kind, ServerConfig(entrypoint="support.envs:make_cartpole_trunc3"))  # type: ignore[arg-type]
    env = VectorEnv(server.address, autoreset_mode=AutoresetMode.DISABLED)
    try:
        env.async_reset(seed=2)
        env.recv()
        done = False
        while not done:
            env.send(np.ones(1, np.int64))
            _obs, _r, terminated, truncated, _ = env.recv()
            done = bool(terminated[0] or truncated[0])
        with pytest.raises(ValueError, match="autoreset is DISABLED"):
            env.send(np.ones(1, np.int64))
        env.async_reset(seed=2)
        first = env.recv()
        assert np.array_equal(first[0][0], envs.make_cartpole().reset(seed=2)[0])
        env.send(np.ones(1, np.int64))
        assert env.recv()[1].tolist() == [1.0]
    finally:
        env.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_lane_timeout_is_that_lanes_error(servers: ServerPool, kind: str) -> None:
    server = servers.get(kind, ServerConfig(entrypoint="support.envs:make_slow", num_envs=2))  # type: ignore[arg-type]
    env = VectorEnv(server.address, batch_size=2)
    try:
        env.async_reset()
        env.recv()
        env.send(np.array([5, 0]), timeout_ms=50)
        with pytest.raises(LaneError) as info:
            env.recv()
        error = info.value
        assert isinstance(error, EnvError) and error.env_id == 0
        assert error.code == ErrorCode.TIMEOUT and error.is_recoverable
        assert str(error).startswith("lane 0: TIMEOUT")
        _obs, rewards, *_, infos = env.recv()  # lane 1's result was kept
        assert infos["env_id"].tolist() == [1] and rewards.tolist() == [0.0]
        env.send(np.array([1]), [0])  # lane 0 is idle again in the pool
        answer: Any
        try:
            answer = env.recv()[4]["env_id"].tolist()
        except LaneError as busy:  # ours: the lane's env call has not returned yet
            answer = (busy.env_id, busy.code)
        assert answer in ([0], (0, ErrorCode.BUSY))
    finally:
        env.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_fatal_lane_error_closes_the_endpoint(servers: ServerPool, kind: str) -> None:
    server = await serve(servers, kind, fresh=True, entrypoint="support.envs:make_boom", num_envs=2)
    with trio.fail_after(BOUND):
        async with open_endpoint(server.address) as ep:
            await ep.reset(seeds=[0, 1])
            await ep.send(np.array([0, envs.BOOM_STEP_ACTION]))
            with pytest.raises(EnvError) as info:
                await ep.recv()
            assert (info.value.code, info.value.is_recoverable) == (ErrorCode.INTERNAL, False)
            assert not isinstance(info.value, LaneError)
            with pytest.raises(EndpointClosedError):
                await ep.send(np.array([0]), [0])
            # The requests were lane-scoped: the stream is still open, and closing it
            # reports both lanes' episodes (lane 1's boom step not counted).
            episodes = await ep.aclose()
        assert sorted((e.env_index, e.step_count, e.truncated) for e in episodes) == [
            (0, 1, True),
            (1, 0, True),
        ]


@pytest.mark.parametrize("kind", KINDS)
def test_blocking_close_after_a_fatal_lane_error_reports_the_episodes(
    servers: ServerPool, kind: str
) -> None:
    server = servers.fresh(kind, ServerConfig(entrypoint="support.envs:make_boom", num_envs=2))  # type: ignore[arg-type]
    env = VectorEnv(server.address, batch_size=2)
    try:
        env.async_reset(seed=[0, 1])
        env.recv()
        env.send(np.array([0, 0]))
        env.recv()
        env.send(np.array([0, envs.BOOM_STEP_ACTION]))
        with pytest.raises(EnvError) as info:
            env.recv()
        assert (info.value.code, info.value.is_recoverable) == (ErrorCode.INTERNAL, False)
        with pytest.raises(EndpointClosedError):
            env.send(np.array([0]), [0])
    finally:
        env.close()
    assert sorted((e.env_index, e.step_count, e.truncated) for e in env.final_episodes) == [
        (0, 2, True),
        (1, 1, True),
    ]


@pytest.mark.parametrize("kind", KINDS)
async def test_cancelled_recv_loses_nothing(servers: ServerPool, kind: str) -> None:
    server = await serve(
        servers, kind, fresh=False, entrypoint="support.envs:make_slow", num_envs=2
    )
    with trio.fail_after(BOUND):
        async with open_endpoint(server.address, batch_size=2) as ep:
            await ep.reset()
            await ep.send(np.array([2, 0]))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ep.recv)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
            with pytest.raises(LaneBusyError):
                await ep.step(np.array([0]), env_indices=[0])
            _obs, rewards, *_, infos = await ep.recv()
            assert infos["env_id"].tolist() == [0, 1] and rewards.tolist() == [2.0, 0.0]
            # Two tasks may not wait in recv at once.
            await ep.send(np.array([1]), [0])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ep.recv)
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(trio.BusyResourceError):
                    await ep.recv()
            # The raw face agrees with the pool on the lanes' state.
            await ep.step(np.array([0, 0]))


@pytest.mark.parametrize("kind", KINDS)
async def test_server_dies_while_recv_waits(servers: ServerPool, kind: str) -> None:
    server = await serve(servers, kind, fresh=True, entrypoint="support.envs:make_hang", num_envs=2)
    with trio.fail_after(BOUND):
        async with open_endpoint(server.address, batch_size=1) as ep:
            await ep.reset()
            await ep.send(np.array([0, 0]))
            failure: list[BaseException] = []

            async def waiter() -> None:
                try:
                    await ep.recv()
                except ConnectionLostError as exc:
                    failure.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(waiter)
                await trio.testing.wait_all_tasks_blocked()
                server.kill()
            assert len(failure) == 1
            with pytest.raises((ConnectionLostError, EndpointClosedError)):
                await ep.recv()
            with pytest.raises(EndpointClosedError):
                await ep.send(np.array([0]), [0])


@pytest.mark.parametrize("kind", KINDS)
def test_blocking_recv_when_the_server_died(servers: ServerPool, kind: str) -> None:
    server = servers.fresh(kind, ServerConfig(entrypoint="support.envs:make_hang", num_envs=2))  # type: ignore[arg-type]
    env = VectorEnv(server.address, batch_size=1)
    try:
        env.async_reset()
        env.recv()
        env.recv()
        env.send(np.array([0, 0]))
        server.kill()
        with pytest.raises(ConnectionLostError):
            env.recv()
    finally:
        env.close()


@pytest.mark.parametrize("kind", KINDS)
def test_the_pool_example_runs(servers: ServerPool, kind: str) -> None:
    spec = importlib.util.spec_from_file_location(
        "example_pool_returns", EXAMPLES / "pool_returns.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    server = servers.get(kind, ServerConfig(env_id="CartPole-v1", num_envs=4))  # type: ignore[arg-type]
    returns = example.collect(server.address, batch_size=2, batches=2400)
    # 1200 results per lane: each lane finishes two episodes at least (CartPole-v1 ends
    # by 500 steps); the finished episodes' steps and resets fit in what was received.
    assert len(returns) >= 8 and all(1 <= r <= 500 for r in returns)
    assert sum(returns) + len(returns) <= 4800
