"""The fleet's records: endpoints' status, their health, retries, a run's merged result
and its shards, and the fleet's error. Plain data, shared by :mod:`._core` (the fleet),
:mod:`._scheduler`, :mod:`._run` (``Fleet.run``) and :mod:`.ray`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._deprecation import renamed_attribute
from .._errors import RlmeshTrioError

__all__ = [
    "EndpointStatus",
    "FleetError",
    "FleetRunResult",
    "Health",
    "Retry",
    "ShardRun",
    "State",
]

State = Literal["serving", "restarting", "dead"]
"""An endpoint's state: answering, being restarted (or not answering yet), gone for good."""


class FleetError(RlmeshTrioError, RuntimeError):
    """A fleet operation could not finish: no endpoint left, or work failed past its
    retries. ``partial`` holds what did finish (a list for ``map``, a
    :class:`FleetRunResult` for ``run``), ``retries`` every retry that was made."""

    def __init__(self, message: str, *, partial: Any = None, retries: Sequence[Retry] = ()) -> None:
        super().__init__(message)
        self.partial = partial
        self.retries = tuple(retries)


@dataclass(frozen=True)
class EndpointStatus:
    """One endpoint of a fleet, as of when it was read (a snapshot; the live connection
    to an endpoint is :class:`rlmesh_trio.client.Endpoint`)."""

    index: int
    """Its position in the fleet (stable across restarts)."""
    address: str
    """The current address, ``tcp://host:port`` (it changes when a restart moves it)."""
    num_envs: int | None
    """How many lanes (envs) it serves; ``None`` until it has been reached once."""
    state: State
    """``"serving"``, ``"restarting"`` (or not answering) or ``"dead"``."""
    restarts: int = 0
    """How many times it was restarted (by Ray, or by the fleet's supervisor)."""
    node: str | None = None
    """Where it runs: a Ray node id, or the host of a static address."""

    lanes = renamed_attribute("num_envs", owner="EndpointStatus", old="lanes")


@dataclass(frozen=True)
class Health:
    """One endpoint's answer to a health probe (grpc.health.v1 Check, then a Handshake)."""

    index: int
    address: str
    serving: bool
    """It answers SERVING and accepts a Handshake: it can take a session."""
    status: str
    """The grpc.health.v1 status (``SERVING``, ``NOT_SERVING``, ...), ``no health
    service`` (rlmesh 0.1.0's server), ``dead``, or ``unknown`` when unreachable."""
    error: str | None = None
    """Why it is not serving, when it is not (``unreachable: ...``, a timeout, ...)."""
    num_envs: int | None = None
    """How many lanes (envs) it serves, as its Handshake said (``None``: not reached)."""

    lanes = renamed_attribute("num_envs", owner="Health", old="lanes")

    def __str__(self) -> str:
        return self.status if self.serving else f"{self.status} ({self.error})"


@dataclass(frozen=True)
class Retry:
    """One retry: work that failed on an endpoint and was queued again."""

    endpoint: int
    address: str
    units: int
    """How many items (``map``: shards; ``run``: seeds) were queued again."""
    error: str
    attempt: int
    """The how-manieth failure of the most-failed of those items (1 = first retry)."""


@dataclass(frozen=True)
class FleetRunResult:
    """:meth:`Fleet.run`'s merged result, shaped like :class:`rlmesh.RunResult`.

    ``episodes`` holds one :class:`rlmesh.EpisodeResult` per requested seed, in the
    order of ``seeds`` (``index`` is that position), whichever endpoint ran it.
    """

    episodes: tuple[Any, ...] = ()
    telemetry: tuple[Any, ...] = ()
    """Empty: percentiles of separate runs do not merge (each shard's telemetry is on
    :attr:`shards`)."""
    advisories: tuple[Any, ...] = ()
    shards: tuple[ShardRun, ...] = ()
    """Every ``rlmesh.run`` the fleet made, failed ones included, in start order."""
    retries: tuple[Retry, ...] = ()
    discarded: int = 0
    """Episodes run only to fill a shard to a multiple of its endpoint's lanes (or
    finished twice) and left out of ``episodes``."""

    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    @property
    def total_steps(self) -> int:
        return sum(int(e.steps) for e in self.episodes)

    @property
    def mean_reward(self) -> float:
        if not self.episodes:
            return 0.0
        return sum(float(e.reward) for e in self.episodes) / len(self.episodes)

    @property
    def success_rate(self) -> float | None:
        if not self.episodes or any(e.success is None for e in self.episodes):
            return None
        return sum(1 for e in self.episodes if e.success) / len(self.episodes)

    def format_telemetry(self) -> str:
        return "(no merged telemetry: see FleetRunResult.shards for each run's)"

    def as_run_result(self) -> Any:
        """The same episodes (and advisories) as a real :class:`rlmesh.RunResult`."""
        import rlmesh

        return rlmesh.RunResult(episodes=self.episodes, advisories=self.advisories)

    def __repr__(self) -> str:
        return (
            f"FleetRunResult(episodes={self.num_episodes}, mean_reward={self.mean_reward:.3f}, "
            f"total_steps={self.total_steps}, shards={len(self.shards)}, "
            f"retries={len(self.retries)})"
        )


@dataclass(frozen=True)
class ShardRun:
    """One ``rlmesh.run`` of a fleet run: where, which seeds, what came of it."""

    endpoint: int
    address: str
    seeds: tuple[int, ...]
    """The seeds asked for (a shard filled to a multiple of lanes repeats some)."""
    kept: int
    """Episodes of it that made it into the merged result."""
    error: str | None = None
    """Why the run failed (``None``: it finished)."""
    telemetry: tuple[Any, ...] = ()
    """The run's own telemetry (``rlmesh.RunResult.telemetry``)."""
    duration_seconds: float = 0.0
    """How long the run took, in seconds."""

    duration_s = renamed_attribute("duration_seconds", owner="ShardRun", old="duration_s")
