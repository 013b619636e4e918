"""The real rlmesh 0.1.0 clients against each server, checked against local gymnasium.

Every test drives a server subprocess with an rlmesh client and runs the same envs
locally in lockstep: what the client decodes must be exactly what the env produced
(observations, rewards, flags, infos as SPEC §5.1 converts them, rendered frames,
episode results). The same tests run against the reference server and against ours,
over TCP and over a unix socket.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from support import envs, scripts, wire
from support.params import SERVER_KINDS, TRANSPORTS
from support.refserver import ServerConfig, ServerPool

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]

CLIENT_KEYS = ("episode_ids", "completed_episodes")
"""Info keys the rlmesh clients add on their side (SPEC §11.1)."""


def config(env: str, num_envs: int, transport: str) -> ServerConfig:
    return ServerConfig(
        entrypoint=scripts.ENTRYPOINTS[env],
        num_envs=num_envs,
        transport=transport,  # type: ignore[arg-type]
    )


def as_meta(value: Any) -> Any:
    """What an info value becomes on the wire and back (SPEC §5.1)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: as_meta(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_meta(v) for v in value]
    return value


def server_info(info: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k not in CLIENT_KEYS}


def assert_same_value(remote: Any, local: Any, path: str = "$") -> None:
    """A decoded observation equals the env's, leaf by leaf and exactly."""
    if isinstance(local, Mapping):
        assert isinstance(remote, Mapping), path
        assert sorted(remote) == sorted(local), path
        for key in local:
            assert_same_value(remote[key], local[key], f"{path}.{key}")
    elif isinstance(local, tuple):
        assert isinstance(remote, tuple | list), path
        assert len(remote) == len(local), path
        for i, (r, v) in enumerate(zip(remote, local, strict=True)):
            assert_same_value(r, v, f"{path}[{i}]")
    elif isinstance(local, str):
        assert remote == local, path
    else:
        expected = np.asarray(local)
        got = np.asarray(remote)
        assert got.shape == expected.shape, path
        assert got.tolist() == expected.tolist(), path


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_remote_env_cartpole_follows_gymnasium(
    servers: ServerPool, kind: str, transport: str
) -> None:
    from rlmesh.numpy import RemoteEnv

    server = servers.get(kind, config("cartpole", 1, transport))  # type: ignore[arg-type]
    local = gym.make("CartPole-v1")
    env = RemoteEnv(server.address, request_timeout_seconds=30.0)
    try:
        obs, info = env.reset(seed=3)
        expected, _ = local.reset(seed=3)
        assert obs.dtype == np.float32
        assert np.array_equal(obs, expected)
        assert len(info["episode_ids"]) == 1
        for _ in range(500):
            action = scripts.cartpole_policy(expected)
            obs, reward, terminated, truncated, info = env.step(action)
            expected, local_reward, local_terminated, local_truncated, _ = local.step(action)
            assert np.array_equal(obs, expected)
            assert (reward, terminated, truncated) == (
                local_reward,
                local_terminated,
                local_truncated,
            )
            if terminated or truncated:
                break
        assert terminated, "the episode never ended"
    finally:
        env.close()
        local.close()


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_remote_env_nested_follows_the_env(servers: ServerPool, kind: str) -> None:
    """Every leaf kind, nested infos and reset options survive the round trip."""
    from rlmesh.numpy import RemoteEnv

    server = servers.get(kind, config("nested", 1, "tcp"))  # type: ignore[arg-type]
    local = envs.NestedEnv()
    env = RemoteEnv(server.address, request_timeout_seconds=30.0)
    try:
        obs, info = env.reset(seed=21, options=scripts.RESET_OPTIONS)
        expected, local_info = local.reset(seed=21, options=scripts.RESET_OPTIONS)
        assert_same_value(obs, expected)
        assert server_info(info) == as_meta(local_info)
        for t in range(20):
            action = scripts.nested_action_np(t)
            obs, reward, terminated, truncated, info = env.step(action)
            expected, local_reward, local_terminated, local_truncated, local_info = local.step(
                action
            )
            assert_same_value(obs, expected)
            assert (reward, terminated, truncated) == (
                local_reward,
                local_terminated,
                local_truncated,
            )
            assert server_info(info) == as_meta(local_info)
            if terminated or truncated:
                assert info["completed_episodes"] == 1
                break
        assert terminated or truncated
    finally:
        env.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_remote_vector_env_follows_gymnasium(
    servers: ServerPool, kind: str, transport: str
) -> None:
    """Three CartPole lanes; finished lanes keep being stepped (no autoreset)."""
    from rlmesh.numpy import RemoteVectorEnv

    n = 3
    server = servers.get(kind, config("cartpole", n, transport))  # type: ignore[arg-type]
    local = [gym.make("CartPole-v1") for _ in range(n)]
    env = RemoteVectorEnv(server.address, request_timeout_seconds=30.0)
    try:
        assert env.num_envs == n
        obs, info = env.reset(seed=[5, 6, 7])
        expected = np.stack([e.reset(seed=5 + i)[0] for i, e in enumerate(local)])
        assert np.array_equal(obs, expected)
        assert info["_final_info"] == [True] * n
        done = np.zeros(n, bool)
        for _ in range(500):
            actions = np.array([scripts.cartpole_policy(row) for row in expected], np.int64)
            obs, rewards, terminated, truncated, info = env.step(actions)
            with warnings.catch_warnings():
                # gymnasium warns when a finished CartPole is stepped: the server does it too.
                warnings.simplefilter("ignore")
                results = [e.step(int(a)) for e, a in zip(local, actions, strict=True)]
            expected = np.stack([r[0] for r in results])
            assert np.array_equal(obs, expected)
            assert list(rewards) == [r[1] for r in results]
            assert list(terminated) == [r[2] for r in results]
            assert list(truncated) == [r[3] for r in results]
            assert info["_final_info"] == [r[2] or r[3] for r in results]
            assert len(info["final_info"]) == n
            done |= np.asarray(terminated) | np.asarray(truncated)
            if done.all():
                break
        assert done.all()
    finally:
        env.close()
        for e in local:
            e.close()


