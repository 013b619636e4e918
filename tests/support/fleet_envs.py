"""Envs for the fleet tests, shipped to Ray workers by value (``register_pickle_by_value``).

``make_wedge_once(marker)``: CartPole whose step, the first time any process of the
fleet steps it after ``marker`` was claimed, holds the GIL for ten minutes -- a
wedged endpoint: its process is alive (Ray sees a healthy actor) but answers nothing,
not even the health check. Exactly one process claims the marker (``O_EXCL``), so the
restarted endpoint serves normally.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import gymnasium as gym

WEDGE_SECONDS = 600
"""How long a wedged step holds the GIL (the supervisor kills the process long before)."""


class WedgeOnce(gym.Wrapper[Any, Any, Any, Any]):
    def __init__(self, env: gym.Env[Any, Any], marker: str, after_steps: int) -> None:
        super().__init__(env)
        self._marker = marker
        self._after = after_steps
        self._steps = 0

    def step(self, action: Any) -> Any:
        self._steps += 1
        if self._steps == self._after:
            try:
                fd = os.open(self._marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                pass
            else:
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                # libc sleep() through PyDLL keeps the GIL: every thread of the process stops.
                ctypes.PyDLL(None).sleep(WEDGE_SECONDS)
        return self.env.step(action)


def make_wedge_once(marker: str, after_steps: int = 20) -> gym.Env[Any, Any]:
    return WedgeOnce(gym.make("CartPole-v1"), marker, after_steps)


def make_loud(marker: str) -> gym.Env[Any, Any]:
    """CartPole that prints ``marker`` to its process's stdout when it is built."""
    print(marker, flush=True)
    return gym.make("CartPole-v1")
