"""Popular third-party envs served as they are (``envs`` marker: ``nox -s envs`` installs
them; skipped where they are not installed).

MiniGrid's observation holds a ``MissionSpace``, which rlmesh-wire-v1 lacks: it is served
as ``Text`` (a charset and lengths holding every mission), the values are the strings.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from support.refserver import ServerConfig, ServerPool

pytest.importorskip("minigrid")

pytestmark = [pytest.mark.envs, pytest.mark.timeout(120)]

ENTRYPOINTS = {
    "MiniGrid-Empty-5x5-v0": "support.envs:make_minigrid_empty",
    "MiniGrid-DoorKey-5x5-v0": "support.envs:make_minigrid_doorkey",
}

# A fixed walk: forward, turn, forward... (MiniGrid actions: 0 left, 1 right, 2 forward,
# 3 pickup, 5 toggle); long enough to end an Empty-5x5 episode and to touch DoorKey's key.
ACTIONS = [2, 2, 1, 2, 2, 0, 3, 2, 5, 2, 1, 2, 2, 2, 0, 2] * 4


def transcript(env: Any, seed: int) -> list[Any]:
    obs, _ = env.reset(seed=seed)
    out: list[Any] = [_plain(obs)]
    for action in ACTIONS:
        obs, reward, terminated, truncated, _ = env.step(action)
        out.append((_plain(obs), float(reward), bool(terminated), bool(truncated)))
        if terminated or truncated:
            obs, _ = env.reset(seed=seed + 1)
            out.append(_plain(obs))
    return out


def _plain(obs: Any) -> Any:
    return {
        "image": np.asarray(obs["image"]).tolist(),
        "direction": int(obs["direction"]),
        "mission": str(obs["mission"]),
    }


@pytest.mark.parametrize("env_id", sorted(ENTRYPOINTS))
def test_minigrid_through_remote_env_matches_the_local_env(
    servers: ServerPool, env_id: str
) -> None:
    import minigrid  # noqa: F401
    from rlmesh.numpy import RemoteEnv

    server = servers.get("ours", ServerConfig(entrypoint=ENTRYPOINTS[env_id]))
    local = gym.make(env_id)
    expected = transcript(local, seed=5)
    runs = []
    for _ in range(2):  # identical answers run to run
        remote = RemoteEnv(server.address, request_timeout_seconds=30.0)
        try:
            runs.append(transcript(remote, seed=5))
        finally:
            remote.close()
    local.close()
    assert runs[0] == expected
    assert runs[1] == expected
