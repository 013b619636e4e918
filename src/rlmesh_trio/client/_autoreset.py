"""gymnasium's autoreset, done by the client (sans-IO): what :class:`VectorEnv` asks of
its lanes and how their answers become a step's result.

A whole-vector ``step()`` is three moves. :func:`plan_step` decides from the autoreset
mode and the lanes that finished last time which lanes step and which reset (NEXT_STEP:
a finished lane resets in place of its step; SAME_STEP: every lane steps, and
:func:`same_step_resets` names the ones to reset right after; DISABLED: a finished lane
must have been reset by ``reset(options={"reset_mask": ...})``, else the step is
refused). The request goes out and comes back (``_gym.py``). :func:`fold_step` writes
the answers into the :class:`VectorLanes` and builds the step's infos
(``final_obs``/``final_info`` under SAME_STEP), as ``SyncVectorEnv.step`` does lane by
lane; :func:`fold_reset` does the same for ``reset()``.

Stable-Baselines3's ``RemoteVecEnv`` (``sb3.py``) is built on the same moves: its
same-step reset is SAME_STEP's (:func:`same_step_resets`), a lane whose reset failed is
reset in place of its next step as NEXT_STEP resets a finished lane (:func:`plan_step`),
and :func:`fold_terminal` folds the answers as ``DummyVecEnv.step_wait`` does, the last
observation in ``info["terminal_observation"]``. Nothing here does IO, so
``tests/test_client_autoreset.py`` runs the plans and the folds over local envs and holds
them to ``SyncVectorEnv`` in each mode (and to SB3's ``DummyVecEnv``), without a server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from ._codecs import expand_seeds

__all__ = [
    "AddInfo",
    "LaneReset",
    "LaneStep",
    "StepPlan",
    "VectorLanes",
    "fold_reset",
    "fold_step",
    "fold_terminal",
    "plan_step",
    "same_step_resets",
    "seeds_of",
    "take_reset_mask",
]

LaneStep = tuple[Any, float, bool, bool, dict[str, Any]]
"""One lane's step: observation, reward, terminated, truncated, info."""

LaneReset = tuple[Any, dict[str, Any]]
"""One lane's reset: observation, info."""

AddInfo = Callable[[dict[str, Any], dict[str, Any], int], dict[str, Any]]
"""``gymnasium.vector.VectorEnv._add_info``: one lane's info into the batch's."""


