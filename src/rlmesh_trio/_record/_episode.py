"""One lane's episodes, as plain numpy data, from its reset to its end or its cut.

An :class:`EpisodeAccumulator` belongs to one lane and is fed on that lane's thread (or
wherever the lane's requests are answered, one at a time): :meth:`~EpisodeAccumulator.reset`
with the observation the env returned and the seed the client sent, then
:meth:`~EpisodeAccumulator.step` with the action the env saw and what it returned. When the
env ends the episode (terminated or truncated) the finished :class:`Episode` goes to the
sink (the dataset writer's ``put``); when the server ends it instead (a lane fault, a
session's close, the server's stop, a client's reset mid-episode), :meth:`~EpisodeAccumulator.cut`
marks it truncated and says why, or drops it (``drop_faulted``).

The step path does only what must happen there: one copy of each observation and action
leaf (an env may hand out a buffer it writes again next step) and five list appends.
Stacking into arrays happens on the writer's thread (:func:`stack`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import concatenate, create_empty_array

__all__ = [
    "CUT_REASONS",
    "CutReason",
    "Episode",
    "EpisodeAccumulator",
    "UnsupportedSpaceError",
    "check_space",
    "stack",
]

logger = logging.getLogger("rlmesh_trio.record")

CutReason = Literal["reset", "lane_fault", "session_close", "server_stop"]
CUT_REASONS: Final[frozenset[str]] = frozenset(
    {"reset", "lane_fault", "session_close", "server_stop"}
)
"""Why the server, not the env, ended an episode: the client reset the lane mid-episode,
the lane's env faulted, the client's session closed, the server stopped."""

SUPPORTED: Final[tuple[type[spaces.Space[Any]], ...]] = (
    spaces.Box,
    spaces.Discrete,
    spaces.MultiDiscrete,
    spaces.MultiBinary,
    spaces.Dict,
    spaces.Tuple,
    spaces.Text,
)
"""The spaces Minari 0.5 can serialize and store (``minari.serialization``)."""


class UnsupportedSpaceError(TypeError):
    """A space (or a space nested in a Dict or Tuple) that Minari cannot store."""


def check_space(space: spaces.Space[Any], where: str = "space") -> None:
    """Raise :class:`UnsupportedSpaceError` naming the first part of ``space`` that a
    Minari dataset cannot hold (Sequence, Graph, OneOf, a custom space)."""
    if isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            check_space(sub, f"{where}[{key!r}]")
        return
    if isinstance(space, spaces.Tuple):
        for i, sub in enumerate(space.spaces):
            check_space(sub, f"{where}[{i}]")
        return
    if type(space) not in SUPPORTED:
        names = ", ".join(t.__name__ for t in SUPPORTED)
        raise UnsupportedSpaceError(
            f"{where} is a {type(space).__name__}, which a Minari dataset cannot store "
            f"(Minari 0.5 stores {names}); record without a dataset, or serve the env "
            "behind a wrapper that maps it to one of those"
        )


def _copier(space: spaces.Space[Any]) -> Callable[[Any], Any]:
    """A function that copies one value of ``space`` so that the env can no longer change
    it: arrays are copied (dtype kept), Discrete values become numpy integers, Text stays
    a ``str``; Dict and Tuple values are rebuilt leaf by leaf."""
    if isinstance(space, spaces.Dict):
        subs = {key: _copier(sub) for key, sub in space.spaces.items()}
        return lambda value: {key: copy(value[key]) for key, copy in subs.items()}
    if isinstance(space, spaces.Tuple):
        parts = tuple(_copier(sub) for sub in space.spaces)
        return lambda value: tuple(copy(v) for copy, v in zip(parts, value, strict=True))
    if isinstance(space, spaces.Text):
        return str
    if isinstance(space, spaces.Discrete):
        dtype = space.dtype
        return lambda value: dtype.type(value)
    return np.array  # Box, MultiDiscrete, MultiBinary: np.array copies


def _same(value: Any) -> Any:
    return value


def _info_dict(info: Any) -> dict[str, Any]:
    return dict(info or {})


def stack(space: spaces.Space[Any], values: list[Any]) -> Any:
    """``values`` (each one of ``space``) as one batch the way Minari's storage takes it:
    an array per leaf along a first axis of ``len(values)``, a dict for a Dict space, a
    tuple for a Tuple space, a list of ``str`` for a Text space. Built with gymnasium's
    :func:`~gymnasium.vector.utils.concatenate` into its
    :func:`~gymnasium.vector.utils.create_empty_array`."""
    out = create_empty_array(space, len(values))
    assert out is not None  # None only for spaces check_space refuses (Graph, Sequence)
    batch = concatenate(space, values, out)
    return _minari_form(space, batch)


def _minari_form(space: spaces.Space[Any], batch: Any) -> Any:
    # gymnasium batches Text as a tuple of str, which Minari would take for a Tuple space
    if isinstance(space, spaces.Text):
        return list(batch)
    if isinstance(space, spaces.Dict):
        return {key: _minari_form(sub, batch[key]) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(_minari_form(sub, b) for sub, b in zip(space.spaces, batch, strict=True))
    return batch


@dataclass(slots=True)
class Episode:
    """One finished (or cut) episode of one lane, as the env saw and produced it.

    ``observations`` has one more entry than ``actions`` (the reset's observation first);
    ``infos`` (when recorded) too: the reset's info, then each step's. ``cut`` is None when
    the env ended the episode, else why the server did (:data:`CUT_REASONS`); a cut episode
    ends truncated."""

    lane: int
    index: int
    """The lane's episode counter, from 0 (every episode of the lane, recorded or not)."""
    seed: int | None
    observations: list[Any]
    actions: list[Any] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    terminations: list[bool] = field(default_factory=list)
    truncations: list[bool] = field(default_factory=list)
    infos: list[Any] | None = None
    """Dicts (the wire's ``MetaMap`` while a served episode is queued)."""
    cut: str | None = None

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))


