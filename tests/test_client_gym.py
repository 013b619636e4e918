"""The gymnasium adapters against both servers: ``VectorEnv`` transcripts equal to
gymnasium's own ``SyncVectorEnv`` over the same envs, seeds and actions in every autoreset
mode, and ``Env`` through gymnasium's ``check_env``."""

from __future__ import annotations

import functools
import os
import signal
import threading
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import trio
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv
from gymnasium.utils.env_checker import check_env
from gymnasium.utils.passive_env_checker import env_render_passive_checker
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from support import envs
from support.refserver import ServerConfig, ServerPool

from rlmesh_trio import serve_env
from rlmesh_trio._codec import from_meta_map, to_meta_map
from rlmesh_trio.client import (
    ConnectionLostError,
    EndpointClosedError,
    Env,
    EnvError,
    ErrorCode,
    VectorEnv,
)

pytestmark = [pytest.mark.interop, pytest.mark.timeout(240)]

KINDS = ["ref", "ours"]
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


class WireInfos(gym.Wrapper):  # type: ignore[type-arg]
    """A local env whose infos look as they do after the wire (SPEC §5: numpy arrays
    become lists, numpy scalars Python numbers): what a remote client can be equal to."""

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        return obs, from_meta_map(to_meta_map(info))

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, from_meta_map(to_meta_map(info))


def same(a: Any, b: Any, path: str = "$") -> None:
    """``a`` and ``b`` equal in structure, types, dtypes, shapes and values."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), (
            f"{path}: {type(a)} vs {type(b)}"
        )
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} vs {b.shape}"
        if a.dtype == object:
            for i, (x, y) in enumerate(zip(a.reshape(-1), b.reshape(-1), strict=True)):
                same(x, y, f"{path}[{i}]")
        else:
            assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f"{path}: {a} vs {b}"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (
            f"{path}: keys {sorted(a)} vs {sorted(b) if isinstance(b, dict) else b}"
        )
        for key in a:
            same(a[key], b[key], f"{path}.{key}")
        return
    if isinstance(a, tuple | list):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
        return
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)} ({a!r} vs {b!r})"
    assert a == b or (isinstance(a, float) and np.isnan(a) and np.isnan(b)), (
        f"{path}: {a!r} vs {b!r}"
    )


def checker_warnings(env: gym.Env[Any, Any]) -> list[str]:
    """``check_env``'s warnings for ``env`` (it raises on a failed check)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env, skip_render_check=True)
    return sorted({str(w.message) for w in caught})


def drive(
    env: gym.vector.VectorEnv, mode: AutoresetMode, actions: list[Any], seed: int
) -> list[Any]:
    """A scripted session: seeded reset, steps; in DISABLED mode finished lanes are reset
    with ``reset_mask`` (seeded the first time, unseeded after)."""
    transcript: list[Any] = [env.reset(seed=seed)]
    n = env.num_envs
    for t, action in enumerate(actions):
        result = env.step(action)
        transcript.append(result)
        if mode == AutoresetMode.DISABLED:
            done = np.logical_or(result[2], result[3])
            if done.any():
                seeds = [seed + 100 + t if (t % 2 == 0 and done[i]) else None for i in range(n)]
                transcript.append(env.reset(seed=seeds, options={"reset_mask": done.copy()}))
    return transcript


CASES: dict[str, tuple[str, Callable[[], gym.Env[Any, Any]], int, int]] = {
    # name: (entrypoint, factory, lanes, steps)
    "cartpole": ("support.envs:make_cartpole", envs.make_cartpole, 3, 80),
    "nested": ("support.envs:make_nested", envs.make_nested, 3, 30),
    # One fixed-width leaf (the whole-step fold) with a lane's info every step.
    "frozenlake": (
        f"{FrozenLakeEnv.__module__}:FrozenLakeEnv",
        lambda: _int64_obs(FrozenLakeEnv()),
        3,
        60,
    ),
}


