"""Environment factories shared by both servers under test.

Every ``make_*`` function takes no argument and returns a fresh env, so it can be named
as an entrypoint (``support.envs:make_nested``) by the reference-server runner and by
``rlmesh-trio serve --entrypoint``; both are started with ``tests/`` on ``PYTHONPATH``.

The envs are deterministic given their seeds (and the history of seeded resets), so
the same scripted client session yields the same bytes from either server.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

SELF_SEED = 12345
"""Seed our own envs use until a reset brings one, so unseeded resets are reproducible."""

BOOM_RESET_SEED = 666
"""``BoomEnv.reset(seed=BOOM_RESET_SEED)`` raises ``ValueError``."""

BOOM_STEP_ACTION = 2
"""``BoomEnv.step(BOOM_STEP_ACTION)`` raises ``RuntimeError``."""

NAN_OBS_ACTION = 3
"""``BoomEnv.step(NAN_OBS_ACTION)`` returns an observation holding NaN."""

FRAME_HW = (4, 6)
"""Height and width of the frames ``BoomEnv.render`` returns."""

SLEEP_STEP_SECONDS = 0.002
"""How long one ``SleepEnv.step`` sleeps (``time.sleep`` releases the GIL)."""

SLEEP_EPISODE_STEPS = 50
"""``SleepEnv`` episodes end (terminated) after this many steps."""

SLOW_STEP_UNIT_SECONDS = 0.1
"""``SlowEnv.step(a)`` sleeps ``a * SLOW_STEP_UNIT_SECONDS``."""

HANG_SAFETY_SECONDS = 30.0
"""``HangEnv`` gives up waiting for its release event after this long."""


def make_cartpole() -> gym.Env[Any, Any]:
    """gymnasium's ``CartPole-v1`` through ``gym.make`` (id ``CartPole-v1``)."""
    return gym.make("CartPole-v1")


def make_cartpole_trunc3() -> gym.Env[Any, Any]:
    """CartPole cut by gymnasium's TimeLimit after 3 steps (natural truncation)."""
    return gym.make("CartPole-v1", max_episode_steps=3)


