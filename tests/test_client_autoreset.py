"""The client's autoreset (``client/_autoreset.py``) against gymnasium's, without a server.

``VectorEnv.step`` is the plan (:func:`plan_step`, :func:`same_step_resets`), one round
trip, and the fold (:func:`fold_step`; :func:`fold_reset` for ``reset``). Here the round
trip is a direct call on local envs, each lane's own copy of a scripted env that ends its
episodes (terminated or truncated) on a fixed schedule, and every step's result -- the
observations, rewards, flags and the infos with ``final_obs``/``final_info`` and their
masks -- is held to ``SyncVectorEnv``'s over the same envs, in each autoreset mode.
SB3's ``RemoteVecEnv`` does its same-step reset with the same plan and
:func:`fold_terminal`, held here to SB3's ``DummyVecEnv`` (when SB3 is installed).
The transcripts over a real endpoint are tests/test_client_gym.py's and
tests/test_client_sb3.py's.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from rlmesh_trio.client._autoreset import (
    AddInfo,
    StepPlan,
    VectorLanes,
    fold_reset,
    fold_step,
    fold_terminal,
    plan_step,
    same_step_resets,
    seeds_of,
    take_reset_mask,
)

SCRIPTS: list[list[tuple[int, str]]] = [
    [(2, "terminated"), (3, "truncated")],
    [(1, "truncated"), (4, "terminated"), (2, "terminated")],
    [(3, "terminated"), (2, "both")],
    [(2, "truncated"), (1, "terminated")],
]
"""Per lane, its episodes in turn (repeating): how many steps, and how each ends
(``both``: terminated and truncated at once). Lanes finish alone and together, on
consecutive steps and right after a reset."""

STEPS = 14


class Scripted(gym.Env[np.ndarray, np.int64]):
    """Ends its episodes by :data:`SCRIPTS`; every observation, reward and info says
    which lane, episode, step and action made it, so a mixed-up lane shows."""

    observation_space = spaces.Box(-1e6, 1e6, (3,), np.float64)
    action_space = spaces.Discrete(3)

    def __init__(self, lane: int) -> None:
        self.lane = lane
        self.script = SCRIPTS[lane]
        self.episode = -1
        self.t = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.lane, self.episode, self.t], dtype=np.float64)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        return self._obs(), {"episode": self.episode, "seed": -1 if seed is None else seed}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        length, end = self.script[self.episode % len(self.script)]
        over = self.t >= length
        reward = float(10 * self.t + int(action))
        info = {"t": self.t, "action": int(action), "lane": {"n": self.lane}}
        terminated = over and end in ("terminated", "both")
        truncated = over and end in ("truncated", "both")
        return self._obs(), reward, terminated, truncated, info


class LocalLanes:
    """``VectorEnv``'s reset and step with each request a direct call on local envs:
    the same plan and folds, the same order of calls."""

    def __init__(self, mode: AutoresetMode, add_info: AddInfo) -> None:
        self.envs = [Scripted(lane) for lane in range(len(SCRIPTS))]
        self.mode = mode
        self.add_info = add_info
        self.lanes = VectorLanes(len(self.envs))

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        n = len(self.envs)
        seeds = seeds_of(seed, n)
        mask = take_reset_mask(options, n)
        lanes = range(n) if mask is None else [i for i in range(n) if mask[i]]
        results = {i: self.envs[i].reset(seed=seeds[i], options=options) for i in lanes}
        infos = fold_reset(self.lanes, results, mask, self.add_info)
        return np.stack(self.lanes.obs), infos

    def step(self, actions: np.ndarray) -> tuple[Any, ...]:
        plan = plan_step(self.mode, self.lanes.done)
        stepped = {i: self.envs[i].step(actions[i]) for i in plan.step_lanes}
        reset = {i: self.envs[i].reset() for i in plan.reset_lanes}
        done = same_step_resets(self.mode, plan, stepped)
        finished = {i: self.envs[i].reset() for i in done}
        infos = fold_step(self.lanes, stepped, reset, finished, self.add_info)
        lanes = self.lanes
        return (
            np.stack(lanes.obs),
            np.copy(lanes.rewards),
            np.copy(lanes.terminations),
            np.copy(lanes.truncations),
            infos,
        )


def assert_same(ours: Any, theirs: Any, where: str = "") -> None:
    """Equal values of equal types, into tuples, dicts and object arrays (``final_obs``)."""
    if isinstance(theirs, tuple):
        assert isinstance(ours, tuple), where
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict), where
        assert sorted(ours) == sorted(theirs), where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}[{key!r}]")
    elif isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), where
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), where
        if theirs.dtype == object:
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                assert_same(a, b, f"{where}[{i}]")
        else:
            np.testing.assert_array_equal(ours, theirs, err_msg=where)
    else:
        assert type(ours) is type(theirs), where
        assert ours == theirs, where


def actions_at(step: int) -> np.ndarray:
    return np.array([(step + lane) % 3 for lane in range(len(SCRIPTS))], dtype=np.int64)


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_the_plan_and_fold_step_as_sync_vector_env_does(mode: AutoresetMode) -> None:
    reference = SyncVectorEnv(
        [lambda lane=lane: Scripted(lane) for lane in range(len(SCRIPTS))], autoreset_mode=mode
    )
    ours = LocalLanes(mode, reference._add_info)
    assert_same(ours.reset(seed=7), reference.reset(seed=7), "reset")
    finals = 0
    for step in range(STEPS):
        theirs = reference.step(actions_at(step))
        assert_same(ours.step(actions_at(step)), theirs, f"step {step}")
        finals += int(np.count_nonzero(theirs[2] | theirs[3]))
    assert finals >= 8  # the script ended episodes, alone and together
    reference.close()


def test_the_plan_and_fold_disabled_as_sync_vector_env_does() -> None:
    """DISABLED: the caller resets the finished lanes with a mask; a step before that is
    refused (where ``SyncVectorEnv`` asserts), naming the lanes it would assert on."""
    mode = AutoresetMode.DISABLED
    reference = SyncVectorEnv(
        [lambda lane=lane: Scripted(lane) for lane in range(len(SCRIPTS))], autoreset_mode=mode
    )
    ours = LocalLanes(mode, reference._add_info)
    assert_same(ours.reset(seed=3), reference.reset(seed=3), "reset")
    masked = 0
    for step in range(STEPS):
        theirs = reference.step(actions_at(step))
        assert_same(ours.step(actions_at(step)), theirs, f"step {step}")
        done = theirs[2] | theirs[3]
        if done.any():
            with pytest.raises(ValueError, match=r"autoreset is DISABLED: reset them first"):
                ours.step(actions_at(step))
            # the lanes SyncVectorEnv would assert on (it asserts lane by lane, after
            # stepping the lanes before the first finished one: not called here)
            np.testing.assert_array_equal(ours.lanes.done, reference._autoreset_envs)
            assert_same(
                ours.reset(options={"reset_mask": done.copy()}),
                reference.reset(options={"reset_mask": done.copy()}),
                f"reset_mask after step {step}",
            )
            masked += 1
    assert masked >= 4
    reference.close()


@pytest.mark.parametrize(
    ("mode", "done", "plan"),
    [
        (AutoresetMode.NEXT_STEP, [False, False, False], StepPlan([0, 1, 2], [])),
        (AutoresetMode.NEXT_STEP, [False, True, False], StepPlan([0, 2], [1])),
        (AutoresetMode.NEXT_STEP, [True, True, True], StepPlan([], [0, 1, 2])),
        (AutoresetMode.SAME_STEP, [True, False, True], StepPlan([0, 1, 2], [])),
        (AutoresetMode.DISABLED, [False, False, False], StepPlan([0, 1, 2], [])),
    ],
)
def test_the_plan_as_a_table(mode: AutoresetMode, done: list[bool], plan: StepPlan) -> None:
    assert plan_step(mode, np.array(done)) == plan


def test_disabled_refuses_a_step_over_finished_lanes_by_name() -> None:
    with pytest.raises(ValueError, match=r"^lanes \[0, 2\] finished their episodes"):
        plan_step(AutoresetMode.DISABLED, np.array([True, False, True]))


def test_same_step_resets_only_finished_lanes_and_only_in_its_mode() -> None:
    plan = StepPlan([0, 1, 2], [])
    obs = np.zeros(1)
    stepped = {
        0: (obs, 1.0, True, False, {}),
        1: (obs, 1.0, False, False, {}),
        2: (obs, 1.0, False, True, {}),
    }
    assert same_step_resets(AutoresetMode.SAME_STEP, plan, stepped) == [0, 2]
    assert same_step_resets(AutoresetMode.NEXT_STEP, plan, stepped) == []
    assert same_step_resets(AutoresetMode.DISABLED, plan, stepped) == []


def test_the_lanes_are_never_reset_until_a_reset_folds_them() -> None:
    lanes = VectorLanes(3)
    assert lanes.never_reset() == [0, 1, 2]
    fold_reset(lanes, {1: (np.zeros(1), {})}, np.array([False, True, False]), lambda a, b, i: a)
    assert lanes.never_reset() == [0, 2]


def test_the_same_step_reset_and_fold_terminal_as_dummy_vec_env_does() -> None:
    """``RemoteVecEnv.step_wait``'s moves (``sb3.py``: NEXT_STEP's plan over the lanes
    whose reset failed, none here; SAME_STEP's resets; :func:`fold_terminal`) over local
    envs, each step held to SB3's ``DummyVecEnv``: observations, rewards, dones, infos
    with ``terminal_observation`` and ``TimeLimit.truncated``, and ``reset_infos``."""
    vec_env = pytest.importorskip("stable_baselines3.common.vec_env")
    n = len(SCRIPTS)
    reference = vec_env.DummyVecEnv([lambda lane=lane: Scripted(lane) for lane in range(n)])
    reference.seed(7)
    envs = [Scripted(lane) for lane in range(n)]
    obs = np.zeros((n, 3), dtype=np.float64)
    rewards = np.zeros((n,), dtype=np.float32)
    dones = np.zeros((n,), dtype=bool)
    reset_infos: list[dict[str, Any]] = [{} for _ in range(n)]
    for i in range(n):
        obs[i], reset_infos[i] = envs[i].reset(seed=7 + i)
    assert_same(obs.copy(), reference.reset(), "reset")
    assert_same(tuple(reset_infos), tuple(reference.reset_infos), "reset_infos")

    def save_obs(lane: int, lane_obs: Any) -> None:
        obs[lane] = lane_obs

    finals = 0
    for step in range(STEPS):
        actions = actions_at(step)
        plan = plan_step(AutoresetMode.NEXT_STEP, np.zeros((n,), dtype=np.bool_))
        stepped = {i: envs[i].step(actions[i]) for i in plan.step_lanes}
        done = same_step_resets(AutoresetMode.SAME_STEP, plan, stepped)
        finished = {i: envs[i].reset() for i in done}
        infos = fold_terminal(stepped, finished, rewards, dones, reset_infos, save_obs)
        theirs = reference.step(actions)
        assert_same(
            (obs.copy(), rewards.copy(), dones.copy(), tuple(infos)),
            (theirs[0], theirs[1], theirs[2], tuple(theirs[3])),
            f"step {step}",
        )
        assert_same(tuple(reset_infos), tuple(reference.reset_infos), f"reset_infos {step}")
        finals += len(done)
    assert finals >= 8
    reference.close()