def local_episode(seed: int) -> tuple[int, float, bool, bool]:
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=seed)
    steps, total = 0, 0.0
    while True:
        obs, reward, terminated, truncated, _ = env.step(scripts.cartpole_policy(obs))
        steps += 1
        total += float(reward)
        if terminated or truncated:
            env.close()
            return steps, total, bool(terminated), bool(truncated)


@pytest.mark.parametrize("num_envs", [1, 3])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_run_matches_local_rollouts(
    servers: ServerPool, kind: str, transport: str, num_envs: int
) -> None:
    """``rlmesh.run`` over seeds: lane-scoped requests on N = 3, serial on N = 1."""
    server = servers.get(kind, config("cartpole", num_envs, transport))  # type: ignore[arg-type]
    seeds = [1, 2, 3, 4, 5]
    episodes = scripts.run_session(server.address, "cartpole", seeds)
    assert [e["seed"] for e in episodes] == seeds
    for episode, seed in zip(episodes, seeds, strict=True):
        steps, reward, terminated, truncated = local_episode(seed)
        assert (episode["steps"], episode["reward"]) == (steps, reward)
        assert (episode["terminated"], episode["truncated"]) == (terminated, truncated)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_render_through_remote_env(servers: ServerPool, kind: str, transport: str) -> None:
    """The rgb_array frame goes over the wire as PNG and decodes to the same pixels."""
    from rlmesh.numpy import RemoteEnv

    server = servers.get(kind, config("boom", 1, transport))  # type: ignore[arg-type]
    local = envs.BoomEnv()
    env = RemoteEnv(server.address, request_timeout_seconds=30.0)
    try:
        env.reset(seed=1)
        local.reset(seed=1)
        for action in (0, 1):
            env.step(action)
            local.step(action)
        frame = env.render()
        expected = local.render()
        assert isinstance(frame, np.ndarray)
        assert frame.shape == (*envs.FRAME_HW, 3)
        assert frame.dtype == np.uint8
        assert np.array_equal(frame, expected)
    finally:
        env.close()


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_serve_by_gymnasium_id(servers: ServerPool, kind: str) -> None:
    """``serve --env CartPole-v1``: the contract names the id, RemoteEnv plays it."""
    from rlmesh.numpy import RemoteEnv

    server = servers.get(kind, ServerConfig(env_id="CartPole-v1", num_envs=1))  # type: ignore[arg-type]
    contract = wire.run(handshake(server.address)).env_contract
    assert contract is not None
    assert contract.spec.id == "CartPole-v1"
    assert contract.num_envs == 1
    env = RemoteEnv(server.address, request_timeout_seconds=30.0)
    try:
        obs, _ = env.reset(seed=8)
        expected, _ = gym.make("CartPole-v1").reset(seed=8)
        assert np.array_equal(obs, expected)
    finally:
        env.close()


async def handshake(address: str) -> Any:
    async with wire.WireClient(address) as client:
        return await client.handshake()