class NestedEnv(gym.Env[dict[str, Any], dict[str, Any]]):
    """Nested Dict/Tuple observation over every leaf kind rlmesh-wire-v1 knows, Dict action.

    Observation leaves: unbounded, half-infinite, elementwise and uniform Boxes of
    float32/float64/int16/float16/uint8, Discrete with a positive and a negative
    ``start``, MultiBinary, MultiDiscrete, Text; the Dict is declared out of key order
    (the wire sorts keys). Infos hold lists, numpy scalars and arrays, ``None``, bytes
    and nested dicts; the reset info echoes the seed and the reset options; the step
    info echoes the decoded action, so both servers' action decoding is compared too.
    An episode terminates after 3..7 steps (drawn at reset) or is truncated at step 6.
    """

    metadata: dict[str, Any] = {
        "render_modes": [],
        "render_fps": 10,
        "nested": {"ints": [1, -2], "pi": 3.25, "name": "nested", "none": None, "yes": True},
    }

    TRUNCATE_AT = 6

    def __init__(self) -> None:
        self.observation_space = spaces.Dict(
            collections.OrderedDict(
                [
                    ("zeta", spaces.Box(-np.inf, np.inf, (3,), np.float32)),
                    ("alpha", spaces.Discrete(5, start=2)),
                    ("half", spaces.Box(0.0, np.inf, (2,), np.float64)),
                    (
                        "elem",
                        spaces.Box(
                            np.array([-1.0, -2.0]), np.array([1.0, np.inf]), dtype=np.float64
                        ),
                    ),
                    ("i16", spaces.Box(-5, 5, (2,), np.int16)),
                    ("f16", spaces.Box(-1.0, 1.0, (1,), np.float16)),
                    ("mb", spaces.MultiBinary(4)),
                    ("md", spaces.MultiDiscrete([3, 4])),
                    ("txt", spaces.Text(8, min_length=1, charset="fedcba")),
                    (
                        "tup",
                        spaces.Tuple(
                            (
                                spaces.Box(0, 255, (2, 2), np.uint8),
                                spaces.Discrete(3),
                                spaces.Dict({"inner": spaces.Box(-1.0, 1.0, (1,), np.float32)}),
                            )
                        ),
                    ),
                    ("negd", spaces.Discrete(3, start=-1)),
                ]
            )
        )
        self.action_space = spaces.Dict(
            {
                "move": spaces.Box(-1.0, 1.0, (2,), np.float32),
                "fire": spaces.Discrete(2),
                "buttons": spaces.MultiBinary(3),
                "say": spaces.Text(6, min_length=1, charset="xyz"),
            }
        )
        self.np_random = np.random.default_rng(SELF_SEED)
        self._t = 0
        self._len = 0
        self._pos = np.zeros(3, np.float32)

    def _observation(self) -> dict[str, Any]:
        rng = self.np_random
        letters = np.array(list("abcdef"))
        text = "".join(rng.choice(letters, size=int(rng.integers(1, 9))).tolist())
        return {
            "zeta": self._pos.copy(),
            "alpha": np.int64(rng.integers(2, 7)),
            "half": rng.uniform(0.0, 10.0, 2),
            "elem": np.array([rng.uniform(-1.0, 1.0), rng.uniform(-2.0, 50.0)]),
            "i16": rng.integers(-5, 6, 2).astype(np.int16),
            "f16": np.array([rng.uniform(-1.0, 1.0)], np.float16),
            "mb": rng.integers(0, 2, 4).astype(np.int8),
            "md": np.array([rng.integers(0, 3), rng.integers(0, 4)], np.int64),
            "txt": text,
            "tup": (
                rng.integers(0, 256, (2, 2)).astype(np.uint8),
                np.int64(rng.integers(0, 3)),
                {"inner": np.array([rng.uniform(-1.0, 1.0)], np.float32)},
            ),
            "negd": np.int64(rng.integers(-1, 2)),
        }

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        self._len = int(self.np_random.integers(3, 8))
        self._pos = self.np_random.uniform(-1.0, 1.0, 3).astype(np.float32)
        info: dict[str, Any] = {
            "seed": seed,
            "options_seen": options,
            "episode_len": np.int32(self._len),
            "arr": np.arange(4, dtype=np.int32).reshape(2, 2),
            "empty": np.zeros(0, np.float32),
        }
        return self._observation(), info

    def step(
        self, action: dict[str, Any]
    ) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        move = np.asarray(action["move"], dtype=np.float64)
        fire = int(action["fire"])
        buttons = [int(b) for b in np.asarray(action["buttons"]).reshape(-1)]
        say = str(action["say"])
        self._t += 1
        self._pos = (self._pos + np.resize(move, 3).astype(np.float32) * 0.5).astype(np.float32)
        reward = float(fire) + 0.5 * float(move.sum()) + 0.01 * len(say) + 0.1 * sum(buttons)
        terminated = self._t >= self._len
        truncated = not terminated and self._t >= self.TRUNCATE_AT
        info: dict[str, Any] = {
            "t": self._t,
            "echo": {"move": move.tolist(), "fire": fire, "buttons": buttons, "say": say},
            "ratio": np.float32(self._t / 8),
            "half": np.float16(0.5),
            "hist": np.arange(self._t, dtype=np.int16),
            "maybe": None,
            "raw": bytes([self._t, 255]),
            "flags": [True, False, None, np.bool_(True)],
            "nested": {"a": {"b": [np.int64(-self._t), 1.5, "x"]}, "u8": np.uint8(200)},
        }
        return self._observation(), reward, terminated, truncated, info

    def render(self) -> None:
        """No render mode: nothing to render (like CartPole without ``render_mode``)."""
        return None


def make_nested() -> NestedEnv:
    return NestedEnv()


