"""Proof by training (issue 30): Stable-Baselines3's PPO on CartPole-v1 with rl-zoo's
hyperparameters, through ``RemoteVecEnv`` over 8 lanes of ``rlmesh-trio serve``, learns
exactly what it learns on ``DummyVecEnv`` (and on ``SubprocVecEnv``) with the same seed:
the same episodes in the same order, equal final parameters, a mean return >= 475."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.refserver import ServerConfig, ServerPool
from timings import timed

pytest.importorskip("stable_baselines3")

from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import SubprocVecEnv, VecEnv, VecMonitor

from rlmesh_trio.client.sb3 import RemoteVecEnv

pytestmark = [pytest.mark.trainers, pytest.mark.timeout(900)]

SEED = 0
"""The seed of the runs (PPO's ``seed``: torch, numpy, the envs as ``seed + i``)."""

ENV_ID = "CartPole-v1"
N_ENVS = 8
TIMESTEPS = 100_000


def linear(start: float) -> Callable[[float], float]:
    """rl-zoo's ``lin_<start>``: from ``start`` down to 0 over the run."""

    def schedule(progress_remaining: float) -> float:
        return progress_remaining * start

    return schedule


HYPERPARAMETERS: dict[str, Any] = {
    # rl-baselines3-zoo, hyperparams/ppo.yml, CartPole-v1 (n_envs 8, n_timesteps 1e5)
    "n_steps": 32,
    "batch_size": 256,
    "gae_lambda": 0.8,
    "gamma": 0.98,
    "n_epochs": 20,
    "ent_coef": 0.0,
    "learning_rate": linear(0.001),
    "clip_range": linear(0.2),
}


class Episodes(BaseCallback):
    """Every finished episode, in the order the trainer saw them:
    (timestep, env index, return, length)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, float, int]] = []

    def _on_step(self) -> bool:
        for i, info in enumerate(self.locals["infos"]):
            episode = info.get("episode")
            if episode is not None:
                self.seen.append((self.num_timesteps, i, float(episode["r"]), int(episode["l"])))
        return True


@dataclass
class Run:
    episodes: list[tuple[int, int, float, int]]
    parameters: dict[str, Any]

    def mean_return(self, last: int = 100) -> float:
        return float(np.mean([r for _, _, r, _ in self.episodes[-last:]]))

    def first_at(self, level: float = 475.0, window: int = 100) -> int | None:
        """The timestep at which the mean of the last ``window`` returns first reached
        ``level``."""
        returns = [r for _, _, r, _ in self.episodes]
        for k in range(window, len(returns) + 1):
            if np.mean(returns[k - window : k]) >= level:
                return self.episodes[k - 1][0]
        return None


def train(envs: str, make: Callable[[], VecEnv]) -> Run:
    venv = make()
    try:

        def learn() -> Run:
            model = PPO("MlpPolicy", venv, seed=SEED, device="cpu", **HYPERPARAMETERS)
            episodes = Episodes()
            model.learn(TIMESTEPS, callback=episodes)
            return Run(episodes.seen, model.policy.state_dict())

        return timed("SB3 PPO", envs, learn)
    finally:
        venv.close()


@pytest.fixture(scope="module")
def dummy(deterministic_torch: Any) -> Run:
    # What a user of rl-zoo runs: make_vec_env (a Monitor on each env), DummyVecEnv.
    return train("DummyVecEnv", lambda: make_vec_env(ENV_ID, n_envs=N_ENVS))


def same_learning(expected: Run, got: Run, torch: Any) -> None:
    assert len(got.episodes) == len(expected.episodes)
    assert got.episodes == expected.episodes
    assert list(got.parameters) == list(expected.parameters)
    for name, tensor in expected.parameters.items():
        assert torch.equal(tensor, got.parameters[name]), name


def test_ppo_on_remote_vec_env_learns_exactly_what_it_learns_on_dummy_vec_env(
    servers: ServerPool, dummy: Run, deterministic_torch: Any
) -> None:
    server = servers.get("ours", ServerConfig(env_id=ENV_ID, num_envs=N_ENVS))
    remote = train(
        f"RemoteVecEnv ({N_ENVS} lanes, rlmesh-trio serve)",
        lambda: VecMonitor(RemoteVecEnv(server.address)),
    )
    same_learning(dummy, remote, deterministic_torch)
    assert dummy.mean_return() >= 475.0, (dummy.mean_return(), dummy.first_at())
    print(
        f"SB3 PPO seed {SEED}: {len(remote.episodes)} episodes, mean return of the last 100 "
        f"{remote.mean_return():.1f}, first >= 475 at timestep {remote.first_at()}"
    )


def test_ppo_on_subproc_vec_env_learns_the_same(dummy: Run, deterministic_torch: Any) -> None:
    """The control: SB3's own process-per-env VecEnv gives the same run too."""
    subproc = train(
        "SubprocVecEnv", lambda: make_vec_env(ENV_ID, n_envs=N_ENVS, vec_env_cls=SubprocVecEnv)
    )
    same_learning(dummy, subproc, deterministic_torch)


DOCS = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"


def documented_block() -> str:
    """The Python block of docs/trainers.md's Stable-Baselines3 section."""
    section = DOCS.read_text().split("\n## Stable-Baselines3", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_documented_block_runs(servers: ServerPool, deterministic_torch: Any) -> None:
    server = servers.get("ours", ServerConfig(env_id=ENV_ID, num_envs=N_ENVS))
    block = documented_block()
    assert '"tcp://127.0.0.1:50051"' in block and "total_timesteps=100_000" in block
    block = block.replace('"tcp://127.0.0.1:50051"', repr(server.address))
    block = block.replace("total_timesteps=100_000", "total_timesteps=2_048")
    namespace: dict[str, Any] = {}
    exec(compile(block, str(DOCS), "exec"), namespace)
    assert namespace["model"].num_timesteps == 2_048


def test_make_vec_env_by_id_over_endpoints_learns_what_it_learns_locally(
    servers: ServerPool, dummy: Run, deterministic_torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rl-zoo's way: ``make_vec_env(env_id, n_envs=8)`` (a Monitor on each
    ``gym.make(env_id)``, a DummyVecEnv), the id ours, the address only in
    ``RLMESH_TRIO_ADDRESS``, against ``rlmesh-trio serve --endpoints 8``."""
    server = servers.get("ours", ServerConfig(env_id=ENV_ID, endpoints=N_ENVS))
    monkeypatch.setenv("RLMESH_TRIO_ADDRESS", ",".join(server.addresses))
    remote = train(
        f"make_vec_env by id ({N_ENVS} endpoints, serve --endpoints)",
        lambda: make_vec_env("rlmesh_trio:rlmesh_trio/Remote-v0", n_envs=N_ENVS),
    )
    same_learning(dummy, remote, deterministic_torch)
