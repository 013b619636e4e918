"""One batch of episodes into a Minari dataset's storage: what the dataset writer does
with each batch, on its thread or in its storage child (:mod:`._child`, which imports
this module, not the writer's).

:func:`store_batch` prepares each episode (decodes it from its wire form, when the server
queued it so), stacks it into Minari's ``EpisodeBuffer`` (the infos with it when they
keep one structure: :func:`stack_infos`; the cut mark, :data:`CUT_INFO_KEY`), and writes
the batch with its metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._episode import Episode, stack
from ._seal import check_room

if TYPE_CHECKING:
    from minari.dataset.minari_storage import MinariStorage

__all__ = ["CUT_INFO_KEY", "Dropped", "InfoMismatch", "stack_infos", "store_batch"]

CUT_INFO_KEY = "rlmesh_trio_cut"


class InfoMismatch(ValueError):
    """An episode's infos that Minari cannot store as one structure."""


def _signature(value: Any, where: str) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _signature(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, str):
        return "str"
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise InfoMismatch(f"{where} is {type(value).__name__} ({array.dtype}), not storable")
    return (array.dtype.str, array.shape)


def stack_infos(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """The reset's and each step's info as one dict of stacked leaves (a list of ``str``
    for string leaves). Raises :class:`InfoMismatch` when a step's structure differs from
    the reset's or a leaf cannot be stored."""
    reference = _signature(infos[0], "info")
    for i, info in enumerate(infos[1:], start=1):
        if _signature(info, "info") != reference:
            raise InfoMismatch(
                f"step {i}'s info has another structure than the reset's "
                f"({sorted(info)} vs {sorted(infos[0])})"
            )
    stacked: dict[str, Any] = _stack_tree(reference, infos)
    return stacked


def _stack_tree(signature: Any, values: list[Any]) -> Any:
    if isinstance(signature, dict):
        return {k: _stack_tree(sub, [v[k] for v in values]) for k, sub in signature.items()}
    if signature == "str":
        return list(values)
    return np.stack([np.asarray(v) for v in values])


Dropped = list[tuple[int, int, str]]
"""Episodes whose infos were not stored: (lane, lane episode, why)."""


def store_batch(
    storage: MinariStorage,
    prepare: Callable[[Episode], Episode] | None,
    batch: list[Episode],
    first: int,
) -> tuple[int, Dropped]:
    """Write ``batch`` (episode ids ``first``, ``first + 1``, ...) into ``storage``
    (:class:`~._seal.NoRoom` first, with nothing written, when it would not fit):
    each episode prepared (decoded from wire form), stacked into Minari's
    ``EpisodeBuffer``, its metadata beside it. Where it runs (the writer's thread, or the
    storage child) is the writer's choice. The steps written and the infos dropped."""
    from minari.data_collector.episode_buffer import EpisodeBuffer

    buffers = []
    metadatas: list[dict[str, Any]] = []
    dropped: Dropped = []
    steps = 0
    for episode in batch:
        if prepare is not None:
            episode = prepare(episode)
        metadata: dict[str, Any] = {"lane": episode.lane, "lane_episode": episode.index}
        infos = _episode_infos(episode, metadata)
        if "infos_dropped" in metadata:
            dropped.append((episode.lane, episode.index, metadata["infos_dropped"]))
        buffers.append(
            EpisodeBuffer(
                seed=episode.seed,
                observations=stack(storage.observation_space, episode.observations),
                actions=stack(storage.action_space, episode.actions),
                rewards=np.asarray(episode.rewards, dtype=np.float64),
                terminations=np.asarray(episode.terminations, dtype=np.bool_),
                truncations=np.asarray(episode.truncations, dtype=np.bool_),
                infos=infos,
            )
        )
        metadatas.append(metadata)
        steps += len(episode)
    check_room(Path(storage.data_path), buffers)  # NoRoom before the file is touched
    storage.update_episodes(buffers)
    storage.update_episode_metadata(metadatas, range(first, first + len(buffers)))
    return steps, dropped


def _episode_infos(episode: Episode, metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The infos stored with ``episode`` (its own, stacked, when they have one structure;
    the cut mark), and what ``metadata`` says of them."""
    infos: dict[str, Any] | None = None
    if episode.infos is not None:
        try:
            infos = stack_infos(episode.infos)
        except InfoMismatch as exc:
            metadata["infos_dropped"] = str(exc)
    if episode.cut is not None:
        metadata["cut"] = episode.cut
        infos = {} if infos is None else infos
        infos[CUT_INFO_KEY] = [""] * len(episode) + [episode.cut]
    return infos