class SleepEnv(gym.Env[np.ndarray, Any]):
    """Every step sleeps :data:`SLEEP_STEP_SECONDS` (GIL released); episodes last 50 steps."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, step_seconds: float = SLEEP_STEP_SECONDS) -> None:
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.step_seconds = step_seconds
        self._t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        time.sleep(self.step_seconds)
        self._t += 1
        obs = np.array([self._t / SLEEP_EPISODE_STEPS, float(action) - 0.5], np.float32)
        return obs, 1.0, self._t >= SLEEP_EPISODE_STEPS, False, {}


def make_sleep() -> SleepEnv:
    return SleepEnv()


IMAGE_SHAPE = (210, 160, 3)
"""``ImageEnv`` frames: an Atari screen (210 x 160 RGB, uint8)."""

IMAGE_EPISODE_STEPS = 100
"""``ImageEnv`` episodes end (terminated) after this many steps."""


class ImageEnv(gym.Env[np.ndarray, Any]):
    """Atari-sized uint8 frames at almost no env cost: what a server's value path costs.

    The frames are precomputed (seeded noise); a step returns the next one.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, IMAGE_SHAPE, np.uint8)
        self.action_space = spaces.Discrete(4)
        rng = np.random.default_rng(SELF_SEED)
        self._frames = rng.integers(0, 256, (4, *IMAGE_SHAPE), dtype=np.uint8)
        self._t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return self._frames[0], {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        frame = self._frames[(self._t + int(action)) % len(self._frames)]
        return frame, 1.0, self._t >= IMAGE_EPISODE_STEPS, False, {}


def make_image() -> ImageEnv:
    return ImageEnv()


class BoomEnv(gym.Env[np.ndarray, Any]):
    """An env that fails on demand, with an ``rgb_array`` render.

    * ``reset(seed=BOOM_RESET_SEED)`` raises ``ValueError("boom in reset (seed 666)")``;
    * ``reset(options={"boom_render": True})`` makes the following renders raise
      ``RuntimeError("boom in render")``;
    * ``reset(options={"bad_info": kind})`` returns an info the wire cannot carry
      (``"set"``: a set, ``"overflow"``: 2**70, ``"uint64"``: ``np.uint64(2**64 - 1)``);
    * ``step(BOOM_STEP_ACTION)`` raises ``RuntimeError("boom in step")``;
    * ``step(NAN_OBS_ACTION)`` returns an observation holding NaN.

    ``render()`` returns a deterministic ``FRAME_HW + (3,)`` uint8 frame.
    """

    metadata: dict[str, Any] = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, render_mode: str | None = "rgb_array") -> None:
        self.observation_space = spaces.Box(0.0, 1.0, (2,), np.float32)
        self.action_space = spaces.Discrete(4)
        self.render_mode = render_mode
        self._t = 0
        self._boom_render = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        if seed == BOOM_RESET_SEED:
            raise ValueError(f"boom in reset (seed {seed})")
        super().reset(seed=seed)
        options = options or {}
        self._t = 0
        self._boom_render = bool(options.get("boom_render", False))
        info: dict[str, Any] = {"seed": seed}
        bad = options.get("bad_info")
        if bad == "set":
            info["bad"] = {1, 2}
        elif bad == "overflow":
            info["bad"] = 2**70
        elif bad == "uint64":
            info["bad"] = np.uint64(2**64 - 1)
        return np.array([0.0, 0.5], np.float32), info

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        action = int(action)
        if action == BOOM_STEP_ACTION:
            raise RuntimeError("boom in step")
        self._t += 1
        first = np.nan if action == NAN_OBS_ACTION else min(self._t / 10, 1.0)
        obs = np.array([first, 0.5], np.float32)
        return obs, float(action), self._t >= 10, False, {"t": self._t}

    def render(self) -> np.ndarray:
        if self._boom_render:
            raise RuntimeError("boom in render")
        h, w = FRAME_HW
        frame = np.zeros((h, w, 3), np.uint8)
        frame[..., 0] = np.arange(w, dtype=np.uint8) * 40
        frame[..., 1] = (np.arange(h, dtype=np.uint8) * 60)[:, None]
        frame[..., 2] = self._t
        return frame


def make_boom() -> BoomEnv:
    return BoomEnv()


