"""One shard of ``Fleet.run``: ``rlmesh.run`` on one endpoint, and the book all of one
run's shards write to.

The scheduler calls :func:`run_shard` on its threads, one endpoint each; every shard
keeps its episodes through the scheduler's ``done`` (the first result for a seed wins),
forwards the user's hooks one call at a time, and records itself in the
:class:`RunBook`. Imported by ``Fleet.run`` once rlmesh is known to be installed (it
imports rlmesh, the test extra).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import rlmesh

from .._errors import first_line
from ._records import EndpointStatus, ShardRun
from ._scheduler import Abort, Done

__all__ = ["HookFailed", "Recorder", "RunBook", "pad", "renumber", "run_shard"]


def pad(seeds: list[int], lanes: int | None) -> list[int]:
    """``seeds`` filled to a multiple of ``lanes`` by repeating its own seeds (rlmesh
    runs seeds on a driver-reset vector env in whole rounds of ``num_envs``)."""
    if not lanes or len(seeds) % lanes == 0:
        return list(seeds)
    short = lanes - len(seeds) % lanes
    return [*seeds, *(seeds[i % len(seeds)] for i in range(short))]


def renumber(episode: Any, position: int) -> Any:
    """An EpisodeResult with ``index`` (and ``trial``, when set) as the fleet ordinal."""
    trial = episode.trial
    return replace(episode, index=position, trial=None if trial is None else position)


class HookFailed(Abort):
    """A user hook raised: the whole fleet run stops (never retried)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"a hook raised {type(error).__name__}: {error}")
        self.error = error


class RunBook:
    """What one run's shards share, written from the scheduler's threads under one lock:
    the seeds wanted (a unit is an index into them), the shards run, the advisories (each
    once), the episodes discarded (a seed already done, or a padding seed), and the
    first error a user hook raised. The user's hooks are called through it, one call at
    a time."""

    def __init__(self, wanted: list[int], user_hooks: Any) -> None:
        self.wanted = wanted
        self.user_hooks = user_hooks
        self.shards: list[ShardRun] = []
        self.advisories: list[Any] = []
        self.discarded = 0
        self.hook_error: BaseException | None = None
        self._lock = threading.Lock()

    def forward(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Call the user's hook ``name`` (none: nothing); a hook's error is kept (the
        first) and raised, which ends that shard's ``rlmesh.run``."""
        if self.user_hooks is None:
            return
        with self._lock:
            try:
                getattr(self.user_hooks, name)(*args, **kwargs)
            except BaseException as exc:
                if self.hook_error is None:
                    self.hook_error = exc
                raise

    def check_hooks(self) -> None:
        """Stop the run once a user hook raised (raises :class:`HookFailed`)."""
        if self.hook_error is not None:
            raise HookFailed(self.hook_error)

    def discard(self) -> None:
        with self._lock:
            self.discarded += 1

    def advise(self, advisories: Any) -> None:
        with self._lock:
            for advisory in advisories:
                if advisory not in self.advisories:
                    self.advisories.append(advisory)

    def add(self, shard: ShardRun) -> None:
        with self._lock:
            self.shards.append(shard)


class Recorder(rlmesh.RunHooks):
    """A shard's hooks: keeps an ended episode for the first of ``units`` that wants its
    seed and is not done yet (``done`` says), forwards it renumbered, and counts the
    rest as discarded; the other hooks go to the user's as they are."""

    def __init__(self, book: RunBook, units: list[int], done: Done) -> None:
        self.book = book
        self.units = units
        self.done = done
        self.kept = 0

    def on_run_start(self, context: Any) -> None:
        self.book.forward("on_run_start", context)

    def on_episode_start(self, *, episode: int, seed: int | None) -> None:
        self.book.forward("on_episode_start", episode=episode, seed=seed)

    def on_step(self, event: Any) -> None:
        self.book.forward("on_step", event)

    def on_episode_end(self, result: Any) -> None:
        self.take(result, forward_it=True)

    def take(self, result: Any, *, forward_it: bool) -> None:
        for unit in self.units:
            if self.book.wanted[unit] == result.seed and self.done(unit, result):
                self.kept += 1
                if forward_it:
                    self.book.forward("on_episode_end", renumber(result, unit))
                return
        self.book.discard()


def run_shard(
    book: RunBook,
    model: Any,
    run_kwargs: Mapping[str, Any],
    record_episodes: bool,
    address: str,
    endpoint: EndpointStatus,
    units: list[int],
    done: Done,
) -> None:
    """The scheduler's runner: ``rlmesh.run`` of ``units``' seeds (padded to whole rounds
    of the endpoint's lanes) on ``address``; its episodes kept through ``done``, the
    shard recorded in ``book`` whether it ran or raised."""
    book.check_hooks()
    shard_seeds = pad([book.wanted[u] for u in units], endpoint.num_envs)
    recorder = Recorder(book, units, done)
    began = time.monotonic()
    error: str | None = None
    telemetry: tuple[Any, ...] = ()
    try:
        hooks = recorder if record_episodes or book.user_hooks is not None else None
        result = rlmesh.run(model, address, seeds=shard_seeds, hooks=hooks, **run_kwargs)
    except BaseException as exc:
        error = first_line(exc)
        if book.hook_error is not None:
            raise HookFailed(book.hook_error) from exc
        raise
    else:
        telemetry = tuple(result.telemetry)
        if hooks is None:  # not recorded as they ended: take them from the result
            for episode in result.episodes:
                recorder.take(episode, forward_it=False)
        book.advise(result.advisories)
    finally:
        book.add(
            ShardRun(
                endpoint.index,
                address,
                tuple(shard_seeds),
                recorder.kept,
                error,
                telemetry,
                time.monotonic() - began,
            )
        )
