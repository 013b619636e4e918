"""One lane's running episode (SPEC §7.7)."""

from __future__ import annotations

from dataclasses import dataclass

from .._proto.rlmesh.env import v1 as env_v1
from .._proto.rlmesh.spaces import v1 as spaces_v1


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