class SlowEnv(gym.Env[np.ndarray, Any]):
    """Sleeps a chosen time: ``step(a)`` for ``a * 0.1`` s, ``reset`` for ``options["sleep"]`` s."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0.0, 10.0, (1,), np.float32)
        self.action_space = spaces.Discrete(40)
        self._t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        time.sleep(float((options or {}).get("sleep", 0.0)))
        return np.zeros(1, np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        time.sleep(int(action) * SLOW_STEP_UNIT_SECONDS)
        self._t += 1
        return np.array([min(self._t, 10)], np.float32), float(action), False, False, {}


def make_slow() -> SlowEnv:
    return SlowEnv()


class HangEnv(gym.Env[np.ndarray, Any]):
    """``step`` blocks on :attr:`release` (a ``threading.Event``), ``reset`` does not.

    In-process tests set ``release`` to unblock it; in a server subprocess nothing
    does, so a step hangs until :data:`HANG_SAFETY_SECONDS` pass (a bound, so a test
    that forgets the env never leaves a thread behind for good).
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, release: threading.Event | None = None) -> None:
        self.observation_space = spaces.Box(0.0, 1.0, (1,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.release = release if release is not None else threading.Event()

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        released = self.release.wait(HANG_SAFETY_SECONDS)
        return np.ones(1, np.float32), 1.0 if released else 0.0, False, False, {}


def make_hang() -> HangEnv:
    return HangEnv()


def make_minigrid_empty() -> gym.Env[Any, Any]:
    """MiniGrid's Empty-5x5 (needs the ``envs`` extra): its mission is a MissionSpace."""
    import minigrid  # noqa: F401  (registers the MiniGrid ids)

    return gym.make("MiniGrid-Empty-5x5-v0")


def make_minigrid_doorkey() -> gym.Env[Any, Any]:
    import minigrid  # noqa: F401

    return gym.make("MiniGrid-DoorKey-5x5-v0")


class EchoEnv(gym.Env[np.ndarray, np.ndarray]):
    """Big Box actions and observations: the observation is the last action."""

    metadata: dict[str, Any] = {"render_modes": []}
    SHAPE = (512, 512, 5)  # 1.25 MiB a lane: over the server's 1 MiB window

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, self.SHAPE, np.uint8)
        self.action_space = spaces.Box(0, 255, self.SHAPE, np.uint8)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        return np.zeros(self.SHAPE, np.uint8), {}

    def step(self, action: Any) -> Any:
        return np.array(action, np.uint8), 0.0, False, False, {}


def make_echo() -> EchoEnv:
    return EchoEnv()


class Outer:
    """Holds an exception class, so that its qualified name is ``Outer.Inner``."""

    class Inner(RuntimeError):
        pass


class Unprintable(RuntimeError):
    """An exception whose ``str()`` raises."""

    def __str__(self) -> str:
        raise ValueError("no text for this one")


class AnswersEnv(gym.Env[np.ndarray, int]):
    """Answers ``reset`` and ``step`` in the shape the reset's options ask for, to compare
    how the two servers read an env's answers: ``{"step": kind}`` picks what every
    following step returns (or raises), ``{"reset": kind}`` what this reset returns.

    Step kinds: ``plain``; flags that are no ``bool`` (``int-flag``, ``array-flag``) or a
    ``numpy.bool_`` (``np-bool-flag``); rewards that are no real number (``str-reward``,
    ``none-reward``); a ``list``, ``None``, ``three`` or ``six`` values instead of a tuple
    of five; legacy Gym's four (``legacy``, ``legacy-time-limit``: ``done`` with
    ``info["TimeLimit.truncated"]``); ``nan-obs-and-bad-reward`` (which is told first);
    an info of None (``info-none``, ``info-none-done``); exceptions named by their
    qualified name (``nested-exception``) or whose text cannot be had
    (``unprintable-exception``); info keys that are no ``str`` at some depth
    (``info-none-key``, ``info-nested-none-key``, ``info-none-key-in-list``,
    ``info-nested-int-key``). Reset kinds: ``plain``, ``obs-only`` (no info),
    ``one-tuple``, ``info-none``.
    """

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self) -> None:
        self._step_kind = "plain"

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        options = options or {}
        self._step_kind = str(options.get("step", "plain"))
        kind = options.get("reset", "plain")
        obs = np.zeros(2, np.float32)
        if kind == "obs-only":
            return obs
        if kind == "one-tuple":
            return (obs,)
        if kind == "info-none":
            return obs, None
        return obs, {"seed": seed}

    def step(self, action: int) -> Any:
        obs = np.full(2, 0.5, np.float32)
        answers: dict[str, Any] = {
            "plain": (obs, 1.0, False, False, {}),
            "int-flag": (obs, 1.0, 1, False, {}),
            "array-flag": (obs, 1.0, np.array(True), False, {}),
            "np-bool-flag": (obs, 1.0, np.bool_(True), False, {}),
            "str-reward": (obs, "1.5", False, False, {}),
            "none-reward": (obs, None, False, False, {}),
            "list": [obs, 1.0, False, False, {}],
            "none": None,
            "three": (obs, 1.0, False),
            "six": (obs, 1.0, False, False, {}, 0),
            "legacy": (obs, 1.0, True, {"x": 1}),
            "legacy-time-limit": (obs, 1.0, True, {"TimeLimit.truncated": True}),
            "nan-obs-and-bad-reward": (np.full(2, np.nan, np.float32), "x", False, False, {}),
            "info-none": (obs, 1.0, False, False, None),
            "info-none-done": (obs, 1.0, True, False, None),
            "info-none-key": (obs, 1.0, False, False, {None: 1}),
            "info-nested-none-key": (obs, 1.0, False, False, {"k": {"j": {None: 1}}}),
            "info-none-key-in-list": (obs, 1.0, False, False, {"k": [{"a": 1, None: 2}]}),
            "info-nested-int-key": (obs, 1.0, False, False, {"k": {3: 1}}),
        }
        if self._step_kind == "nested-exception":
            raise Outer.Inner("inner")
        if self._step_kind == "unprintable-exception":
            raise Unprintable()
        return answers[self._step_kind]