class VectorLanes:
    """Each lane's state between steps, as ``SyncVectorEnv`` keeps it: the latest
    observation (None: never reset by this client), reward and flags, and ``done`` (the
    lane finished an episode: ``SyncVectorEnv``'s ``_autoreset_envs``).

    It is also the lane pool's book (``_pool.Book``: ``done`` and ``obs``), so
    ``step()`` and ``send()`` agree on which lanes finished."""

    def __init__(self, num_envs: int) -> None:
        self.obs: list[Any] = [None] * num_envs
        self.rewards: np.ndarray[Any, Any] = np.zeros((num_envs,), dtype=np.float64)
        self.terminations: np.ndarray[Any, Any] = np.zeros((num_envs,), dtype=np.bool_)
        self.truncations: np.ndarray[Any, Any] = np.zeros((num_envs,), dtype=np.bool_)
        self.done: np.ndarray[Any, Any] = np.zeros((num_envs,), dtype=np.bool_)

    def never_reset(self) -> list[int]:
        """The lanes this client has not reset yet (a step would have no observation)."""
        return [i for i, obs in enumerate(self.obs) if obs is None]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one whole-vector step asks: ``step_lanes`` step with their actions,
    ``reset_lanes`` (NEXT_STEP's finished lanes) reset instead. Both in lane order; every
    lane is in exactly one."""

    step_lanes: list[int]
    reset_lanes: list[int]


def plan_step(mode: AutoresetMode, done: np.ndarray[Any, Any]) -> StepPlan:
    """The lanes a step steps and resets, from the lanes that finished (``done``).

    Raises ``ValueError`` under DISABLED when a lane finished and was not reset (where
    ``SyncVectorEnv`` asserts)."""
    n = len(done)
    if not done.any():
        return StepPlan(list(range(n)), [])  # every mode: all lanes step
    if mode == AutoresetMode.NEXT_STEP:
        reset_lanes = [i for i in range(n) if done[i]]
        if not reset_lanes:
            return StepPlan(list(range(n)), [])
        resetting = set(reset_lanes)
        return StepPlan([i for i in range(n) if i not in resetting], reset_lanes)
    if mode == AutoresetMode.DISABLED and done.any():
        finished = [i for i in range(n) if done[i]]
        raise ValueError(
            f"lanes {finished} finished their episodes and autoreset is DISABLED: reset them "
            "first with reset(options={'reset_mask': mask})"
        )
    return StepPlan(list(range(n)), [])


def same_step_resets(
    mode: AutoresetMode, plan: StepPlan, stepped: dict[int, LaneStep]
) -> list[int]:
    """SAME_STEP: the stepped lanes that finished, to reset before the step returns (their
    final observation and info go in the step's infos). Other modes: none."""
    if mode != AutoresetMode.SAME_STEP:
        return []
    return [i for i in plan.step_lanes if stepped[i][2] or stepped[i][3]]


def fold_step(
    lanes: VectorLanes,
    stepped: dict[int, LaneStep],
    reset: dict[int, LaneReset],
    finished: dict[int, LaneReset],
    add_info: AddInfo,
) -> dict[str, Any]:
    """A step's answers into ``lanes``; returns the step's infos.

    ``stepped``: the lanes that stepped (or that count as stepped: a faulted lane,
    truncated on its last observation); ``reset``: the lanes reset in place of a step
    (reward 0, not done); ``finished``: SAME_STEP's resets after a lane's last step (its
    final observation and info become ``final_obs``/``final_info``). Every lane is in
    ``stepped`` or ``reset``."""
    infos: dict[str, Any] = {}
    for i in range(len(lanes.obs)):
        if i in reset:
            lanes.obs[i], info = reset[i]
            lanes.rewards[i] = 0.0
            lanes.terminations[i] = False
            lanes.truncations[i] = False
        else:
            obs, reward, term, trunc, info = stepped[i]
            lanes.obs[i] = obs
            lanes.rewards[i], lanes.terminations[i], lanes.truncations[i] = reward, term, trunc
            if i in finished:
                infos = add_info(infos, {"final_obs": obs, "final_info": info}, i)
                lanes.obs[i], info = finished[i]
        infos = add_info(infos, info, i)
    lanes.done = np.logical_or(lanes.terminations, lanes.truncations)
    return infos


def fold_terminal(
    stepped: dict[int, LaneStep],
    finished: dict[int, LaneReset],
    rewards: np.ndarray[Any, Any],
    dones: np.ndarray[Any, Any],
    reset_infos: list[dict[str, Any]],
    save_obs: Callable[[int, Any], None],
) -> list[dict[str, Any]]:
    """A step's answers folded as Stable-Baselines3's ``DummyVecEnv.step_wait`` folds
    its envs' (a same-step reset): into the VecEnv's ``rewards`` and ``dones`` buffers,
    each lane's observation handed to ``save_obs(lane, obs)``; returns each lane's info.

    ``stepped``: every lane's step (or what counts as one: a faulted lane, or a lane
    whose reset failed, truncated on its last observation); ``finished``: the resets of
    the lanes that finished (:func:`same_step_resets`). A finished lane's info gets its
    last observation as ``terminal_observation``; when its reset answered, its
    observation is the next episode's first and its reset info goes to
    ``reset_infos``. ``TimeLimit.truncated`` is set on every lane's info."""
    infos: list[dict[str, Any]] = []
    for i in range(len(rewards)):
        obs, reward, terminated, truncated, info = stepped[i]
        rewards[i] = reward
        dones[i] = terminated or truncated
        info["TimeLimit.truncated"] = truncated and not terminated
        if dones[i]:
            info["terminal_observation"] = obs
            if i in finished:
                obs, reset_infos[i] = finished[i]
        infos.append(info)
        save_obs(i, obs)
    return infos


def fold_reset(
    lanes: VectorLanes,
    reset: dict[int, LaneReset],
    mask: np.ndarray[Any, Any] | None,
    add_info: AddInfo,
) -> dict[str, Any]:
    """A reset's answers into ``lanes`` (every lane, or those of ``mask``); returns the
    reset's infos. Rewards stay as they were, as ``SyncVectorEnv.reset`` leaves them."""
    if mask is None:
        n = len(lanes.obs)
        lanes.terminations = np.zeros((n,), dtype=np.bool_)
        lanes.truncations = np.zeros((n,), dtype=np.bool_)
        lanes.done = np.zeros((n,), dtype=np.bool_)
    else:
        lanes.terminations[mask] = False
        lanes.truncations[mask] = False
        lanes.done[mask] = False
    infos: dict[str, Any] = {}
    for i in sorted(reset):
        lanes.obs[i], info = reset[i]
        infos = add_info(infos, info, i)
    return infos


def seeds_of(seed: int | Sequence[int | None] | None, n: int) -> list[int | None]:
    """``reset(seed=...)``'s seeds, one per lane, by ``SyncVectorEnv``'s rules (an int:
    lane ``i`` gets ``seed + i``)."""
    return expand_seeds(seed, range(n), _gymnasium_mismatch)


def _gymnasium_mismatch(got: int, want: int) -> str:
    return (
        f"If seeds are passed as a list the length must match num_envs={want} but got length={got}."
    )


def take_reset_mask(options: dict[str, Any] | None, n: int) -> np.ndarray[Any, Any] | None:
    """``options["reset_mask"]`` taken out of ``options`` and checked with
    ``SyncVectorEnv``'s texts; None when there is none."""
    if options is None or "reset_mask" not in options:
        return None
    mask = options.pop("reset_mask")
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
    if mask.shape != (n,):
        raise ValueError(f"`options['reset_mask']` must have shape `({n},)`, got {mask.shape}")
    if mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
    if not np.any(mask):
        raise ValueError(
            "`options['reset_mask']` must contain a boolean array with at least one True value, "
            f"got reset_mask={mask}"
        )
    return mask
