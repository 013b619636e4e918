"""``Fleet.run``: one rlmesh evaluation sharded over the endpoints, merged back.

:func:`run` checks what it was given, plans the first shards (:func:`shard`), has the
scheduler run them (each shard is ``_shard.run_shard``, writing to one ``RunBook``) and
merges the episodes in the order of ``seeds``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Protocol

from .._tls import TlsSetting
from ._records import FleetError, FleetRunResult, Health
from ._scheduler import Host, schedule


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


def _checked_kwargs(fleet: RunFleet, run_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``run_kwargs`` as ``rlmesh.run`` takes them on each shard; refuses what cannot
    be sharded, and endpoints rlmesh 0.1.0's clients cannot reach (a token, TLS)."""
    kwargs = dict(run_kwargs)
    for key, why in _REFUSED.items():
        if key in kwargs:
            raise TypeError(f"Fleet.run does not take {key}=: {why}")
    if kwargs.get("trial_index_base", 0) != 0:
        raise ValueError(
            "Fleet.run does not take trial_index_base: each shard's trial ordinals would "
            "restart at it; the merged episodes carry their position in seeds instead"
        )
    kwargs.pop("trial_index_base", None)
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
    return kwargs


def shard(serving: Sequence[Health], count: int) -> tuple[list[list[int]], list[int] | None]:
    """The first tasks of a run of ``count`` seeds (units ``0..count-1``) over the
    ``serving`` endpoints, and each task's owner: endpoint ``serving[i]`` first runs a
    contiguous slice of the seeds sized in whole rounds of its lanes, every endpoint the
    same number of rounds. With none serving yet: one task, no owner (whichever comes up
    first takes it)."""
    if not serving:
        return [list(range(count))], None
    lanes = [h.num_envs or 1 for h in serving]
    rounds = -(-count // sum(lanes))
    tasks: list[list[int]] = []
    owners: list[int] = []
    start = 0
    for health, n in zip(serving, lanes, strict=True):
        size = n * rounds
        if start < count:
            tasks.append(list(range(start, min(start + size, count))))
            owners.append(health.index)
        start += size
    return tasks, owners


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
    try:
        import rlmesh
    except ImportError as exc:  # pragma: no cover - rlmesh is in the test extra
        raise ImportError(
            "Fleet.run drives rlmesh.run: pip install 'rlmesh[numpy]==0.1.0'"
        ) from exc
    from ._shard import RunBook, renumber, run_shard

    kwargs = _checked_kwargs(fleet, run_kwargs)
    wanted = _check_seeds(seeds)
    user_hooks = kwargs.pop("hooks", None)
    if not wanted:
        if user_hooks is not None:
            user_hooks.on_run_end(rlmesh.RunResult())
        return FleetRunResult()

    report = fleet.health()
    serving = [h for h in report if h.serving]
    if not serving and not any(h.status != "dead" for h in report):
        raise FleetError("every endpoint of the fleet is dead")
    tasks, owners = shard(serving, len(wanted))
    book = RunBook(wanted, user_hooks)
    outcome = schedule(
        host,
        tasks,
        partial(run_shard, book, model, kwargs, record_episodes),
        retries=retries,
        recover_timeout_seconds=recover_timeout_seconds,
        split=True,
        owners=owners,
    )
    merged = FleetRunResult(
        episodes=tuple(renumber(outcome.done[u], u) for u in sorted(outcome.done)),
        advisories=tuple(book.advisories),
        shards=tuple(book.shards),
        retries=tuple(outcome.retries),
        discarded=book.discarded,
    )
    if book.hook_error is not None:
        raise book.hook_error
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