def _int64_obs(env: gym.Env[Any, Any]) -> gym.Env[Any, Any]:
    """FrozenLake's observations as the wire's Discrete leaf reads back (a Python
    ``int`` becomes ``np.int64``: SAME_STEP's ``final_obs`` shows the type)."""
    return gym.wrappers.TransformObservation(env, np.int64, env.observation_space)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_vector_env_transcript_equals_sync_vector_env(
    servers: ServerPool, kind: str, case: str, mode: AutoresetMode
) -> None:
    entrypoint, factory, lanes, steps = CASES[case]
    server = servers.get(kind, ServerConfig(entrypoint=entrypoint, num_envs=lanes))  # type: ignore[arg-type]
    remote = VectorEnv(server.address, autoreset_mode=mode)
    local = SyncVectorEnv([lambda: WireInfos(factory()) for _ in range(lanes)], autoreset_mode=mode)
    try:
        assert remote.num_envs == local.num_envs == lanes
        assert remote.metadata["autoreset_mode"] == mode
        remote.action_space.seed(7)
        actions = [remote.action_space.sample() for _ in range(steps)]
        same(drive(local, mode, actions, seed=11), drive(remote, mode, actions, seed=11))
    finally:
        remote.close()
        local.close()


@pytest.mark.parametrize("kind", KINDS)
def test_vector_env_one_lane_over_a_unix_socket(servers: ServerPool, kind: str) -> None:
    server = servers.get(kind, ServerConfig(num_envs=1, transport="unix"))  # type: ignore[arg-type]
    assert server.address.startswith("unix://")
    remote = VectorEnv(server.address)
    local = SyncVectorEnv([lambda: WireInfos(envs.make_cartpole())])
    try:
        remote.action_space.seed(3)
        actions = [remote.action_space.sample() for _ in range(60)]
        same(
            drive(local, AutoresetMode.NEXT_STEP, actions, 5),
            drive(remote, AutoresetMode.NEXT_STEP, actions, 5),
        )
    finally:
        remote.close()
        local.close()


@pytest.mark.parametrize("kind", KINDS)
def test_env_passes_check_env(servers: ServerPool, kind: str) -> None:
    server = servers.get(kind, ServerConfig(num_envs=1))  # type: ignore[arg-type]
    env = Env(server.address)
    try:
        # Exactly the warnings gymnasium's checker gives the env itself (CartPole's
        # infinite Box bounds), nothing of the adapter's own.
        assert checker_warnings(env) == checker_warnings(envs.make_cartpole().unwrapped)
        # What check_env cannot check without a registered spec: determinism.
        first = env.reset(seed=123)[0]
        step = env.step(1)
        again = env.reset(seed=123)[0]
        assert np.array_equal(first, again)
        assert np.array_equal(step[0], env.step(1)[0])
    finally:
        env.close()


@pytest.mark.parametrize("kind", KINDS)
def test_env_render_and_nested_spaces(servers: ServerPool, kind: str) -> None:
    boom = Env(servers.get(kind, ServerConfig(entrypoint="support.envs:make_boom")).address)  # type: ignore[arg-type]
    try:
        assert boom.render_mode == "rgb_array"
        boom.reset(seed=1)
        env_render_passive_checker(boom)
        frame = boom.render()
        assert np.array_equal(frame, envs.make_boom().render())
    finally:
        boom.close()
    nested = Env(servers.get(kind, ServerConfig(entrypoint="support.envs:make_nested")).address)  # type: ignore[arg-type]
    local = WireInfos(envs.make_nested())
    try:
        assert checker_warnings(nested) == checker_warnings(envs.make_nested())
        same(local.reset(seed=4), nested.reset(seed=4))
        nested.action_space.seed(0)
        for _ in range(5):
            action = nested.action_space.sample()
            same(local.step(action), nested.step(action))
    finally:
        nested.close()


@pytest.mark.parametrize("kind", KINDS)
def test_vector_env_actions_that_do_not_fit_are_refused_before_sending(
    servers: ServerPool, kind: str
) -> None:
    """Batched Dict actions with a key missing, or of no batch shape at all: a
    recoverable ``INVALID_ACTION`` raised by the client (nothing sent), then the same
    session steps on as gymnasium's ``SyncVectorEnv`` over the same envs does."""
    server = servers.get(kind, ServerConfig(entrypoint="support.envs:make_nested", num_envs=2))  # type: ignore[arg-type]
    remote = VectorEnv(server.address)
    local = SyncVectorEnv([lambda: WireInfos(envs.make_nested()) for _ in range(2)])
    try:
        same(local.reset(seed=3), remote.reset(seed=3))
        good = remote.action_space.sample()
        missing = {key: value for key, value in good.items() if key != "buttons"}
        for bad, text in [
            (missing, "no key 'buttons'"),
            ([1, 2], "list indices must be integers"),
            (5, "not subscriptable"),
            (None, "not subscriptable"),
        ]:
            with pytest.raises(EnvError) as info:
                remote.step(bad)
            assert (info.value.code, info.value.is_recoverable) == (ErrorCode.INVALID_ACTION, True)
            assert info.value.message.startswith("actions do not fit the action space: ")
            assert text in info.value.message
        same(local.step(good), remote.step(good))
    finally:
        remote.close()
        local.close()


