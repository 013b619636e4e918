"""Proof by training (issue 30): the CleanRL-style PPO of ``examples/cleanrl_ppo.py``
through ``rlmesh_trio.client.VectorEnv`` (SAME_STEP autoreset, 8 lanes of ``rlmesh-trio
serve``) learns exactly what it learns on gymnasium's ``SyncVectorEnv`` (and
``AsyncVectorEnv``) with the same seed: the same episode returns in the same order, equal
final parameters, a mean return >= 475."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode
from support.refserver import ServerConfig, ServerPool
from timings import timed

pytest.importorskip("torch")

from rlmesh_trio.client import VectorEnv
from rlmesh_trio.client._gather import ADDRESS_VARIABLE

pytestmark = [pytest.mark.trainers, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cleanrl_ppo.py"
ENV_ID = "CartPole-v1"
N_ENVS = 8
SEED = 0


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_cleanrl_ppo", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example()


def local_envs() -> list[Callable[[], gym.Env[Any, Any]]]:
    return [lambda: gym.make(ENV_ID) for _ in range(N_ENVS)]


def train(example: ModuleType, envs: str, make: Callable[[], gym.vector.VectorEnv]) -> Any:
    vector = make()
    try:
        return timed("CleanRL", envs, lambda: example.train(vector, example.Config(seed=SEED)))
    finally:
        vector.close()


@pytest.fixture(scope="module")
def sync(example: ModuleType, deterministic_torch: Any) -> Any:
    return train(
        example,
        "SyncVectorEnv (SAME_STEP)",
        lambda: gym.vector.SyncVectorEnv(local_envs(), autoreset_mode=AutoresetMode.SAME_STEP),
    )


def same_learning(expected: Any, got: Any, torch: Any) -> None:
    assert len(got.episodes) == len(expected.episodes)
    assert got.episodes == expected.episodes
    theirs, ours = expected.agent.state_dict(), got.agent.state_dict()
    assert list(ours) == list(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name


def mean_return(result: Any, last: int = 100) -> float:
    return float(np.mean([r for _, _, r in result.episodes[-last:]]))


def test_cleanrl_ppo_on_vector_env_learns_exactly_what_it_learns_on_sync_vector_env(
    servers: ServerPool, example: ModuleType, sync: Any, deterministic_torch: Any
) -> None:
    server = servers.get("ours", ServerConfig(env_id=ENV_ID, num_envs=N_ENVS))
    remote = train(
        example,
        f"VectorEnv (SAME_STEP, {N_ENVS} lanes, rlmesh-trio serve)",
        lambda: VectorEnv(server.address, autoreset_mode=AutoresetMode.SAME_STEP),
    )
    same_learning(sync, remote, deterministic_torch)
    assert mean_return(sync) >= 475.0, mean_return(sync)
    print(
        f"CleanRL PPO seed {SEED}: {len(remote.episodes)} episodes, last 100 {mean_return(remote)}"
    )


def test_cleanrl_ppo_on_async_vector_env_learns_the_same(
    example: ModuleType, sync: Any, deterministic_torch: Any
) -> None:
    """The control: gymnasium's process-per-env vector env gives the same run too."""
    got = train(
        example,
        "AsyncVectorEnv (SAME_STEP)",
        lambda: gym.vector.AsyncVectorEnv(
            local_envs(), autoreset_mode=AutoresetMode.SAME_STEP, context="spawn"
        ),
    )
    same_learning(sync, got, deterministic_torch)


def test_the_loop_refuses_next_step_autoreset(example: ModuleType) -> None:
    envs = gym.vector.SyncVectorEnv(local_envs()[:2])  # gymnasium's default: NEXT_STEP
    try:
        with pytest.raises(ValueError, match="needs SAME_STEP autoreset"):
            example.train(envs)
    finally:
        envs.close()


def test_the_example_runs_as_documented(servers: ServerPool) -> None:
    """``python examples/cleanrl_ppo.py --address ...`` (docs/trainers.md), short."""
    server = servers.get("ours", ServerConfig(env_id=ENV_ID, num_envs=N_ENVS))
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--address", server.address, "--total-timesteps", "2048"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "episodes in" in out.stdout and "mean return of the last" in out.stdout


BY_ID_ENVS = 4
BY_ID_TIMESTEPS = 16_384


def run_by_id(env_id: str, metrics: Path, address: str | None) -> dict[str, Any]:
    """``python examples/cleanrl_ppo.py --env-id ...`` as a user runs it: the envs built
    as CleanRL's ppo.py builds them; ``RLMESH_TRIO_ADDRESS`` the only glue."""
    env = dict(os.environ)
    env.pop(ADDRESS_VARIABLE, None)
    if address is not None:
        env[ADDRESS_VARIABLE] = address
    subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--env-id",
            env_id,
            "--num-envs",
            str(BY_ID_ENVS),
            "--total-timesteps",
            str(BY_ID_TIMESTEPS),
            "--metrics-file",
            str(metrics),
        ],
        env=env,
        check=True,
        timeout=600,
        capture_output=True,
    )
    loaded: dict[str, Any] = json.loads(metrics.read_text())
    return loaded


def test_cleanrl_by_id_over_endpoints_logs_what_the_local_run_logs(
    servers: ServerPool, tmp_path: Path
) -> None:
    """CleanRL's way of building envs (a SyncVectorEnv of ``gym.make(env_id)`` thunks in
    ``RecordEpisodeStatistics``), the script unchanged, against ``rlmesh-trio serve
    --endpoints 4``: the same losses every update and the same episode statistics as
    the local run."""
    server = servers.get("ours", ServerConfig(env_id=ENV_ID, endpoints=BY_ID_ENVS))
    local = timed(
        "CleanRL",
        f"by id: {BY_ID_ENVS} x {ENV_ID} (local)",
        lambda: run_by_id(ENV_ID, tmp_path / "local.json", None),
    )
    remote = timed(
        "CleanRL",
        f"by id: {BY_ID_ENVS} endpoints (serve --endpoints)",
        lambda: run_by_id(
            "rlmesh_trio:rlmesh_trio/Remote-v0",
            tmp_path / "remote.json",
            ",".join(server.addresses),
        ),
    )
    assert len(local["losses"]) == BY_ID_TIMESTEPS // (32 * BY_ID_ENVS)
    assert len(local["statistics"]) > 50
    assert remote == local
