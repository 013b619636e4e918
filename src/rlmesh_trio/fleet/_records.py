"""The fleet's records: endpoints, their health, retries, a run's merged result and its
shards, and the scheduler's outcome. Plain data, shared by :mod:`._core` (the fleet and
its scheduler), :mod:`._run` (``Fleet.run``) and :mod:`.ray`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = [
    "Endpoint",
    "FleetError",
    "FleetRunResult",
    "Health",
    "Retry",
    "ShardRun",
    "State",
]

State = Literal["serving", "restarting", "dead"]
"""An endpoint's state: answering, being restarted (or not answering yet), gone for good."""


class FleetError(RuntimeError):
    """A fleet operation could not finish: no endpoint left, or work failed past its
    retries. ``partial`` holds what did finish (a list for ``map``, a
    :class:`FleetRunResult` for ``run``), ``retries`` every retry that was made."""

    def __init__(self, message: str, *, partial: Any = None, retries: Sequence[Retry] = ()) -> None:
        super().__init__(message)
        self.partial = partial
        self.retries = tuple(retries)


@dataclass(frozen=True)
class Endpoint:
    """One endpoint of a fleet, as of when it was read (a snapshot)."""

    index: int
    """Its position in the fleet (stable across restarts)."""
    address: str
    """The current address, ``tcp://host:port`` (it changes when a restart moves it)."""
    lanes: int | None
    """How many lanes (envs) it serves; ``None`` until it has been reached once."""
    state: State
    """``"serving"``, ``"restarting"`` (or not answering) or ``"dead"``."""
    restarts: int = 0
    """How many times it was restarted (by Ray, or by the fleet's supervisor)."""
    node: str | None = None
    """Where it runs: a Ray node id, or the host of a static address."""


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
    lanes: int | None = None

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


class _Abort(Exception):
    """Raised by a runner: stop the whole schedule, retry nothing (e.g. a user hook raised)."""


_Done = Callable[[int, Any], bool]
"""``done(unit, value)``: record a finished unit; False when it was already finished."""


@dataclass
class _Outcome:
    done: dict[int, Any]
    failed: dict[int, str]
    """Units given up on, with the last error."""
    retries: list[Retry] = field(default_factory=list)
    last_error: BaseException | None = None

    def describe(self, noun: str) -> str:
        sample = next(iter(self.failed.values()), "")
        return (
            f"{len(self.failed)} {noun}(s) could not be finished ({len(self.done)} were): {sample}"
        )


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
    telemetry: tuple[Any, ...] = ()
    duration_s: float = 0.0


def _renumber(episode: Any, position: int) -> Any:
    """An EpisodeResult with ``index`` (and ``trial``, when set) as the fleet ordinal."""
    trial = episode.trial
    return replace(episode, index=position, trial=None if trial is None else position)
