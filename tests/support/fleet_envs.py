"""Envs for the fleet tests, shipped to Ray workers by value (``register_pickle_by_value``).

``make_wedge_once(marker)``: CartPole whose step, the first time any process of the
fleet steps it after ``marker`` was claimed, holds the GIL for ten minutes -- a
wedged endpoint: its process is alive (Ray sees a healthy actor) but answers nothing,
not even the health check. Exactly one process claims the marker (``O_EXCL``), so the
restarted endpoint serves normally.

``make_hang_on_lane(marker, lane, hang_at)``: CartPole whose ``hang_at``-th step of every
episode hangs (a sleep: the GIL is free, the rest of the endpoint serves on) on lane
``lane`` of the one process that claimed ``marker`` -- an env whose hangs make the
server give that lane up (``--on-lane-fault truncate --lane-timeout-seconds S``: each
hang is abandoned and the lane rebuilt, until it has left too many threads behind).
The restarted endpoint (another process) never hangs.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
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


def _claimed_by_this_process(marker: str) -> bool:
    """The first caller of any process claims ``marker`` (its pid, written once)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        with open(marker) as claimed:
            return claimed.read() == str(os.getpid())
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


class HangOnLane(gym.Wrapper[Any, Any, Any, Any]):
    def __init__(self, env: gym.Env[Any, Any], marker: str, lane: int, hang_at: int) -> None:
        super().__init__(env)
        self._marker = marker
        self._thread = f"rlmesh-trio-lane-{lane}"  # every incarnation of the lane's thread
        self._hang_at = hang_at
        self._steps = 0

    def reset(self, **kwargs: Any) -> Any:
        self._steps = 0
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> Any:
        self._steps += 1
        hang = self._steps == self._hang_at and threading.current_thread().name == self._thread
        if hang and _claimed_by_this_process(self._marker):
            time.sleep(WEDGE_SECONDS)
        return self.env.step(action)


def make_hang_on_lane(marker: str, lane: int = 1, hang_at: int = 3) -> gym.Env[Any, Any]:
    return HangOnLane(gym.make("CartPole-v1"), marker, lane, hang_at)


def make_loud(marker: str) -> gym.Env[Any, Any]:
    """CartPole that prints ``marker`` to its process's stdout when it is built."""
    print(marker, flush=True)
    return gym.make("CartPole-v1")
