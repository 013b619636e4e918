"""``Fleet.run``: one rlmesh evaluation sharded over the endpoints, merged back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .._tls import TlsSetting
from ._records import (
    Endpoint,
    FleetError,
    FleetRunResult,
    Health,
    ShardRun,
    _Abort,
    _Done,
    _Outcome,
    _renumber,
)


class Fleet(Protocol):
    """What ``run_fleet`` needs of a :class:`~rlmesh_trio.fleet.Fleet` (no import of
    ``_core``, which calls this module from ``Fleet.run``)."""

    @property
    def auth_token(self) -> str | None: ...

    @property
    def tls(self) -> TlsSetting: ...

    def health(self, timeout: float = ...) -> list[Health]: ...

    def _schedule(
        self,
        tasks: list[list[int]],
        runner: Callable[[str, Endpoint, list[int], _Done], None],
        retries: int,
        recover_timeout: float,
        *,
        split: bool,
        owners: Sequence[int] | None = None,
    ) -> _Outcome: ...


_REFUSED = {
    "episodes": "the fleet runs exactly one episode per seed; leave episodes out",
    "close_env": "close_env would shut the fleet's endpoints down",
    "view": "the live viewer is a single-session option",
}


def _check_seeds(seeds: Sequence[int]) -> list[int]:
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence):
        raise TypeError(f"seeds must be a sequence of ints, not {type(seeds).__name__}")
    checked = []
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"every seed must be an int >= 0, got {seed!r}")
        checked.append(int(seed))
    return checked


def _pad(seeds: list[int], lanes: int | None) -> list[int]:
    """``seeds`` filled to a multiple of ``lanes`` by repeating its own seeds (rlmesh
    runs seeds on a driver-reset vector env in whole rounds of ``num_envs``)."""
    if not lanes or len(seeds) % lanes == 0:
        return list(seeds)
    short = lanes - len(seeds) % lanes
    return [*seeds, *(seeds[i % len(seeds)] for i in range(short))]


def run_fleet(
    fleet: Fleet,
    model: Any,
    *,
    seeds: Sequence[int],
    retries: int = 2,
    recover_timeout: float = 60.0,
    record_episodes: bool = True,
    **run_kwargs: Any,
) -> FleetRunResult:
    """Evaluate ``model`` once per seed over the fleet and merge the results.

    The seeds are cut, in order, into one shard per serving endpoint (the first
    endpoint's shard holds the first seeds), in whole rounds of that endpoint's lanes
    (a short shard is filled up by repeating some of its seeds, and the extra episodes
    are discarded), and every endpoint runs its shard with its own
    :func:`rlmesh.run` (endpoints admit one session each), all at once, on one thread
    each. ``model`` is what ``rlmesh.run`` takes: a local ``rlmesh`` ``Model`` instance
    (borrowed by the concurrent runs, as ``rlmesh.run`` borrows it) or a ``Model``
    subclass (one built per run). ``run_kwargs`` go to every ``rlmesh.run``
    (``max_episode_steps``, ``hooks``, ``instruction``, ...).

    Finished episodes are recorded as they end (through rlmesh's ``RunHooks``), so when
    an endpoint fails mid-run only the seeds its run had not finished are queued again:
    on the same endpoint once it serves again (a Ray fleet waits for the restarted
    actor, at its new address), or on whichever endpoint is free first. A seed that
    failed ``retries + 1`` times, or seeds left with no endpoint to run them, raise
    :class:`FleetError` whose ``partial`` is the merged result of what finished.

    ``record_episodes=False`` trades that for speed: without hooks, rlmesh's runtime
    does not relay every step to Python (it decodes each observation and action for
    the hooks: about a quarter of the driver's time per step was measured), but a
    failed run's episodes are unknown, so its whole shard runs again. (A caller's own
    ``hooks`` turn the recording on anyway.) ``recover_timeout``: how long a failed
    endpoint may take to serve again before it is left out of this run.

    The result (:class:`FleetRunResult`, shaped like ``rlmesh.RunResult``) holds each
    seed's episode exactly once, in the order of ``seeds``, with ``index`` its position
    there; ``shards`` records every run made and ``retries`` every retry.

    A user's ``hooks`` sees ``on_run_start`` once per shard run, ``on_episode_start``
    and ``on_step`` of every episode run (calls from the endpoints' threads are
    serialized), ``on_episode_end`` once per kept episode, ``on_run_end`` once with
    the merged result (as an ``rlmesh.RunResult``).
    """
    try:
        import rlmesh
    except ImportError as exc:  # pragma: no cover - rlmesh is in the test extra
        raise ImportError(
            "Fleet.run drives rlmesh.run: pip install 'rlmesh[numpy]==0.1.0'"
        ) from exc
    for key, why in _REFUSED.items():
        if key in run_kwargs:
            raise TypeError(f"Fleet.run does not take {key}=: {why}")
    if run_kwargs.get("trial_index_base", 0) != 0:
        raise ValueError(
            "Fleet.run does not take trial_index_base: each shard's trial ordinals would "
            "restart at it; the merged episodes carry their position in seeds instead"
        )
    run_kwargs.pop("trial_index_base", None)
    if fleet.auth_token is not None:
        raise FleetError(
            "these endpoints require a bearer token and rlmesh 0.1.0's clients cannot "
            "send one: drive them with a token-capable client through Fleet.map, or "
            "serve them without a token on a network you trust"
        )
    if fleet.tls is not None and fleet.tls is not False:
        raise FleetError(
            "these endpoints serve TLS and rlmesh 0.1.0's clients cannot connect over TLS "
            "(tcp:// only): drive them with rlmesh_trio.client (VectorEnv(address, "
            "tls=fleet.tls)) through Fleet.map"
        )
    wanted = _check_seeds(seeds)
    user_hooks = run_kwargs.pop("hooks", None)
    if not wanted:
        empty = FleetRunResult()
        if user_hooks is not None:
            user_hooks.on_run_end(rlmesh.RunResult())
        return empty

    report = fleet.health()
    serving = [h for h in report if h.serving]
    if not serving and not any(h.status != "dead" for h in report):
        raise FleetError("every endpoint of the fleet is dead")
    lanes = [h.lanes or 1 for h in serving] or [1]
    rounds = -(-len(wanted) // sum(lanes))
    # Shard i is endpoint serving[i]'s first (contiguous seeds, in rounds of its lanes).
    tasks: list[list[int]] = []
    owners: list[int] = []
    start = 0
    for health, n in zip(serving, lanes, strict=False):
        size = n * rounds
        if start < len(wanted):
            tasks.append(list(range(start, min(start + size, len(wanted)))))
            owners.append(health.index)
        start += size
    if not serving:  # none answers yet: one task, for whichever endpoint comes up first
        tasks = [list(range(len(wanted)))]

    forward = threading.Lock()
    shards: list[ShardRun] = []
    discarded = [0]
    advisories: list[Any] = []
    hook_error: list[BaseException] = []

    class Recorder(rlmesh.RunHooks):
        def __init__(self, units: list[int], done: _Done) -> None:
            self.units = units
            self.done = done
            self.kept = 0

        def _forward(self, name: str, *args: Any, **kwargs: Any) -> None:
            if user_hooks is None:
                return
            with forward:
                try:
                    getattr(user_hooks, name)(*args, **kwargs)
                except BaseException as exc:
                    hook_error.append(exc)
                    raise

        def on_run_start(self, context: Any) -> None:
            self._forward("on_run_start", context)

        def on_episode_start(self, *, episode: int, seed: int | None) -> None:
            self._forward("on_episode_start", episode=episode, seed=seed)

        def on_step(self, event: Any) -> None:
            self._forward("on_step", event)

        def on_episode_end(self, result: Any) -> None:
            self.take(result, forward_it=True)

        def take(self, result: Any, *, forward_it: bool) -> None:
            for unit in self.units:
                if wanted[unit] == result.seed and self.done(unit, result):
                    self.kept += 1
                    if forward_it:
                        self._forward("on_episode_end", _renumber(result, unit))
                    return
            with forward:
                discarded[0] += 1

    def runner(address: str, endpoint: Endpoint, units: list[int], done: _Done) -> None:
        if hook_error:
            raise _HookFailed(hook_error[0])
        shard_seeds = _pad([wanted[u] for u in units], endpoint.lanes)
        recorder = Recorder(units, done)
        began = time.monotonic()
        error: str | None = None
        telemetry: tuple[Any, ...] = ()
        try:
            hooks = recorder if record_episodes or user_hooks is not None else None
            result = rlmesh.run(model, address, seeds=shard_seeds, hooks=hooks, **run_kwargs)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
            if hook_error:
                raise _HookFailed(hook_error[0]) from exc
            raise
        else:
            telemetry = tuple(result.telemetry)
            if hooks is None:  # not recorded as they ended: take them from the result
                for episode in result.episodes:
                    recorder.take(episode, forward_it=False)
            with forward:
                for advisory in result.advisories:
                    if advisory not in advisories:
                        advisories.append(advisory)
        finally:
            with forward:
                shards.append(
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

    outcome = fleet._schedule(
        tasks, runner, retries, recover_timeout, split=True, owners=owners if serving else None
    )
    episodes = tuple(_renumber(outcome.done[u], u) for u in sorted(outcome.done))
    merged = FleetRunResult(
        episodes=episodes,
        advisories=tuple(advisories),
        shards=tuple(shards),
        retries=tuple(outcome.retries),
        discarded=discarded[0],
    )
    if hook_error:
        raise hook_error[0]
    if user_hooks is not None:
        user_hooks.on_run_end(merged.as_run_result())
    if outcome.failed:
        missing = sorted(wanted[u] for u in outcome.failed)
        raise FleetError(
            f"{outcome.describe('seed')}; seeds not run: {missing}",
            partial=merged,
            retries=outcome.retries,
        ) from outcome.last_error
    return merged


class _HookFailed(_Abort):
    """A user hook raised: the whole fleet run stops (never retried)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"a hook raised {type(error).__name__}: {error}")
        self.error = error