class EpisodeAccumulator:
    """One lane's episode under way, fed with plain data; not thread-safe (the lane's own).

    ``sink`` receives each finished episode (a dataset writer's ``put``, which may block:
    that is the backpressure). ``record_infos`` keeps the reset's and each step's info.
    ``drop_faulted`` drops cut episodes instead of recording them truncated. ``copy=False``
    keeps what it is given as it is (values that cannot change: the lanes pass the wire
    forms, immutable bytes, and the writer decodes them)."""

    def __init__(
        self,
        lane: int,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        sink: Callable[[Episode], None],
        *,
        record_infos: bool = False,
        drop_faulted: bool = False,
        copy: bool = True,
    ) -> None:
        check_space(observation_space, "observation_space")
        check_space(action_space, "action_space")
        self.lane = lane
        self._sink = sink
        self._copy_obs = _copier(observation_space) if copy else _same
        self._copy_action = _copier(action_space) if copy else _same
        self._copy_info: Callable[[Any], Any] = _info_dict if copy else _same
        self._record_infos = record_infos
        self._drop_faulted = drop_faulted
        self._episode: Episode | None = None
        self.episodes_started = 0
        """Resets seen: the next episode's :attr:`Episode.index`."""
        self.episodes_dropped = 0
        """Cut episodes dropped (``drop_faulted``) or with no step (nothing to store)."""
        self.steps_unrecorded = 0
        """Steps with no episode open (a step before any reset, or after the episode
        ended without a reset): not recorded, counted, and logged once."""

    @property
    def in_episode(self) -> bool:
        return self._episode is not None

    def reset(self, observation: Any, seed: int | None, info: Any = None) -> None:
        """The env was reset with ``seed`` (None when the client sent none) and returned
        ``observation`` (and ``info``). An episode still open is cut first (``"reset"``)."""
        if self._episode is not None:
            self.cut("reset")
        self._episode = Episode(
            lane=self.lane,
            index=self.episodes_started,
            seed=seed,
            observations=[self._copy_obs(observation)],
            infos=[self._copy_info(info)] if self._record_infos else None,
        )
        self.episodes_started += 1

    def step(
        self,
        action: Any,
        observation: Any,
        reward: float,
        terminated: bool,
        truncated: bool,
        info: Any = None,
    ) -> Episode | None:
        """The env took ``action`` and returned the rest. Returns the episode when this
        step ended it (after handing it to the sink), else None."""
        episode = self._episode
        if episode is None:
            if self.steps_unrecorded == 0:
                logger.warning(
                    "lane %d: a step with no episode open (no reset since the last end) "
                    "is not recorded; further ones are only counted",
                    self.lane,
                )
            self.steps_unrecorded += 1
            return None
        episode.actions.append(self._copy_action(action))
        episode.observations.append(self._copy_obs(observation))
        episode.rewards.append(float(reward))
        episode.terminations.append(bool(terminated))
        episode.truncations.append(bool(truncated))
        if episode.infos is not None:
            episode.infos.append(self._copy_info(info))
        if terminated or truncated:
            self._episode = None
            self._sink(episode)
            return episode
        return None

    def cut(self, reason: CutReason | str) -> Episode | None:
        """The server ends the open episode (``reason`` one of :data:`CUT_REASONS`): it is
        recorded truncated with ``cut=reason``, or dropped under ``drop_faulted``. An
        episode with no step is dropped (a Minari episode needs one). Returns the episode
        handed to the sink, if any; with no episode open, does nothing."""
        if reason not in CUT_REASONS:
            raise ValueError(f"unknown cut reason {reason!r}; one of {sorted(CUT_REASONS)}")
        episode, self._episode = self._episode, None
        if episode is None:
            return None
        if self._drop_faulted or not episode.rewards:
            self.episodes_dropped += 1
            return None
        episode.truncations[-1] = True
        episode.cut = reason
        self._sink(episode)
        return episode
