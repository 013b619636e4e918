"""A dataset that says what it holds, and keeps what was written when a write fails.

Minari's HDF5 storage keeps every episode in one file (``main_data.hdf5``), and HDF5 has
no journal: a write that fails half way (a full disk, a file-size limit, the storage
child killed) can leave the file's structure broken, and ``minari.load_dataset`` then
fails on the whole dataset, the episodes written long before included. Three guards:

* **Room first** (:func:`check_room`, before each batch, where it is written): the
  batch's bytes (its arrays, a quarter more, and a fixed cost per array for HDF5's
  object headers) must fit in the space the file system has free for us and under the
  process's file-size limit (``RLIMIT_FSIZE``); else :class:`NoRoom` is raised *before*
  the file is opened, and the file stays as it was.
* **Salvage after a failure** (:func:`salvage`, by the writer at its close, only when it
  failed): the file is checked episode by episode (every dataset of every group read at
  its last element, which is where a cut-short write shows); the episodes
  ``0 .. K-1`` that read whole are the dataset. When the file holds anything else
  (a batch's groups written but not counted, a broken group), those K episodes are
  copied into a new file that replaces the old one (written aside, then renamed: the
  old file is untouched until the new one is whole). Minari's totals are set to what
  the file holds.
* **What it holds, said** (:func:`seal`): ``metadata.json`` gets ``"rlmesh_trio"``:
  ``complete`` (false when the writer failed, in this run or an earlier one that wrote
  it), ``episodes_in_dataset``, ``episodes_played`` (every episode a recorded lane
  finished or cut, written or not, over every run), ``runs`` (the server runs that wrote
  it) and ``error`` (why it is incomplete). Written aside and renamed, never in place (a
  full disk must not empty the file Minari reads first).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

try:
    import resource
except ImportError:  # (Windows: no file-size limit to honour)
    resource = None  # type: ignore[assignment]

__all__ = [
    "MAIN_FILE",
    "SEAL_KEY",
    "NoRoom",
    "check_room",
    "salvage",
    "seal",
]

MAIN_FILE = "main_data.hdf5"
METADATA_FILE = "metadata.json"
SEAL_KEY = "rlmesh_trio"

LEAF_OVERHEAD = 6 << 10
"""Bytes reckoned per stored array of an episode beyond its data (HDF5's object header
and B-tree entries; measured: a CartPole episode of 50 steps, 2 KiB of data in 6 arrays,
grows the file by 15-17 KiB, with two info arrays 23-28 KiB)."""
BATCH_SLACK = 64 << 10
"""Bytes kept free beyond a batch's reckoning: Minari's metadata.json and ours."""


class NoRoom(OSError):
    """A batch that does not fit (refused before the file is opened: nothing written)."""


def _sizes(value: Any) -> tuple[int, int]:
    """(bytes, arrays) of a stored value: a mapping's or a sequence's leaves (a Dict or
    Tuple space, an info dict), a list of strings (one array), or one array."""
    if value is None:
        return 0, 0
    if isinstance(value, Mapping):
        found = [_sizes(v) for v in value.values()]
        return sum(b for b, _ in found), sum(n for _, n in found)
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            return sum(len(v) for v in value), 1  # a string leaf, stored as one array
        if value and all(isinstance(v, (Mapping, list, tuple, np.ndarray)) for v in value):
            found = [_sizes(v) for v in value]
            return sum(b for b, _ in found), sum(n for _, n in found)
    try:
        return int(np.asarray(value).nbytes), 1
    except (ValueError, TypeError):  # ragged: reckon its elements
        found = [_sizes(v) for v in value]
        return sum(b for b, _ in found), max(1, sum(n for _, n in found))


def batch_bytes(buffers: Iterable[Any]) -> int:
    """What a batch of Minari ``EpisodeBuffer``s needs on disk, at most (reckoned)."""
    total = BATCH_SLACK
    for buffer in buffers:
        for name in ("observations", "actions", "rewards", "terminations", "truncations", "infos"):
            size, arrays = _sizes(getattr(buffer, name))
            total += size + size // 4 + arrays * LEAF_OVERHEAD
        total += LEAF_OVERHEAD  # the episode's group
    return total


def room_for(file: Path) -> int:
    """Bytes ``file`` may still grow by: the file system's free space for us, and the
    process's file-size limit."""
    room = shutil.disk_usage(file.parent).free  # what an unprivileged writer may use
    if resource is None:
        return room
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit != resource.RLIM_INFINITY:
        size = file.stat().st_size if file.exists() else 0
        room = min(room, max(0, limit - size))
    return room


