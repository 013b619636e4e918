"""Folding several lanes' results into one reply: timing fields (SPEC §8), info maps
(SPEC §5.3) and the conformance-warning entries (SPEC §3.7). Pure functions."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .._codec import Candidate
from .._jobs import Phases
from .._proto.rlmesh.spaces import v1 as spaces_v1

CONFORMANCE_KEY = "rlmesh.conformance.warning"

LANE_FAULT_KEY = "rlmesh_trio.lane_fault"
"""The info key of a step answered as a truncation because its lane faulted (policy
``truncate``): ``{"error": "<Type>: <message>", "lane": i, "rebuilt": true}``."""


def fold_phases(phases: Sequence[Phases]) -> tuple[Phases, int | None]:
    """Fold the phases of the lanes that served one operation; return them and lane skew.

    * ``decode_ns`` and ``encode_ns`` are summed: each lane decoded its own row and encoded
      its own result, and the reference's multi-lane replies carry values larger than any
      single lane's, consistent with a sum (SPEC §8.2).
    * ``user_ns`` is the **maximum** over the lanes, not the sum: the lanes run
      concurrently, so the slowest lane is the wall time the client waited for the env
      calls, and it is what the reference put on the wire (100.25 ms for lanes of
      10/40/100 ms, not 150 ms; SPEC §8.2, AMBIGUITIES.md item 2).
    * ``queue_ns`` is the maximum over the lanes (the longest mailbox wait).
    * ``lane_skew_ns`` is the slowest minus the fastest lane's ``user_ns``; it is ``None``
      (not emitted) for fewer than two lanes, or when the slowest lane measured 0.

    One lane's phases pass through unchanged; no lanes give ``(Phases(), None)``.
    """
    if len(phases) == 0:
        return Phases(), None
    if len(phases) == 1:
        return phases[0], None
    users = [p.user_ns for p in phases]
    slowest = max(users)
    folded = Phases(
        queue_ns=max(p.queue_ns for p in phases),
        decode_ns=sum(p.decode_ns for p in phases),
        user_ns=slowest,
        encode_ns=sum(p.encode_ns for p in phases),
    )
    skew = slowest - min(users) if slowest > 0 else None
    return folded, skew


_TRUE = spaces_v1.MetaValue(bool=True)
_FALSE = spaces_v1.MetaValue(bool=False)
"""The done flags of batched infos: shared by every reply (never changed once built)."""


def batch_infos(
    infos: Sequence[spaces_v1.MetaMap | None], done: Sequence[bool] | None
) -> spaces_v1.MetaMap | None:
    """Combine the info maps of the lanes of one reply (SPEC §5.3).

    One lane: its map, unchanged (the same object). Several lanes: ``{"final_info":
    [map, ...] in the given order, "_final_info": [bool, ...]}`` where the mask is ``done``
    (a step's ``terminated or truncated`` per lane) or all ``True`` when ``done`` is None
    (a reset). Every lane has an entry, also when its map is empty. No lanes: an empty map.
    Raises ``ValueError`` when ``done`` does not have one flag per info map. A lane
    whose env gave no info (None) has an empty map there; when no lane gave one, there
    are no infos (None), as the reference answers.
    """
    if done is not None and len(done) != len(infos):
        raise ValueError(f"batch_infos: {len(infos)} info maps but {len(done)} done flags")
    if len(infos) == 0:
        return spaces_v1.MetaMap()
    if len(infos) == 1:
        return infos[0]
    missing = sum(1 for info in infos if info is None)
    if missing:
        if missing == len(infos):
            return None
        infos = [spaces_v1.MetaMap() if info is None else info for info in infos]
    maps = spaces_v1.MetaList(items=[spaces_v1.MetaValue(map=info) for info in infos])
    mask = [True] * len(infos) if done is None else done
    flags = spaces_v1.MetaList(items=[_TRUE if flag else _FALSE for flag in mask])
    return spaces_v1.MetaMap(
        entries={
            "final_info": spaces_v1.MetaValue(list=maps),
            "_final_info": spaces_v1.MetaValue(list=flags),
        }
    )


def warning_value(cands: Iterable[Candidate]) -> spaces_v1.MetaValue:
    """The ``rlmesh.conformance.warning`` value: a list of {kind, path, detail} maps."""
    items = [
        spaces_v1.MetaValue(
            map=spaces_v1.MetaMap(
                entries={
                    "kind": spaces_v1.MetaValue(text=c.kind),
                    "path": spaces_v1.MetaValue(text=c.path),
                    "detail": spaces_v1.MetaValue(text=c.detail),
                }
            )
        )
        for c in cands
    ]
    return spaces_v1.MetaValue(list=spaces_v1.MetaList(items=items))