def make_answers() -> AnswersEnv:
    return AnswersEnv()


class SeedOnlyResetEnv(gym.Env[np.ndarray, int]):
    """``reset(self, seed=None)``: no ``options`` parameter (an older env's signature)."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, seed: int | None = None) -> Any:  # type: ignore[override]
        return np.zeros(2, np.float32), {"seed_seen": repr(seed)}

    def step(self, action: int) -> Any:
        return np.zeros(2, np.float32), 0.0, False, False, {}


def make_seed_only_reset() -> SeedOnlyResetEnv:
    return SeedOnlyResetEnv()


class NoArgResetEnv(SeedOnlyResetEnv):
    """``reset(self)``: neither ``seed`` nor ``options``."""

    def reset(self) -> Any:  # type: ignore[override]
        return np.zeros(2, np.float32), {}


def make_no_arg_reset() -> NoArgResetEnv:
    return NoArgResetEnv()


FRAME_KINDS: dict[str, Any] = {
    "rgb": np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3),
    "rgba": np.arange(5 * 7 * 4, dtype=np.uint8).reshape(5, 7, 4),
    "gray": np.arange(5 * 7, dtype=np.uint8).reshape(5, 7),
    "gray-with-channel-axis": np.arange(5 * 7, dtype=np.uint8).reshape(5, 7, 1),
    "two-channels": np.zeros((2, 2, 2), np.uint8),
    "five-channels": np.zeros((2, 2, 5), np.uint8),
    "stack": [np.zeros((2, 2, 3), np.uint8)] * 2,
    "float": np.linspace(0.0, 3.5, 2 * 2 * 3).reshape(2, 2, 3),
    "int64-past-255": np.arange(0, 5 * 7 * 3 * 3, 3, dtype=np.int64).reshape(5, 7, 3),
    "uint16": np.full((2, 2, 3), 1000, np.uint16),
    "negative": np.full((2, 2, 3), -5, np.int32),
    "bool": np.ones((2, 2, 3), bool),
    "text": "ab\ncd",
    "empty": np.zeros((0, 0, 3), np.uint8),
}
"""What :class:`FramesEnv` can render, by name."""


class FramesEnv(AnswersEnv):
    """Renders the frame its last reset's options name (``{"frame": kind}``, of
    :data:`FRAME_KINDS`): every shape and dtype a render may return, to compare how the
    two servers encode them."""

    metadata: dict[str, Any] = {"render_modes": ["rgb_array"], "render_fps": 4}

    def __init__(self, render_mode: str | None = "rgb_array") -> None:
        super().__init__()
        self.render_mode = render_mode
        self._frame = "rgb"

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        self._frame = str((options or {}).get("frame", "rgb"))
        return super().reset(seed=seed, options=options)

    def render(self) -> Any:
        return FRAME_KINDS[self._frame]


def make_frames() -> FramesEnv:
    return FramesEnv()