def check_room(data_path: Path, buffers: list[Any]) -> None:
    """Raise :class:`NoRoom` unless the batch fits (see the module's docstring)."""
    file = data_path / MAIN_FILE
    try:
        needed = batch_bytes(buffers)
    except Exception:  # a reckoning never fails a write: unreckoned, it is tried
        return
    room = room_for(file)
    if needed > room:
        raise NoRoom(
            f"no room for the next {len(buffers)} episode(s) in {file}: they need up to "
            f"{needed / 2**20:.1f} MiB, {room / 2**20:.1f} MiB can still be written there "
            f"(free space, or the file-size limit); nothing of them was written"
        )


def _whole(group: Any) -> bool:
    """Every dataset under ``group`` readable at its last element."""
    import h5py

    ok = True

    def visit(_name: str, item: Any) -> None:
        nonlocal ok
        if ok and isinstance(item, h5py.Dataset) and item.shape and item.shape[0]:
            item[-1]

    try:
        group.visititems(visit)
    except Exception:
        ok = False
    return ok


def _readable_prefix(file: Path) -> tuple[int, int, int, bool]:
    """(K, their steps, groups in the file, whether the file holds exactly them): the
    episodes 0..K-1 that read whole."""
    import h5py

    with h5py.File(file, "r") as handle:
        names = set(handle.keys())
        count = steps = 0
        while f"episode_{count}" in names:
            group = handle[f"episode_{count}"]
            if not _whole(group):
                break
            steps += int(group.attrs.get("total_steps", 0))
            count += 1
        exact = names == {f"episode_{i}" for i in range(count)}
    return count, steps, len(names), exact


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    aside = path.with_name(path.name + ".rlmesh-trio-new")
    with open(aside, "w") as out:
        json.dump(value, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(aside, path)


def salvage(data_path: Path) -> tuple[int, int, str]:
    """Make the dataset at ``data_path`` hold the episodes that read whole (see the
    module's docstring): (episodes, steps, what was done). Raises ``OSError`` when the
    file cannot be opened at all, or the rewrite fails (the old file is kept then)."""
    import h5py

    file = data_path / MAIN_FILE
    if not file.exists() or file.stat().st_size == 0:  # Minari makes it at the first write
        count, steps, groups, exact = 0, 0, 0, True
    else:
        count, steps, groups, exact = _readable_prefix(file)
    if exact:
        done = f"the file holds {count} whole episodes"
    else:
        aside = file.with_name(file.name + ".rlmesh-trio-salvage")
        try:
            with h5py.File(file, "r") as old, h5py.File(aside, "w", track_order=True) as new:
                for key, value in old.attrs.items():
                    new.attrs[key] = value
                for i in range(count):
                    old.copy(old[f"episode_{i}"], new, name=f"episode_{i}")
            with open(aside, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(aside, file)
        finally:
            with contextlib.suppress(FileNotFoundError):
                aside.unlink()
        done = f"{groups - count} broken or uncounted episode group(s) dropped, {count} kept"
    metadata_file = data_path / METADATA_FILE
    metadata = json.loads(metadata_file.read_text())
    if metadata.get("total_episodes") != count or metadata.get("total_steps") != steps:
        metadata.update(total_episodes=count, total_steps=steps)
        _write_json(metadata_file, metadata)
    return count, steps, done


def seal(
    data_path: Path, *, played: int, error: str | None, before: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Say in ``metadata.json`` what the dataset holds (see the module's docstring);
    ``before``: what it said of the earlier runs that wrote it (appending), which this
    run's figures add to."""
    metadata_file = data_path / METADATA_FILE
    metadata = json.loads(metadata_file.read_text())
    prior = dict(before or {})
    held = int(metadata.get("total_episodes", 0))
    said: dict[str, Any] = {
        "complete": error is None and bool(prior.get("complete", True)),
        "episodes_in_dataset": held,
        "episodes_played": max(int(prior.get("episodes_played", 0)) + played, held),
        "runs": int(prior.get("runs", 0)) + 1,
    }
    if error is not None:
        said["error"] = error
    elif "error" in prior:  # an earlier run's loss stays said
        said["error"] = prior["error"]
    metadata[SEAL_KEY] = said
    _write_json(metadata_file, metadata)
    return said
