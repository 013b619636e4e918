"""Serve CartPole on 4 lanes and evaluate a policy against it, in one Trio program.

``serve_env`` and the evaluation share one nursery: one task per lane drives its lane
with lane-scoped requests (they pipeline on the one connection), each running whole
episodes with its own seeds. Cancelling the nursery stops the server.

Run: ``python examples/serve_and_evaluate.py [EPISODES]``.
"""

from __future__ import annotations

import sys
from functools import partial

import numpy as np
import trio

from rlmesh_trio import serve_env
from rlmesh_trio.client import Endpoint, open_endpoint


def policy(observation: np.ndarray) -> int:
    """Push the cart the way the pole leans (angle plus angular velocity)."""
    return int(observation[2] + 0.5 * observation[3] > 0)


async def evaluate_lane(ep: Endpoint, lane: int, seeds: list[int], returns: list[float]) -> None:
    for seed in seeds:
        obs, _ = await ep.reset(seeds=[seed], env_indices=[lane])
        total, done = 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = await ep.step(
                np.array([policy(obs[0])]), env_indices=[lane], timeout_ms=5_000
            )
            total += float(reward[0])
            done = bool(terminated[0] or truncated[0])
        returns.append(total)


async def main(episodes: int = 20, num_envs: int = 4) -> list[float]:
    returns: list[float] = []
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            partial(serve_env, "CartPole-v1", num_envs=num_envs, address="tcp://127.0.0.1:0")
        )
        async with open_endpoint(server.address) as ep, trio.open_nursery() as lanes:
            for lane in range(num_envs):
                seeds = list(range(lane, episodes, num_envs))  # episode i runs on lane i % N
                lanes.start_soon(evaluate_lane, ep, lane, seeds, returns)
        nursery.cancel_scope.cancel()  # stop the server
    print(f"{len(returns)} episodes on {server.address}: mean return {np.mean(returns):.1f}")
    return returns


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 20)
