"""What a session sends: a reset's or a step's JoinResponse built from its lanes' results
(observation slab, infos batched in gymnasium's layout, conformance warnings placed once,
completed episodes), the timing stamps, error replies and their reports (SPEC §5, §7.5,
§8). Sans-IO."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._codec import Candidate
from .._jobs import LaneReply, Phases, RenderResult, ResetResult, StepResult
from .._proto.rlmesh.env import v1 as env_v1
from .._proto.rlmesh.spaces import v1 as spaces_v1
from ._actions import Action, Report, Send
from ._endpoint import Endpoint
from ._episodes import EpisodeBook
from ._ops import Op
from ._results import CONFORMANCE_KEY, batch_infos, fold_phases, warning_value

__all__ = ["Replies"]


class Replies:
    """Builds one session's replies; holds the endpoint (contract, conformance ledger)
    and the session's clock."""

    __slots__ = ("_clock_ns", "_endpoint")

    def __init__(self, endpoint: Endpoint, clock_ns: Callable[[], int]) -> None:
        self._endpoint = endpoint
        self._clock_ns = clock_ns

    def place_warnings(
        self, op: Op, results: Sequence[ResetResult | StepResult]
    ) -> tuple[list[spaces_v1.MetaMap | None], list[Candidate]]:
        """Put conformance entries into the lane maps; return the maps and the list N."""
        candidates = []
        for result in results:
            cands = []
            if isinstance(result, StepResult) and result.action_warning is not None:
                cands.append(result.action_warning)
            if result.obs_warning is not None:
                cands.append(result.obs_warning)
            candidates.append(cands)
        maps = [result.info for result in results]
        if not any(candidates):
            return maps, []
        survivors, fresh = self._endpoint.ledger.place(op.lanes, candidates)
        for pos, kept in enumerate(survivors):
            if kept:
                maps[pos] = _with_warning(maps[pos], kept)
        if fresh and len(maps) == 1:
            maps[0] = _with_warning(maps[0], fresh)
        return maps, fresh

    def infos(
        self,
        maps: list[spaces_v1.MetaMap | None],
        fresh: list[Candidate],
        done: Sequence[bool] | None,
    ) -> spaces_v1.MetaMap | None:
        if len(maps) == 1:
            return maps[0]
        infos = batch_infos(maps, done)
        if fresh:
            if infos is None:
                infos = spaces_v1.MetaMap()
            infos.entries[CONFORMANCE_KEY] = warning_value(fresh)
        return infos

    def observation(self, results: Sequence[ResetResult | StepResult]) -> list[bytes]:
        """The lanes' one-lane observation leaves as one k-lane value, in reply order."""
        if len(results) == 1:
            return results[0].observation
        return self._endpoint.contract.observation_codec.join([r.observation for r in results])

    def completed(
        self, op: Op, replies: list[LaneReply], book: EpisodeBook
    ) -> tuple[env_v1.JoinResponse, Phases]:
        """The reply to ``op`` whose lanes all answered without an error (``replies``, in
        the op's order), and its folded phases; a step's takes the ``book``'s interrupted
        episodes."""
        results = [r.outcome.unwrap() for r in replies]
        phases, skew = fold_phases([r.phases for r in replies])
        if op.verb == "render":
            return self.render_response(op, results[0], phases), phases
        if op.verb == "reset":
            return self.reset_response(op, results, phases, skew), phases
        interrupted = book.take_interrupted()
        return self.step_response(op, results, phases, skew, interrupted), phases

    def configured(self, rid: str, read_ns: int) -> env_v1.JoinResponse:
        """The reply to a configure this build implements."""
        return env_v1.JoinResponse(
            request_id=rid,
            configure=env_v1.ConfigureEnvResponse(),
            endpoint_total_ns=self.elapsed(read_ns),
        )

    def closed(
        self, rid: str, read_ns: int, final: list[env_v1.EpisodeMetadata]
    ) -> env_v1.JoinResponse:
        """The reply to a Close: the book's ``final`` episodes (SPEC §7.8)."""
        return env_v1.JoinResponse(
            request_id=rid,
            close=env_v1.CloseEnvsResponse(final_episodes=final),
            endpoint_total_ns=self.elapsed(read_ns),
        )

    def reset_response(
        self, op: Op, results: Sequence[Any], phases: Phases, skew: int | None
    ) -> env_v1.JoinResponse:
        observation = self.observation(results)
        maps, fresh = self.place_warnings(op, results)
        body = env_v1.ResetResponse(
            observation=spaces_v1.SpaceValue(leaves=observation),
            infos=self.infos(maps, fresh, None),
        )
        response = env_v1.JoinResponse(request_id=op.request_id, reset=body)
        self.stamp(response, op, phases, skew, decode=True)
        return response

    def step_response(
        self,
        op: Op,
        results: Sequence[Any],
        phases: Phases,
        skew: int | None,
        interrupted: list[env_v1.EpisodeMetadata],
    ) -> env_v1.JoinResponse:
        """The reply to a step; ``interrupted`` (the book's episodes lost to a reset or a
        rebuild, taken for this reply) opens its completed episodes, and this list."""
        observation = self.observation(results)
        terminated = [bool(r.terminated) for r in results]
        truncated = [bool(r.truncated) for r in results]
        maps, fresh = self.place_warnings(op, results)
        done = [t or u for t, u in zip(terminated, truncated, strict=True)]
        completed = interrupted
        for pos in sorted(op.completions):
            completed.append(op.completions[pos].record(maps[pos]))
        body = env_v1.StepResponse(
            observation=spaces_v1.SpaceValue(leaves=observation),
            rewards=[float(r.reward) for r in results],
            terminated_mask=bytes(terminated),
            truncated_mask=bytes(truncated),
            infos=self.infos(maps, fresh, done),
            completed_episodes=completed,
            env_indices=op.echo_indices or [],
        )
        response = env_v1.JoinResponse(request_id=op.request_id, step=body)
        self.stamp(response, op, phases, skew, decode=True)
        return response

    def lane_step_response(
        self,
        op: Op,
        result: StepResult,
        phases: Phases,
        completed: list[env_v1.EpisodeMetadata],
    ) -> env_v1.JoinResponse:
        """The reply to one lane's step on the session's straight line: what
        :meth:`step_response` builds for one warning-free result, without its folds."""
        terminated, truncated = bool(result.terminated), bool(result.truncated)
        response = env_v1.JoinResponse(
            request_id=op.request_id,
            step=env_v1.StepResponse(
                observation=spaces_v1.SpaceValue(leaves=result.observation),
                rewards=[float(result.reward)],
                terminated_mask=b"\x01" if terminated else b"\x00",
                truncated_mask=b"\x01" if truncated else b"\x00",
                infos=result.info,
                completed_episodes=completed,
                env_indices=op.echo_indices or [],
            ),
            decode_ns=phases.decode_ns,
            user_ns=phases.user_ns,
            encode_ns=phases.encode_ns,
            queue_ns=phases.queue_ns,
        )
        response.endpoint_total_ns = self.elapsed(op.started_ns)
        return response

    def render_response(self, op: Op, render: RenderResult, phases: Phases) -> env_v1.JoinResponse:
        """The reply to a render: the PNG frame, or an empty render when the env drew
        nothing."""
        body = (
            env_v1.RenderResponse()
            if render.frame is None
            else env_v1.RenderResponse(frame=render.frame, format=env_v1.RenderFormat.PNG)
        )
        response = env_v1.JoinResponse(request_id=op.request_id, render=body)
        self.stamp(response, op, phases, None, decode=False)
        return response

    def elapsed(self, read_ns: int) -> int:
        return max(self._clock_ns() - read_ns, 1)

    def stamp(
        self,
        response: env_v1.JoinResponse,
        op: Op,
        phases: Phases,
        skew: int | None,
        *,
        decode: bool,
    ) -> None:
        if decode:
            response.decode_ns = phases.decode_ns + op.pre_decode_ns
        response.user_ns = phases.user_ns
        response.encode_ns = phases.encode_ns
        response.queue_ns = phases.queue_ns
        if skew is not None:
            response.lane_skew_ns = skew
        response.endpoint_total_ns = self.elapsed(op.started_ns)

    def error(
        self,
        rid: str,
        read_ns: int,
        code: env_v1.EnvErrorCode,
        message: str,
        recoverable: bool,
        debug: str = "",
    ) -> Send:
        error = env_v1.EnvError(
            code=code, message=message, is_recoverable=recoverable, debug_info=debug
        )
        return Send(
            env_v1.JoinResponse(
                request_id=rid, error=error, endpoint_total_ns=self.elapsed(read_ns)
            )
        )

    def errored(
        self, report: Report, read_ns: int, recoverable: bool = True, debug: str = ""
    ) -> list[Action]:
        """The error reply to the request ``report`` tells the log about, then the report."""
        code, message = report.code, report.message
        return [self.error(report.request_id, read_ns, code, message, recoverable, debug), report]


def _with_warning(info: spaces_v1.MetaMap | None, warnings: list[Candidate]) -> spaces_v1.MetaMap:
    """``info`` (None: none) with the conformance entry, a new map: the lane's own is
    not the session's to change (a recorder keeps it by reference, on another thread)."""
    entries = {} if info is None else info.entries
    return spaces_v1.MetaMap(entries={**entries, CONFORMANCE_KEY: warning_value(warnings)})
