"""CartPole whose step takes an uneven time: the straggler workload of the pool tests and
of ``bench/bench_pool.py``.

Each step sleeps (``time.sleep``, the GIL released, as a native simulator does) a time
drawn from a heavy-tailed distribution: a Pareto with shape ``RLT_UNEVEN_ALPHA`` (1.2),
scaled to start at ``RLT_UNEVEN_MIN_MS`` and clipped at ``RLT_UNEVEN_MAX_MS`` (1 and 20
by default). The draws come from a generator of their own (OS entropy), so the env's
observations, rewards and episodes are CartPole's for the seed it is reset with.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import gymnasium as gym


def _setting(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


class UnevenStep(gym.Wrapper):  # type: ignore[type-arg]
    """Sleeps a heavy-tailed time in every ``step``."""

    def __init__(self, env: gym.Env[Any, Any]) -> None:
        super().__init__(env)
        self.low = _setting("RLT_UNEVEN_MIN_MS", 1.0) / 1000.0
        self.high = _setting("RLT_UNEVEN_MAX_MS", 20.0) / 1000.0
        self.alpha = _setting("RLT_UNEVEN_ALPHA", 1.2)
        self._draws = random.Random()

    def step_seconds(self) -> float:
        return min(self.high, self.low * self._draws.paretovariate(self.alpha))

    def step(self, action: Any) -> Any:
        time.sleep(self.step_seconds())
        return self.env.step(action)


def make() -> UnevenStep:
    return UnevenStep(gym.make("CartPole-v1"))
