"""The wire work of one job, on the lane thread: decode, call the env, encode."""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Mapping
from time import perf_counter_ns
from typing import Any

import gymnasium as gym
import numpy as np
import outcome

from .._codec import Candidate, SpaceCodec, to_meta_map
from .._errors import PolicyViolation, not_instance
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
from .._proto.rlmesh.spaces.v1 import MetaMap

logger = logging.getLogger("rlmesh_trio.lanes")


# ----------------------------------------------------- what the env returned, checked
#
# As the reference reads an env's answers (its PyO3 extraction): ``step()`` gives a tuple
# of 5 (Gymnasium) or 4 (legacy Gym: ``done`` is terminated, or truncated when the info
# says ``TimeLimit.truncated``); the reward is a real number (``float``'s protocol, not
# a string's parse); the flags are ``bool`` or ``numpy.bool_``, nothing truthy; the
# parts are checked in that order, then the observation, then the info. An info of
# ``None`` is no info (its reply has none). ``reset()`` gives ``(observation, info)``
# when it returns a pair whose second item is a mapping or None, else the observation
# alone. Each refusal is the reference's text.


def step_flag(value: Any) -> bool:
    """A terminated or truncated flag: ``bool`` or ``numpy.bool_`` only."""
    if value is True or value is False:
        return value
    if type(value) is np.bool_:
        return bool(value)
    raise not_instance(value, "bool")


def real_number(value: Any) -> float:
    """A reward as C's ``PyFloat_AsDouble`` reads it: ``__float__``, else ``__index__``
    (a string is no number here, whatever it spells)."""
    kind = type(value)
    if kind is float:
        return value  # type: ignore[no-any-return]
    if hasattr(kind, "__float__"):
        return float(value)
    if hasattr(kind, "__index__"):
        return float(operator.index(value))
    raise TypeError(f"must be real number, not {kind.__name__}")


def step_parts(value: Any) -> tuple[Any, float, bool, bool, Any]:
    """``env.step()``'s answer as (observation, reward, terminated, truncated, info),
    checked as the reference checks it."""
    if not isinstance(value, tuple):
        raise not_instance(value, "tuple")
    if len(value) == 5:
        observation, reward, terminated, truncated, info = value
        reward = real_number(reward)
        return observation, reward, step_flag(terminated), step_flag(truncated), info
    if len(value) == 4:  # legacy Gym: (observation, reward, done, info)
        observation, reward, done, info = value
        reward = real_number(reward)
        done = step_flag(done)
        limit = isinstance(info, Mapping) and bool(info.get("TimeLimit.truncated", False))
        return observation, reward, done and not limit, done and limit, info
    raise ValueError(
        f"env.step() must return 4 legacy Gym values or 5 Gymnasium values, got {len(value)}"
    )


def reset_parts(value: Any, pair_space: bool = False) -> tuple[Any, Any]:
    """``env.reset()``'s answer as (observation, info): a pair whose second item is a
    mapping (or None), else the observation alone with an empty info. ``pair_space``:
    the observation space is a Tuple of two, so ``(x, {...})`` whose ``x`` is no pair is
    such an observation returned alone (a legacy env's), not (observation, info)."""
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and (value[1] is None or isinstance(value[1], Mapping))
    ):
        first = value[0]
        if pair_space and not (isinstance(first, tuple) and len(first) == 2):
            return value, {}
        return first, value[1]
    return value, {}


def info_map(info: Any) -> MetaMap | None:
    """An env's info on the wire: None stays None (no info)."""
    return None if info is None else to_meta_map(info)


_TAKES_OPTIONS: dict[type, bool] = {}
""":func:`takes_options` by env class (reading a signature costs more than a reset)."""


def takes_options(env: gym.Env[Any, Any]) -> bool:
    """Whether ``env.reset`` takes ``options=`` (a parameter of that name or ``**``)."""
    known = _TAKES_OPTIONS.get(type(env))
    if known is None:
        try:
            parameters = inspect.signature(env.reset).parameters.values()
        except (TypeError, ValueError):  # no signature to read: let the call say
            known = True
        else:
            known = any(p.name == "options" or p.kind is p.VAR_KEYWORD for p in parameters)
        _TAKES_OPTIONS[type(env)] = known
    return known


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

    __slots__ = ("_action_codec", "_observation_codec", "_pair_space", "_soft", "_strict")

    def __init__(
        self, action_codec: SpaceCodec, observation_codec: SpaceCodec, policy: Policy
    ) -> None:
        self._action_codec = action_codec
        self._observation_codec = observation_codec
        space = observation_codec.space
        self._pair_space = isinstance(space, gym.spaces.Tuple) and len(space.spaces) == 2
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
        # The seed and the options are passed when the request carries them, as the
        # reference passes them (an env's ``reset(self, seed=None)`` works); options an
        # env's reset cannot take are dropped, with a warning.
        kwargs: dict[str, Any] = {}
        if job.seed is not None:
            kwargs["seed"] = job.seed
        if job.options is not None:
            if takes_options(env):
                kwargs["options"] = job.options
            else:
                logger.warning(
                    "%s.reset() takes no options: the reset's options %r were dropped",
                    type(env.unwrapped).__qualname__,
                    job.options,
                )
        observation, info = reset_parts(env.reset(**kwargs), self._pair_space)
        split.enter(_ENCODE)
        leaves, candidate = self._encode_observation(observation)
        return ResetResult(observation=leaves, info=info_map(info), obs_warning=candidate)

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
            answer = env.step(action)
            stepped = perf_counter_ns()
            observation, reward, terminated, truncated, info = step_parts(answer)
            leaves, obs_candidate = self._encode_observation(observation)
            result = outcome.Value(
                StepResult(
                    observation=leaves,
                    reward=reward,
                    terminated=terminated,
                    truncated=truncated,
                    info=info_map(info),
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
