"""A fault-injecting env and factory for the supervision tests.

``FaultyEnv`` is an episodic counter (observation ``[t, s]``: ``t`` steps since the reset,
``s`` the last reset's seed modulo 10, or -1; terminated at ``episode_steps``). Its action picks the behaviour of the step, so any
client -- ours, rlmesh's ``RemoteVectorEnv`` or ``rlmesh.run`` -- can trigger a fault:

* ``0``/``1``: a normal step (reward 1);
* :data:`RAISE`: ``RuntimeError("boom on step <t>")``;
* :data:`HANG`: blocks until the controller's ``release`` is set (bounded by
  :data:`HANG_SAFETY_SECONDS`, so a test that forgets it never leaves a thread for good).

Reset options: ``{"raise": 1}`` raises ``ValueError``; ``{"raise_once": 1}`` raises only
the first time the controller sees it (a retried reset then succeeds);
``{"hang": 1}`` blocks like a hanging step. ``make`` is the no-argument entrypoint for
server subprocesses (``support.faulty:make``; ``RLMESH_FAULTY_HANG_SECONDS`` bounds a hang
there, default 20 s). ``render()`` raises while the controller's
``render_raises`` is set; ``close()`` blocks while ``close_hangs`` is set.

Every env records the thread that built it and checks every later call against it
(``Controller.violations``): the supervision must never let an env run elsewhere.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

RAISE = 2
HANG = 3
HANG_SAFETY_SECONDS = float(os.environ.get("RLMESH_FAULTY_HANG_SECONDS", "20"))
EPISODE_STEPS = 8


class Controller:
    """Shared by a factory and every env it builds (thread-safe)."""

    def __init__(self, episode_steps: int = EPISODE_STEPS) -> None:
        self.episode_steps = episode_steps
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.render_raises = False
        self.close_hangs = False
        self.built: list[FaultyEnv] = []
        self.closed: list[FaultyEnv] = []
        self.violations: list[str] = []
        self.fail_builds = 0
        """The next ``fail_builds`` factory calls raise."""
        self.mismatch_builds = 0
        """The next ``mismatch_builds`` factory calls build an env with other spaces."""
        self.block_builds = 0
        """The next ``block_builds`` factory calls hang (until ``release``)."""
        self.raised_once: set[str] = set()
        self.hanging = threading.Semaphore(0)
        """Released once each time an env call starts to hang."""

    def wait_hanging(self, timeout: float = 10.0) -> None:
        if not self.hanging.acquire(timeout=timeout):
            raise AssertionError("no env call started to hang")


class Factory:
    """The env factory: ``Factory(controller)`` is what ``serve_env`` is given."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.calls = 0

    def __call__(self) -> FaultyEnv:
        c = self.controller
        with c.lock:
            self.calls += 1
            fail = c.fail_builds > 0
            if fail:
                c.fail_builds -= 1
            mismatch = not fail and c.mismatch_builds > 0
            if mismatch:
                c.mismatch_builds -= 1
            block = c.block_builds > 0
            if block:
                c.block_builds -= 1
        if block:
            c.hanging.release()
            c.release.wait(HANG_SAFETY_SECONDS)
        if fail:
            raise RuntimeError("factory down")
        env = FaultyEnv(c, wide=mismatch)
        with c.lock:
            c.built.append(env)
        return env


class FaultyEnv(gym.Env[np.ndarray, int]):
    metadata: dict[str, Any] = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, controller: Controller, *, wide: bool = False) -> None:
        self.controller = controller
        self.render_mode = "rgb_array"
        self.observation_space = spaces.Box(-1.0, 1000.0, (3 if wide else 2,), np.float32)
        self.action_space = spaces.Discrete(4)
        self.thread = threading.get_ident()
        self.thread_object = threading.current_thread()
        self.thread_name = threading.current_thread().name
        self.t = 0
        self.s = -1
        self.calls = 0

    def _check(self, what: str) -> None:
        self.calls += 1
        if threading.get_ident() != self.thread:
            with self.controller.lock:
                self.controller.violations.append(
                    f"{what} on {threading.current_thread().name}, built on {self.thread_name}"
                )

    def _hang(self) -> None:
        self.controller.hanging.release()
        self.controller.release.wait(HANG_SAFETY_SECONDS)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        self._check("reset")
        super().reset(seed=seed)
        options = options or {}
        if options.get("raise"):
            raise ValueError("reset refused")
        once = options.get("raise_once")
        if once:
            key = str(once)
            with self.controller.lock:
                first = key not in self.controller.raised_once
                self.controller.raised_once.add(key)
            if first:
                raise ValueError("reset refused once")
        if options.get("hang"):
            self._hang()
        self.t = 0
        if seed is not None:
            self.s = seed % 10
        return self._obs(), {"t": self.t}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._check("step")
        if int(action) == RAISE:
            raise RuntimeError(f"boom on step {self.t}")
        if int(action) == HANG:
            self._hang()
        self.t += 1
        terminated = self.t >= self.controller.episode_steps
        return self._obs(), 1.0, terminated, False, {"t": self.t}

    def render(self) -> np.ndarray:  # type: ignore[override]
        self._check("render")
        if self.controller.render_raises:
            raise OSError("no display")
        return np.full((2, 3, 3), self.t % 256, np.uint8)

    def close(self) -> None:
        self._check("close")
        if self.controller.close_hangs:
            self._hang()
        with self.controller.lock:
            self.controller.closed.append(self)

    def _obs(self) -> np.ndarray:
        obs = np.full(self.observation_space.shape, float(self.s), np.float32)
        obs[0] = self.t
        return obs


_PROCESS = Controller()


def make() -> FaultyEnv:
    """Entrypoint for a server subprocess: one controller per process."""
    return Factory(_PROCESS)()
