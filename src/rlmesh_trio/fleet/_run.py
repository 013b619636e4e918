"""``Fleet.run``: one rlmesh evaluation sharded over the endpoints, merged back."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from .._errors import first_line
from .._tls import TlsSetting
from ._records import EndpointStatus, FleetError, FleetRunResult, Health, ShardRun
from ._scheduler import Abort, Done, Host, schedule


class RunFleet(Protocol):
    """What the run needs of the fleet's public face (its scheduling goes through a
    :class:`._scheduler.Host`)."""

    @property
    def auth_token(self) -> str | None: ...

    @property
    def tls(self) -> TlsSetting: ...

    def health(self, timeout_seconds: float = ...) -> list[Health]: ...


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


def _renumber(episode: Any, position: int) -> Any:
    """An EpisodeResult with ``index`` (and ``trial``, when set) as the fleet ordinal."""
    trial = episode.trial
    return replace(episode, index=position, trial=None if trial is None else position)


def run(
    fleet: RunFleet,
    host: Host,
    model: Any,
    *,
    seeds: Sequence[int],
    retries: int,
    recover_timeout_seconds: float,
    record_episodes: bool,
    run_kwargs: Mapping[str, Any],
) -> FleetRunResult:
    """:meth:`Fleet.run <rlmesh_trio.fleet.Fleet.run>` (documented there): the seeds
    sharded over ``fleet``'s endpoints, scheduled on ``host``, merged."""
    run_kwargs = dict(run_kwargs)
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
    lanes = [h.num_envs or 1 for h in serving] or [1]
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
        def __init__(self, units: list[int], done: Done) -> None:
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

    def runner(address: str, endpoint: EndpointStatus, units: list[int], done: Done) -> None:
        if hook_error:
            raise _HookFailed(hook_error[0])
        shard_seeds = _pad([wanted[u] for u in units], endpoint.num_envs)
        recorder = Recorder(units, done)
        began = time.monotonic()
        error: str | None = None
        telemetry: tuple[Any, ...] = ()
        try:
            hooks = recorder if record_episodes or user_hooks is not None else None
            result = rlmesh.run(model, address, seeds=shard_seeds, hooks=hooks, **run_kwargs)
        except BaseException as exc:
            error = first_line(exc)
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

    outcome = schedule(
        host,
        tasks,
        runner,
        retries=retries,
        recover_timeout_seconds=recover_timeout_seconds,
        split=True,
        owners=owners if serving else None,
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


class _HookFailed(Abort):
    """A user hook raised: the whole fleet run stops (never retried)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"a hook raised {type(error).__name__}: {error}")
        self.error = error
