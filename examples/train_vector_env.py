"""A training loop on ``rlmesh_trio.client.VectorEnv``: the cross-entropy method on a
linear CartPole policy, the envs served elsewhere.

Start a server first (``rlmesh-trio serve --env CartPole-v1 --num-envs 8``) and pass
the address it prints. The VectorEnv is a plain ``gymnasium.vector.VectorEnv`` with
NEXT_STEP autoreset, so any loop written for ``SyncVectorEnv`` runs on it unchanged:
here each lane plays one candidate policy per generation.

Run: ``python examples/train_vector_env.py ADDRESS [GENERATIONS]``.
"""

from __future__ import annotations

import sys

import numpy as np
from gymnasium.vector import AutoresetMode

from rlmesh_trio.client import VectorEnv


def evaluate(envs: VectorEnv, weights: np.ndarray, seed: int, max_steps: int = 500) -> np.ndarray:
    """Each lane's return over one episode, lane i acting with ``weights[i]``."""
    obs, _ = envs.reset(seed=seed)
    returns = np.zeros(envs.num_envs)
    running = np.ones(envs.num_envs, dtype=bool)
    for _ in range(max_steps):
        actions = (np.einsum("ij,ij->i", obs, weights) > 0).astype(np.int64)
        obs, rewards, terminated, truncated, _ = envs.step(actions)
        returns += rewards * running
        running &= ~(terminated | truncated)  # NEXT_STEP: a finished lane resets next step
        if not running.any():
            break
    return returns


def train(address: str, generations: int = 10, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    envs = VectorEnv(address, autoreset_mode=AutoresetMode.NEXT_STEP)
    try:
        dim = envs.single_observation_space.shape[0]
        mean, std = np.zeros(dim), np.ones(dim)
        history = []
        for generation in range(generations):
            candidates = mean + std * rng.standard_normal((envs.num_envs, dim))
            returns = evaluate(envs, candidates, seed=seed + generation)
            elite = candidates[np.argsort(returns)[-max(2, envs.num_envs // 4) :]]
            mean, std = elite.mean(axis=0), elite.std(axis=0) + 0.05
            history.append(float(returns.mean()))
            print(
                f"generation {generation}: mean return {returns.mean():.1f}, best {returns.max():.0f}"
            )
        return history
    finally:
        envs.close()


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10)
