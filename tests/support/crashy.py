"""Envs that do what thread lanes cannot survive, for the process-lane tests.

``CrashyEnv``'s action picks the step's behaviour: :data:`OK` a normal step,
:data:`SEGFAULT` reads address 0 (the process dies with SIGSEGV), :data:`EXIT` calls
``os._exit(3)``, :data:`HOG` runs a regex with catastrophic backtracking (native code that
holds the GIL for a long time), :data:`RAISE` raises. Observation: ``[t, pid]`` (the
process the env lives in). Module-level factories, so they pickle into a lane's process.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

OK, SEGFAULT, EXIT, HOG, RAISE = 0, 1, 2, 3, 4
HOG_LENGTH = 34
"""``(a+)+$`` against ``"a" * HOG_LENGTH + "b"`` backtracks ~2**HOG_LENGTH times: minutes."""


class CrashyEnv(gym.Env[np.ndarray, int]):
    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0.0, 2.0**24, (2,), np.float32)
        self.action_space = spaces.Discrete(5)
        self.t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        action = int(action)
        if action == SEGFAULT:
            ctypes.string_at(0)
        elif action == EXIT:
            os._exit(3)
        elif action == HOG:
            re.match(r"(a+)+$", "a" * HOG_LENGTH + "b")
        elif action == RAISE:
            raise RuntimeError("crashy raised")
        self.t += 1
        return self._obs(), 1.0, self.t >= 50, False, {}

    def _obs(self) -> np.ndarray:
        return np.array([self.t, os.getpid()], np.float32)


def make_crashy() -> CrashyEnv:
    return CrashyEnv()


BUSY_LOOPS = 20_000
"""``BusyEnv.step`` runs this many iterations of a Python loop (about 4 ms here):
pure-Python work that holds the GIL, as most gymnasium envs do."""


class BusyEnv(gym.Env[np.ndarray, int]):
    """An episodic env whose step is pure-Python CPU work (for the process-lane bench)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0.0, 1e9, (1,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        total = 0
        for i in range(BUSY_LOOPS):
            total += i ^ int(action)
        self.t += 1
        return np.array([total % 1000], np.float32), 1.0, self.t >= 100, False, {}


def make_busy() -> BusyEnv:
    return BusyEnv()


FRAMES_SEGFAULT = 4
"""``FramesEnv.step(FRAMES_SEGFAULT)`` reads address 0; every other action is a normal step."""


class FramesEnv(gym.Env[np.ndarray, int]):
    """Atari-sized frames (210x160x3 uint8), a fresh one each step (for the benches)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, (210, 160, 3), np.uint8)
        self.action_space = spaces.Discrete(5)
        self.t = 0
        self._frames = [np.full((210, 160, 3), i, np.uint8) for i in range(4)]

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return self._frames[0], {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if int(action) == FRAMES_SEGFAULT:
            ctypes.string_at(0)
        self.t += 1
        return self._frames[self.t % 4], 0.0, self.t >= 200, False, {}


def make_frames() -> FramesEnv:
    return FramesEnv()
