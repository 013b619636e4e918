"""Episode returns from the lanes that are ready: ``VectorEnv(batch_size=)`` with
EnvPool's ``send`` / ``recv``, each batch's rows kept apart by ``infos["env_id"]``.

Serve some lanes first (step times that vary are where this pays off), e.g.
``rlmesh-trio serve --env CartPole-v1 --num-envs 16``, then
``python examples/pool_returns.py tcp://127.0.0.1:50051``.
"""

from __future__ import annotations

import sys

import numpy as np

from rlmesh_trio.client import VectorEnv


def collect(address: str, *, batch_size: int, batches: int, seed: int = 0) -> list[float]:
    """Run a lean-following CartPole policy for ``batches`` batches; the returns of the
    episodes that finished."""
    envs = VectorEnv(address, batch_size=batch_size)
    returns = np.zeros(envs.num_envs)
    finished: list[float] = []
    try:
        envs.async_reset(seed=seed)
        for _ in range(batches):
            obs, rewards, terminated, truncated, infos = envs.recv()
            lanes = infos["env_id"]  # which lanes these rows are, in lane order
            returns[lanes] += rewards
            for lane in lanes[terminated | truncated]:
                finished.append(float(returns[lane]))  # that lane's episode return
                returns[lane] = 0.0  # NEXT_STEP: its next send resets it
            actions = (obs[:, 2] + obs[:, 3] > 0).astype(np.int64)  # this batch only
            envs.send(actions, lanes)
    finally:
        envs.close()
    return finished


if __name__ == "__main__":
    address = sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:50051"
    returns = collect(address, batch_size=4, batches=5000)
    print(f"{len(returns)} episodes, mean return {np.mean(returns):.1f}")