@pytest.mark.parametrize("kind", KINDS)
def test_seeds_the_wire_cannot_carry_are_refused_before_sending(
    servers: ServerPool, kind: str
) -> None:
    """Seeds cross as int64: 2**64 would reach the env as 0 and 2**63 as -2**63 (a fatal
    error there). Refused by the client, nothing sent; the largest int64 seed is served."""
    two = servers.get(kind, ServerConfig(entrypoint="support.envs:make_cartpole", num_envs=2))  # type: ignore[arg-type]
    one = servers.get(kind, ServerConfig(entrypoint="support.envs:make_cartpole", num_envs=1))  # type: ignore[arg-type]
    vector, env = VectorEnv(two.address), Env(one.address)
    try:
        for seed in (2**64, 2**63 - 1, [0, 2**63], [-(2**63) - 1, None]):
            with pytest.raises(ValueError, match="does not fit the protocol's int64 seeds"):
                vector.reset(seed=seed)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            vector.reset(seed=[1.5, 2])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="does not fit the protocol's int64 seeds"):
            env.reset(seed=2**63)
        local = SyncVectorEnv([envs.make_cartpole, envs.make_cartpole])
        same(local.reset(seed=2**63 - 2)[0], vector.reset(seed=2**63 - 2)[0])
        same(envs.make_cartpole().reset(seed=2**63 - 1)[0], env.reset(seed=2**63 - 1)[0])
    finally:
        vector.close()
        env.close()


@pytest.mark.parametrize("kind", KINDS)
def test_env_fatal_error_then_closed(servers: ServerPool, kind: str) -> None:
    server = servers.fresh(kind, ServerConfig(entrypoint="support.envs:make_boom"))  # type: ignore[arg-type]
    env = Env(server.address)
    try:
        env.reset(seed=0)
        with pytest.raises(EnvError) as info:
            env.step(envs.BOOM_STEP_ACTION)
        assert info.value.code == ErrorCode.INTERNAL
        assert not info.value.is_recoverable
        assert info.value.message == "step failed: RuntimeError: boom in step"
        with pytest.raises(EndpointClosedError) as closed:
            env.step(0)
        assert closed.value.__cause__ is info.value
    finally:
        env.close()


