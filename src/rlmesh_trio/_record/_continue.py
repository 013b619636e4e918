"""A dataset that goes on across restarts (``--record-append``), and one writer at a time.

An endpoint restarted by Ray, Kubernetes or a person records into the dataset it wrote
before: :func:`open_to_continue` opens it with Minari's own storage, refuses it clearly
when it is not one this server can continue (not Minari's HDF5 format, another env, other
spaces), makes its file hold exactly the episodes that read whole (an earlier run killed
mid-write: :func:`~._seal.salvage`) and returns it with the count its new episodes
follow. Episodes already written are never changed: new ones are added after them
(``episode_<count>`` on), each batch reckoned against the room left first.

:func:`lock_dataset`: every writer holds an exclusive lock on its dataset
(``<dataset>/.rlmesh-trio.lock``, ``flock``) for its life, so two servers never write
one file (HDF5 has no concurrent writers): the second is refused at its start, naming
the dataset.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec

from ._seal import SEAL_KEY, salvage

try:
    import fcntl
except ImportError:  # (Windows: no advisory locks here; one writer is the user's care)
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from minari.dataset.minari_storage import MinariStorage

__all__ = ["LOCK_FILE", "exists_error", "lock_dataset", "open_to_continue"]

LOCK_FILE = ".rlmesh-trio.lock"


def exists_error(dataset_id: str, root: Path) -> FileExistsError:
    return FileExistsError(
        f"a Minari dataset {dataset_id!r} already exists at {root}: continue it with "
        f"--record-append (record_append=True), choose another id (e.g. bump its -vN) or "
        f"delete it (`minari delete {dataset_id}`)"
    )


def lock_dataset(root: Path, dataset_id: str) -> IO[str]:
    """Hold ``root``'s writer lock (the returned file; closing it releases the lock)."""
    root.mkdir(parents=True, exist_ok=True)
    handle = open(root / LOCK_FILE, "a+")  # noqa: SIM115 - held for the writer's life
    if fcntl is None:
        return handle
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RuntimeError(
            f"the Minari dataset {dataset_id!r} at {root} is being written by {holder}: "
            f"one writer at a time"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"rlmesh-trio pid {os.getpid()}\n")
    handle.flush()
    return handle


def _refuse(dataset_id: str, root: Path, why: str) -> ValueError:
    return ValueError(f"cannot continue the Minari dataset {dataset_id!r} at {root}: {why}")


def _spec_of(value: Any) -> tuple[str, dict[str, Any]] | None:
    """(id, kwargs) of a stored or given env spec (None: none)."""
    if value is None:
        return None
    spec = EnvSpec.from_json(value) if isinstance(value, str) else value
    return spec.id, dict(spec.kwargs)


def open_to_continue(
    dataset_id: str,
    root: Path,
    observation_space: spaces.Space[Any],
    action_space: spaces.Space[Any],
    env_spec: EnvSpec | None,
) -> tuple[MinariStorage, int, dict[str, Any]]:
    """(the storage, the episodes it holds, what its metadata said of earlier runs)."""
    from minari.dataset.minari_storage import MinariStorage

    data = root / "data"
    try:
        metadata = MinariStorage.read_raw_metadata(data)
    except ValueError as exc:
        raise _refuse(dataset_id, root, str(exc)) from None
    if metadata.get("data_format") != "hdf5":
        raise _refuse(dataset_id, root, f"its format is {metadata.get('data_format')!r}, not hdf5")
    try:
        storage = MinariStorage.read(data)
    except Exception as exc:
        raise _refuse(dataset_id, root, f"Minari cannot read it: {exc!r}") from None
    for name, theirs, ours in (
        ("observation space", storage.observation_space, observation_space),
        ("action space", storage.action_space, action_space),
    ):
        if theirs != ours:
            raise _refuse(dataset_id, root, f"its {name} is {theirs}, the served env's is {ours}")
    theirs_spec = _spec_of(metadata.get("env_spec"))
    ours_spec = _spec_of(env_spec)
    if theirs_spec != ours_spec:
        raise _refuse(
            dataset_id,
            root,
            f"it was recorded from env {json.dumps(theirs_spec)}, this server serves "
            f"{json.dumps(ours_spec)} (id, kwargs)",
        )
    try:
        count, _steps, _done = salvage(data)
    except Exception as exc:
        raise _refuse(dataset_id, root, f"its file does not read: {exc!r}") from None
    before = metadata.get(SEAL_KEY)
    if not isinstance(before, dict):  # written by Minari or an older rlmesh-trio
        before = {"complete": True, "episodes_played": count, "runs": 0}
    return MinariStorage.read(data), count, before
