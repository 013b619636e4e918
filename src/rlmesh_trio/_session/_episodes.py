"""The episodes of one Join's lanes (SPEC §7.7, §7.9): :class:`EpisodeBook`, and the
records it keeps. Sans-IO: the book reads only the clock it was given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from .._jobs import StepResult
from .._proto.rlmesh.env import v1 as env_v1
from .._proto.rlmesh.spaces import v1 as spaces_v1

__all__ = ["Ended", "Episode", "EpisodeBook"]


@dataclass
class Episode:
    """A lane's episode since its reset, and its record on the wire (SPEC §7.7)."""

    episode_id: str
    seed: int | None
    lane: int
    start_ns: int
    steps: int = 0
    reward: float = 0.0

    def record(
        self,
        end_ns: int,
        *,
        terminated: bool = False,
        truncated: bool = False,
        final_info: spaces_v1.MetaMap | None = None,
    ) -> env_v1.EpisodeMetadata:
        return env_v1.EpisodeMetadata(
            episode_id=self.episode_id,
            seed=self.seed,
            env_index=self.lane,
            step_count=self.steps,
            cumulative_reward=self.reward,
            terminated=terminated,
            truncated=truncated,
            start_timestamp_ns=self.start_ns,
            end_timestamp_ns=end_ns,
            final_info=final_info,
        )


class Ended(NamedTuple):
    """An episode a step ended. Its record waits for the reply's info map (the record's
    ``final_info``, which carries the conformance entries placed in it)."""

    episode: Episode
    terminated: bool
    truncated: bool
    end_ns: int

    def record(self, final_info: spaces_v1.MetaMap | None) -> env_v1.EpisodeMetadata:
        return self.episode.record(
            self.end_ns,
            terminated=self.terminated,
            truncated=self.truncated,
            final_info=final_info,
        )


class EpisodeBook:
    """One Join's episode accounts, kept in lane order as the lanes' results come in.

    It owns each lane's running episode, the episodes lost to a reset or a lane fault and
    not reported yet (the next step's reply carries them, whichever lanes it steps), and,
    with ``keep_observations`` (policy ``truncate``), each lane's last observation, which
    answers a faulted step as a truncation. The session's one-lane straight line and its
    general path both keep their accounts here, and only here.
    """

    __slots__ = ("_episodes", "_interrupted", "_keep_obs", "_last_obs", "_n", "_wall_ns")

    def __init__(
        self, num_envs: int, wall_ns: Callable[[], int], *, keep_observations: bool
    ) -> None:
        self._n = num_envs
        self._wall_ns = wall_ns
        self._keep_obs = keep_observations
        self._episodes: list[Episode | None] = [None] * num_envs
        self._interrupted: list[env_v1.EpisodeMetadata] = []
        self._last_obs: list[list[bytes] | None] = [None] * num_envs

    def reset(self, lane: int, episode_id: str, seed: int | None, observation: list[bytes]) -> None:
        """``lane`` reset: its running episode, if any, is interrupted; a new one starts."""
        if self._keep_obs:
            self._last_obs[lane] = observation
        previous = self._episodes[lane]
        if previous is not None:
            self._interrupted.append(previous.record(self._wall_ns(), truncated=True))
        self._episodes[lane] = Episode(
            episode_id=episode_id, seed=seed, lane=lane, start_ns=self._wall_ns()
        )

    def step(self, lane: int, result: StepResult) -> Ended | None:
        """``lane`` stepped: the step counts into its episode; the episode when the step
        ended it. A lane stepped without a reset has no episode: nothing is recorded."""
        if self._keep_obs:
            self._last_obs[lane] = result.observation
        episode = self._episodes[lane]
        if episode is None:
            return None
        episode.steps += 1
        episode.reward += result.reward
        if result.terminated or result.truncated:
            self._episodes[lane] = None
            return Ended(episode, result.terminated, result.truncated, self._wall_ns())
        return None

    def fault(self, lane: int) -> None:
        """``lane`` lost its env: its episode is interrupted, its last observation gone."""
        episode = self._episodes[lane]
        if episode is not None:
            self._interrupted.append(episode.record(self._wall_ns(), truncated=True))
            self._episodes[lane] = None
        self._last_obs[lane] = None

    def last_observation(self, lane: int) -> list[bytes] | None:
        """``lane``'s last observation (kept with ``keep_observations`` only)."""
        return self._last_obs[lane]

    def take_interrupted(self) -> list[env_v1.EpisodeMetadata]:
        """The interrupted episodes not reported yet, oldest first; the caller's now."""
        taken = self._interrupted
        self._interrupted = []
        return taken

    def close(self) -> list[env_v1.EpisodeMetadata]:
        """Close (SPEC §7.8): the interrupted episodes, then every running one as truncated
        now, in lane order; no episode runs after."""
        now = self._wall_ns()
        final = self.take_interrupted()
        for lane, episode in enumerate(self._episodes):
            if episode is not None:
                final.append(episode.record(now, truncated=True))
                self._episodes[lane] = None
        return final

    def drop(self) -> None:
        """The stream ended without Close: every episode record is dropped (SPEC §7.9)."""
        self._episodes = [None] * self._n
        self._interrupted.clear()

    def running(self, lane: int) -> Episode | None:
        """``lane``'s running episode (for tests)."""
        return self._episodes[lane]