@pytest.mark.parametrize("kind", KINDS)
def test_adapters_refuse_what_they_cannot_drive(servers: ServerPool, kind: str) -> None:
    three = servers.get(kind, ServerConfig(entrypoint="support.envs:make_cartpole", num_envs=3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="3 lanes; use VectorEnv"):
        Env(three.address)
    envs_ = VectorEnv(three.address, autoreset_mode=AutoresetMode.DISABLED)
    try:
        envs_.reset(seed=0)
        for _ in range(500):
            _obs, _r, terminated, truncated, _ = envs_.step(np.ones(3, np.int64))
            if (terminated | truncated).any():
                break
        with pytest.raises(ValueError, match="reset_mask"):
            envs_.step(np.ones(3, np.int64))
        with pytest.raises(ValueError, match="length must match num_envs=3"):
            envs_.reset(seed=[1, 2])
        with pytest.raises(TypeError, match="reset_mask"):
            envs_.reset(options={"reset_mask": [True, False, True]})
        done = terminated | truncated
        envs_.reset(options={"reset_mask": done})
        envs_.step(np.zeros(3, np.int64))  # the reset lanes run again
    finally:
        envs_.close()


@pytest.mark.parametrize("kind", KINDS)
def test_vector_env_render_and_final_episodes(servers: ServerPool, kind: str) -> None:
    server = servers.get(kind, ServerConfig(entrypoint="support.envs:make_boom", num_envs=2))  # type: ignore[arg-type]
    envs_ = VectorEnv(server.address)
    try:
        envs_.reset(seed=[1, 2])
        frames = envs_.render()
        assert frames is not None and len(frames) == 2
        assert np.array_equal(frames[0], envs.make_boom().render())
        assert frames[1] is None  # the 0.1.0 servers render lane 0 of a vector only
        envs_.step(np.zeros(2, np.int64))
    finally:
        envs_.close()
    assert sorted((e.env_index, e.step_count, e.truncated) for e in envs_.final_episodes) == [
        (0, 1, True),
        (1, 1, True),
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_vector_env_against_a_server_that_vanishes(servers: ServerPool, kind: str) -> None:
    server = servers.fresh(kind, ServerConfig(entrypoint="support.envs:make_slow", num_envs=1))  # type: ignore[arg-type]
    env = VectorEnv(server.address)
    killer = threading.Timer(0.3, os.kill, (server.pid, signal.SIGKILL))
    try:
        env.reset()
        killer.start()
        with pytest.raises(ConnectionLostError) as info:
            env.step(np.array([30]))  # 3 s on the server; it dies after 0.3 s
        assert info.value.code == ErrorCode.CLOSED and not info.value.is_recoverable
        with pytest.raises(EndpointClosedError):
            env.step(np.array([0]))
    finally:
        killer.join()
        env.close()
        server.stop()


def test_env_against_a_frozen_server(servers: ServerPool) -> None:
    server = servers.fresh("ours", ServerConfig(entrypoint="support.envs:make_slow"))
    env = Env(server.address, ping_interval_seconds=0.2, ping_timeout_seconds=0.5)
    try:
        env.reset()
        server.freeze()
        with pytest.raises(ConnectionLostError, match="PING"):
            env.step(0)
    finally:
        server.thaw()
        env.close()
        server.stop()


def test_vector_env_told_the_server_is_shutting_down(servers: ServerPool) -> None:
    """SIGTERM (a Ctrl-C, a pod deleted) while a 3 s step of both lanes is in flight: the
    server sends GOAWAY, drains for 0.2 s, answers the cut-short job and closes. The
    caller reads that the server is shutting down, naming the lanes it waited for."""
    cfg = ServerConfig(
        entrypoint="support.envs:make_slow",
        num_envs=2,
        drain_timeout_seconds=0.2,
        close_timeout_seconds=0.5,
    )
    server = servers.fresh("ours", cfg)
    env = VectorEnv(server.address)
    stopper = threading.Timer(0.3, os.kill, (server.pid, signal.SIGTERM))
    try:
        env.reset()
        stopper.start()
        with pytest.raises(ConnectionLostError) as info:
            env.step(np.array([30, 30]))  # 3 s on the server; SIGTERM after 0.3 s
        assert info.value.message.startswith(
            "the server is shutting down (GOAWAY received) before lanes 0-1 answered the "
            "step (the server said: lane "
        ), info.value.message
        with pytest.raises(EndpointClosedError, match="shutting down"):
            env.step(np.array([0, 0]))
    finally:
        stopper.join()
        env.close()
        server.stop()


@pytest.mark.parametrize("seconds", [0.0015, 0.0019999999, 0.0299999999, 0.057])
async def test_request_timeout_seconds_is_sent_as_rlmesh_sends_it(seconds: float) -> None:
    """``request_timeout_seconds`` reaches the wire as the same ``timeout_ms`` from our
    ``VectorEnv`` as from rlmesh 0.1.0's ``RemoteEnv``: our server names the deadline it
    got in its TIMEOUT answer to a reset that sleeps past it (one server per client, so
    neither session waits for the other's Join to end)."""
    from rlmesh.numpy import RemoteEnv

    def theirs(address: str) -> str:
        env = RemoteEnv(address, request_timeout_seconds=seconds)
        try:
            with pytest.raises(TimeoutError) as caught:
                env.reset(options={"sleep": 0.15})
            return str(caught.value).removeprefix("[TIMEOUT] ")
        finally:
            env.close()

    def ours(address: str) -> str:
        env = VectorEnv(address, request_timeout_seconds=seconds)
        try:
            with pytest.raises(EnvError) as caught:
                env.reset(options={"sleep": 0.15})
            assert caught.value.code == ErrorCode.TIMEOUT and caught.value.is_recoverable
            return caught.value.message
        finally:
            env.close()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            first, second = [
                await nursery.start(functools.partial(serve_env, envs.make_slow)) for _ in range(2)
            ]
            said = [
                await trio.to_thread.run_sync(client, info.address)
                for client, info in ((theirs, first), (ours, second))
            ]
            nursery.cancel_scope.cancel()
    assert said[0] == said[1], said
    assert said[1].startswith("env.reset timed out after ")
