"""One endpoint's share of a :class:`~rlmesh_trio.client.VectorEnv`: its connection, its
lanes' state (``SyncVectorEnv``'s, lane by lane) and the round trips its lanes' share of a
reset or a step takes, as :data:`._rounds.Rounds` (the vector drives them, alone or beside
the other endpoints'). :class:`InfoCalls` records a share's infos for the vector to replay
in lane order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from ._answers import StepResult, fold_arrays, per_lane_reset, step_answers
from ._autoreset import (
    AddInfo,
    LaneReset,
    StepPlan,
    VectorLanes,
    fold_reset,
    fold_step,
    plan_step,
    same_step_resets,
)
from ._blocking import BlockingEndpoint
from ._codecs import decode_frame
from ._core import JoinStream
from ._errors import EndpointError, EnvError
from ._joining import lane_endpoint
from ._messages import Episode, render_builder
from ._pool import BlockingPool
from ._rounds import Request, Rounds, raise_fatal

__all__ = ["InfoCalls", "Part"]


class InfoCalls:
    """An ``add_info`` that records its calls (lane, info) for the VectorEnv to replay
    with its own ``_add_info``, lanes moved by the part's offset: the same calls in the
    same order as ``SyncVectorEnv`` makes them over the whole vector."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, Any]]] = []

    def __call__(self, infos: dict[str, Any], info: dict[str, Any], lane: int) -> dict[str, Any]:
        self.calls.append((lane, info))
        return infos


class Part:
    """One endpoint's lanes in a :class:`VectorEnv`: its connection, its lanes' state
    (``SyncVectorEnv``'s, lane by lane) and the rounds of requests its lanes' share of a
    reset or a step takes. ``offset``: its first lane's index in the vector."""

    def __init__(
        self,
        address: str,
        ep: BlockingEndpoint,
        offset: int,
        mode: AutoresetMode,
        timeout_ms: int,
        batch_size: int | None,
    ) -> None:
        self.address = address
        self.ep = ep
        self.offset = offset
        self.mode = mode
        self.timeout_ms = timeout_ms
        self.state: JoinStream = ep.state
        self.contract = contract = lane_endpoint(address, ep, "VectorEnv")
        self.num_envs = contract.num_envs
        self.lanes = VectorLanes(self.num_envs)
        # The lanes are the pool's book too; they hold no reference back to the env.
        self.pool = BlockingPool(ep, self.lanes, batch_size=batch_size, autoreset_mode=mode)

    @property
    def name(self) -> str:
        last = self.offset + self.num_envs - 1
        lanes = f"lane {last}" if last == self.offset else f"lanes {self.offset}..{last}"
        return f"the endpoint at {self.address} ({lanes} of the vector)"

    # ---- rounds -----------------------------------------------------------------------

    def resets(
        self, lanes: Sequence[int], seeds: Sequence[int | None], options: dict[str, Any] | None
    ) -> Rounds[dict[int, LaneReset]]:
        """Lane-scoped resets of ``lanes`` (one request for the seeded lanes, one for the
        unseeded), sent together; each lane's observation and info."""
        seeded = [(lane, s) for lane, s in zip(lanes, seeds, strict=True) if s is not None]
        unseeded = [lane for lane, s in zip(lanes, seeds, strict=True) if s is None]
        groups: list[tuple[list[int], list[int]]] = []
        if seeded:
            groups.append(([lane for lane, _ in seeded], [int(s) for _, s in seeded]))
        if unseeded:
            groups.append((unseeded, []))
        if not groups:
            return {}
        # All lanes alike: one whole-vector reset; else lane-scoped ones, sent together.
        everyone = len(groups) == 1 and groups[0][0] == list(range(self.num_envs))
        request = Request()
        for group, group_seeds in groups:
            request.reset(
                group, self.timeout_ms, whole=everyone, seeds=group_seeds, options=options
            )
        answers = yield request
        out: dict[int, LaneReset] = {}
        for (group, _), answer in zip(groups, answers, strict=True):
            if isinstance(answer, EndpointError):
                raise answer
            out.update(per_lane_reset(self.state.codecs, group, answer))
        return out

    def reset(
        self,
        seeds: Sequence[int | None],
        options: dict[str, Any] | None,
        mask: np.ndarray[Any, Any] | None,
        add_info: AddInfo,
    ) -> Rounds[dict[str, Any]]:
        """This part's share of ``reset()``: its ``seeds`` and ``mask`` (None: every lane)."""
        n = self.num_envs
        lanes = list(range(n)) if mask is None else [i for i in range(n) if mask[i]]
        results = yield from self.resets(lanes, [seeds[i] for i in lanes], options)
        return fold_reset(self.lanes, results, mask, add_info)

    def step(self, actions: Any, rows: list[Any] | None, add_info: AddInfo) -> Rounds[StepResult]:
        """This part's share of ``step()``: ``actions`` its lanes' batch (used when
        ``rows`` is None), else ``rows`` one action per lane."""
        plan = plan_step(self.mode, self.lanes.done)
        answers = yield self._step_request(plan, actions, rows)
        raise_fatal(answers)
        lanes, codecs = self.lanes, self.state.codecs
        folded = fold_arrays(lanes, codecs, self.mode, plan, answers, add_info)
        if folded is not None:
            return folded
        stepped, reset = step_answers(lanes, codecs, plan, answers)
        done = same_step_resets(self.mode, plan, stepped)
        finished = (yield from self.resets(done, [None] * len(done), None)) if done else {}
        infos = fold_step(lanes, stepped, reset, finished, add_info)
        return (
            codecs.batch(lanes.obs),
            np.copy(lanes.rewards),
            np.copy(lanes.terminations),
            np.copy(lanes.truncations),
            infos,
        )

    def _step_request(self, plan: StepPlan, actions: Any, rows: list[Any] | None) -> Request:
        """The step's one round trip: a step of ``plan.step_lanes`` (whole-vector when
        every lane steps: the same on a lane endpoint, and the form every server handles
        fastest) beside a lane-scoped reset of ``plan.reset_lanes``."""
        step_lanes, reset_lanes = plan.step_lanes, plan.reset_lanes
        codecs = self.state.codecs
        request = Request()
        if step_lanes:
            whole = len(step_lanes) == self.num_envs
            if rows is None:
                subset = actions if whole else actions[step_lanes]
                leaves = codecs.encode_actions(subset, len(step_lanes))
            else:
                leaves = codecs.encode_actions_rows([rows[i] for i in step_lanes])
            request.step(leaves, step_lanes, self.timeout_ms, whole=whole)
        if reset_lanes:
            request.reset(reset_lanes, self.timeout_ms, whole=False)
        return request

    def render(self) -> list[Any]:
        """Each lane's frame; None for a lane the server cannot render."""
        frames: list[Any] = []
        for lane in range(self.num_envs):
            try:
                reply = self.ep.roundtrip(
                    [partial(render_builder, lane=lane)], ["render"], lanes=[[lane]]
                )[0]
            except EnvError as exc:
                if not exc.is_recoverable:
                    raise
                frames.append(None)
                continue
            frames.append(decode_frame(reply))
        return frames

    def close(self) -> list[Episode]:
        """Close the session; the episodes it reported, their lanes the vector's."""
        return [
            replace(episode, env_index=episode.env_index + self.offset)
            for episode in self.ep.close()
        ]
