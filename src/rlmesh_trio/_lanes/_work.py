"""The wire work of one job, on the lane thread: decode, call the env, encode."""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any

import gymnasium as gym
import outcome

from .._codec import Candidate, SpaceCodec, to_meta_map
from .._errors import PolicyViolation
from .._jobs import (
    CallJob,
    Job,
    Phases,
    RenderJob,
    RenderResult,
    ResetJob,
    ResetResult,
    StepJob,
    StepResult,
)
from .._options import Policy
from .._png import encode_png


class Split:
    """Splits one job's time into decode / user / encode (indices 0, 1, 2)."""

    __slots__ = ("mark", "ns", "phase")

    def __init__(self, phase: int) -> None:
        self.ns = [0, 0, 0]
        self.phase = phase
        self.mark = perf_counter_ns()

    def enter(self, phase: int) -> None:
        now = perf_counter_ns()
        self.ns[self.phase] += now - self.mark
        self.phase = phase
        self.mark = now

    def phases(self, queue_ns: int) -> Phases:
        self.enter(self.phase)
        decode_ns, user_ns, encode_ns = self.ns
        return Phases(queue_ns=queue_ns, decode_ns=decode_ns, user_ns=user_ns, encode_ns=encode_ns)


_DECODE, _USER, _ENCODE = 0, 1, 2


def verb_of(job: Job) -> str:
    """The env call a job makes, as the wire's texts name it."""
    if isinstance(job, StepJob):
        return "step"
    if isinstance(job, ResetJob):
        return "reset"
    if isinstance(job, RenderJob):
        return "render"
    return "call"


class LaneWork:
    """Runs jobs against an env with the endpoint's codecs and conformance policy.

    Stateless per job and shared by all lanes (it holds no env): each lane thread calls
    :meth:`execute` with its own env.
    """

    __slots__ = ("_action_codec", "_observation_codec", "_soft", "_strict")

    def __init__(
        self, action_codec: SpaceCodec, observation_codec: SpaceCodec, policy: Policy
    ) -> None:
        self._action_codec = action_codec
        self._observation_codec = observation_codec
        self._soft = policy != "off"
        self._strict = policy == "strict"

    def execute(
        self, env: gym.Env[Any, Any], job: Job, queue_ns: int
    ) -> tuple[outcome.Outcome[Any], Phases, bool]:
        """Run ``job``; returns its outcome, its phases, and whether the ENV raised.

        Only an exception raised inside the env call (reset, step, render, or a
        ``CallJob``'s function) is a fault of the lane; a bad action or an observation the
        codec refuses is an answer like any other and leaves the env as it is.
        """
        result: outcome.Outcome[Any]
        if isinstance(job, StepJob):
            return self._timed_step(env, job, queue_ns)
        if isinstance(job, ResetJob):
            split = Split(_USER)
            result = outcome.capture(self._reset, env, job, split)
        elif isinstance(job, CallJob):
            split = Split(_USER)
            result = outcome.capture(job.fn, env)
        elif isinstance(job, RenderJob):
            split = Split(_USER)
            result = outcome.capture(self._render, env, split)
        else:
            split = Split(_DECODE)
            result = outcome.Error(TypeError(f"not a lane job: {type(job).__name__}"))
        faulted = split.phase == _USER and isinstance(result, outcome.Error)
        return result, split.phases(queue_ns), faulted

    def _encode_observation(self, observation: Any) -> tuple[list[bytes], Candidate | None]:
        leaves, candidate = self._observation_codec.encode_observation(
            observation, soft_checks=self._soft
        )
        if candidate is not None and self._strict:
            raise PolicyViolation(candidate.detail, candidate.kind)
        return leaves, candidate

    def _reset(self, env: gym.Env[Any, Any], job: ResetJob, split: Split) -> ResetResult:
        observation, info = env.reset(seed=job.seed, options=job.options)
        split.enter(_ENCODE)
        leaves, candidate = self._encode_observation(observation)
        return ResetResult(observation=leaves, info=to_meta_map(info), obs_warning=candidate)

    def _timed_step(
        self, env: gym.Env[Any, Any], job: StepJob, queue_ns: int
    ) -> tuple[outcome.Outcome[Any], Phases, bool]:
        """:meth:`execute` of a step (the hot path), its phases timed inline rather than by
        a :class:`Split`: decode, the env call (only its exception is a fault), encode."""
        result: outcome.Outcome[Any]
        decoded = stepped = 0
        start = perf_counter_ns()
        try:
            action, action_candidate = self._action_codec.step_action(
                job.leaves, job.n, job.row, validated=job.validated, soft_checks=self._soft
            )
            if action_candidate is not None and self._strict:
                raise PolicyViolation(action_candidate.detail, action_candidate.kind)
            decoded = perf_counter_ns()
            observation, reward, terminated, truncated, info = env.step(action)
            stepped = perf_counter_ns()
            leaves, obs_candidate = self._encode_observation(observation)
            result = outcome.Value(
                StepResult(
                    observation=leaves,
                    reward=float(reward),
                    terminated=bool(terminated),
                    truncated=bool(truncated),
                    info=to_meta_map(info),
                    action_warning=action_candidate,
                    obs_warning=obs_candidate,
                )
            )
        except BaseException as exc:  # as outcome.capture: the job's answer, whatever it is
            result = outcome.Error(exc)
        end = perf_counter_ns()
        if not decoded:
            return result, Phases(queue_ns, end - start, 0, 0), False
        if not stepped:  # the env raised: a fault of the lane
            return result, Phases(queue_ns, decoded - start, end - decoded, 0), True
        return result, Phases(queue_ns, decoded - start, stepped - decoded, end - stepped), False

    def _render(self, env: gym.Env[Any, Any], split: Split) -> RenderResult:
        frame = env.render()
        split.enter(_ENCODE)
        if frame is None:
            return RenderResult(frame=None)
        return RenderResult(frame=encode_png(frame))
