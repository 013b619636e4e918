"""What the replies to a :class:`~rlmesh_trio.client.VectorEnv` step or reset say, read
into the autoreset fold's terms (:mod:`._autoreset`).

Two readings of the same replies. :func:`fold_arrays` is the common case of a step whose
observation is one fixed-width leaf: the replies' arrays go straight into the lanes'
state, with nothing built per lane where nothing is needed (no object at all for lanes
whose infos are empty). Everything else -- a crashed lane, a lane that finished under
SAME_STEP, structured observations -- reads each lane's answer (:func:`step_answers`,
:func:`per_lane_reset`) for :func:`~._autoreset.fold_step`. No IO: the request itself is
``_gym.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from ._autoreset import AddInfo, LaneReset, LaneStep, StepPlan, VectorLanes
from ._codecs import Codecs, lane_infos, step_arrays
from ._errors import LANE_FAULT_KEY, EndpointError, EnvError
from ._messages import Reply

__all__ = [
    "StepResult",
    "crashed",
    "fold_arrays",
    "per_lane_reset",
    "per_lane_step",
    "step_answers",
]

StepResult = tuple[
    Any, np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], dict[str, Any]
]
"""What ``VectorEnv.step`` returns: observations, rewards, terminations, truncations, infos."""


def fold_arrays(
    lanes: VectorLanes,
    codecs: Codecs,
    mode: AutoresetMode,
    plan: StepPlan,
    answers: Sequence[Reply | EndpointError],
    add_info: AddInfo,
) -> StepResult | None:
    """A step's replies folded straight from their arrays into ``lanes`` (what
    :func:`~._autoreset.fold_step` does lane by lane); the step's result. None (nothing
    folded) when the observation is not one fixed-width leaf, when a lane crashed, or
    when a lane finished under SAME_STEP (it resets before the step returns): the
    general fold does those."""
    fast = codecs.fast_observation
    if fast is None:
        return None
    step_lanes, reset_lanes = plan.step_lanes, plan.reset_lanes
    step = answers[0] if step_lanes else None
    reset = answers[-1] if reset_lanes else None
    if isinstance(step, EndpointError) or isinstance(reset, EndpointError):
        return None
    n = len(lanes.obs)
    if reset is None:
        assert step is not None
        rewards, terminated, truncated = step_arrays(step, n)
        done = terminated | truncated
        if mode == AutoresetMode.SAME_STEP and done.any():
            return None
        observations = fast.decode(step.leaves, n)
    else:  # NEXT_STEP: the finished lanes reset in place of their step
        observations = np.empty((n, *fast.shape), dtype=fast.out)
        rewards = np.zeros((n,), dtype=np.float64)
        terminated = np.zeros((n,), dtype=np.bool_)
        truncated = np.zeros((n,), dtype=np.bool_)
        if step is not None:
            k = len(step_lanes)
            rows = step_arrays(step, k)
            observations[step_lanes] = fast.decode(step.leaves, k)
            rewards[step_lanes], terminated[step_lanes], truncated[step_lanes] = rows
        observations[reset_lanes] = fast.decode(reset.leaves, len(reset_lanes))
        done = terminated | truncated
    infos: dict[str, Any] = {}
    step_infos = _infos_of(step, len(step_lanes))
    reset_infos = _infos_of(reset, len(reset_lanes))
    if step_infos or reset_infos:
        by_lane: dict[int, dict[str, Any]] = {}
        by_lane.update(zip(step_lanes, step_infos or (), strict=False))
        by_lane.update(zip(reset_lanes, reset_infos or (), strict=False))
        for i in sorted(by_lane):
            infos = add_info(infos, by_lane[i], i)
    lanes.obs[:] = list(observations)
    lanes.rewards, lanes.terminations, lanes.truncations = rewards, terminated, truncated
    lanes.done = done
    return observations.copy(), rewards.copy(), terminated.copy(), truncated.copy(), infos


def step_answers(
    lanes: VectorLanes,
    codecs: Codecs,
    plan: StepPlan,
    answers: Sequence[Reply | EndpointError],
) -> tuple[dict[int, LaneStep], dict[int, LaneReset]]:
    """Each lane's answer to a step's round trip (a step of ``plan.step_lanes``, then a
    reset of ``plan.reset_lanes``). A faulted lane (rlmesh-trio under ``--on-lane-fault
    rebuild/truncate``) counts as stepped: truncated on its last observation."""
    step_lanes, reset_lanes = plan.step_lanes, plan.reset_lanes
    stepped: dict[int, LaneStep] = {}
    step_answer = answers[0] if step_lanes else None
    if isinstance(step_answer, EnvError):
        # Every lane of the request ends its episode truncated on its last observation
        # (the others' results were dropped with the request); the next step resets them.
        stepped.update(crashed(lanes.obs.__getitem__, step_lanes, step_answer))
    elif isinstance(step_answer, Reply):
        stepped.update(per_lane_step(codecs, step_lanes, step_answer))
    reset: dict[int, LaneReset] = {}
    reset_answer = answers[-1] if reset_lanes else None
    if isinstance(reset_answer, EnvError):
        # The autoreset of a lane that faulted: still done, tried again next step.
        stepped.update(crashed(lanes.obs.__getitem__, reset_lanes, reset_answer))
    elif isinstance(reset_answer, Reply):
        reset = per_lane_reset(codecs, reset_lanes, reset_answer)
    return stepped, reset


def per_lane_reset(codecs: Codecs, lanes: list[int], reply: Reply) -> dict[int, LaneReset]:
    """Each of ``lanes``' observation and info from a reset's reply."""
    k = len(lanes)
    observations = codecs.observations(reply.leaves, k)
    infos = lane_infos(reply.infos, k)
    return {lane: (observations[j], infos[j]) for j, lane in enumerate(lanes)}


def per_lane_step(codecs: Codecs, lanes: list[int], reply: Reply) -> dict[int, LaneStep]:
    """Each of ``lanes``' observation, reward, flags and info from a step's reply."""
    k = len(lanes)
    rewards, terminated, truncated = step_arrays(reply, k)
    observations = codecs.observations(reply.leaves, k)
    infos = lane_infos(reply.infos, k)
    return {
        lane: (
            observations[j],
            float(rewards[j]),
            bool(terminated[j]),
            bool(truncated[j]),
            infos[j],
        )
        for j, lane in enumerate(lanes)
    }


def crashed(
    last_obs: Callable[[int], Any], which: Sequence[int], error: EnvError
) -> dict[int, LaneStep]:
    """A request for ``which`` answered CRASHED: each lane truncated on its last
    observation (``last_obs(lane)``), reward 0; the faulted lanes' info carries
    ``rlmesh_trio.lane_fault``."""
    faults = {fault["lane"]: fault for fault in error.lane_faults}
    out: dict[int, LaneStep] = {}
    for lane in which:
        info: dict[str, Any] = {}
        if lane in faults:
            info[LANE_FAULT_KEY] = faults[lane]
        out[lane] = (last_obs(lane), 0.0, False, True, info)
    return out


def _infos_of(reply: Reply | None, k: int) -> list[dict[str, Any]] | None:
    """Each of the ``k`` lanes' infos of ``reply``; None when there is none or every
    lane's is empty (nothing to add)."""
    if reply is None or reply.empty_lane_infos or (k == 1 and not reply.infos):
        return None
    return lane_infos(reply.infos, k)
