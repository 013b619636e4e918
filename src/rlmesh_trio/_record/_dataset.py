"""Finished episodes into a Minari dataset, with Minari's own storage and without jax.

:class:`DatasetWriter` creates the dataset when it is made (so a clash or a bad id is a
startup error), under Minari's root (``MINARI_DATASETS_PATH``, else ``~/.minari/datasets``),
through ``minari.dataset.minari_storage.MinariStorage``: the class Minari's own
``create_dataset_from_buffers`` uses, called here directly because that function makes an
instance of the env to learn its spaces (we have them from the contract, and the writer
never touches an env). Episodes go in as ``minari.data_collector.EpisodeBuffer`` built
from plain arrays (:func:`~rlmesh_trio._record._episode.stack`); ``DataCollector`` and
``EpisodeBuffer.add_step_data`` are never used: they need jax.

What is stored, per episode (``minari.load_dataset(ID)[i]`` and
``dataset.storage.get_episode_metadata([i])``):

* observations (N+1), actions (N), rewards, terminations, truncations, as the env saw and
  produced them; images lossless (``jpeg_encoding=False``);
* in the episode's metadata: ``seed`` (absent when the client sent none: Minari's own
  convention), ``lane``, ``lane_episode`` (the lane's episode counter), and ``cut`` (why the
  server ended it) on a cut episode, ``infos_dropped`` (why) when its infos were dropped;
* infos, with ``record_infos``: the reset's info and each step's, stacked per key. Minari
  requires one structure at every step (``DataCollector`` fails the recording otherwise);
  here an episode whose infos change structure (keys, a leaf's dtype or shape) or hold a
  leaf Minari cannot store (None, an object) keeps its data but loses its infos, with one
  warning per writer (the rest counted in :attr:`DatasetWriter.infos_dropped`);
* on a cut episode, ``infos["rlmesh_trio_cut"]``: N+1 strings, empty but the last, which
  says why (``lane_fault``, ``session_close``, ``server_stop``, ``reset``).

The dataset's spaces are the contract's; its env spec is the gymnasium id's registered
spec with the served kwargs, so ``dataset.recover_environment()`` makes the same env.

Each batch the writer takes (every episode queued since the last) is one
``update_episodes`` call: an HDF5 file opened, written, closed (flushed), and Minari's
metadata.json rewritten with the new totals. A batch that would not fit (free space, the
file-size limit) is refused before the file is touched; after any failure the writer's
close keeps the episodes that read whole and says in metadata.json what the dataset
holds (:mod:`._seal`). A crash of the whole server loses the episodes not yet written,
and one in the middle of a write may leave that HDF5 file unreadable (HDF5 has no
journal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec

from ._child import StorageChild
from ._continue import exists_error, lock_dataset, open_to_continue
from ._episode import Episode, check_space
from ._seal import SEAL_KEY, salvage, seal
from ._store import store_batch
from ._worker import BoundedWorker, RecordingError

if TYPE_CHECKING:
    from minari.dataset.minari_storage import MinariStorage

__all__ = ["DatasetWriter", "dataset_path", "env_spec_for"]

logger = logging.getLogger("rlmesh_trio.record")


CHILD_RECYCLE_EPISODES = 10_000
"""Episodes a storage child writes before a fresh one replaces it (see
:meth:`DatasetWriter._recycle_child`; a start costs ~0.5 s)."""
CHILD_RSS_GROWTH = 64 << 20
"""Bytes a storage child may grow past its size after its first batch before a fresh
one replaces it (Linux: its /proc/PID/statm)."""

CHILD_START_TIMEOUT = 60.0
"""Seconds the storage child may take to start (an interpreter, minari and h5py imported:
~0.4 s here) before the dataset writer gives up: a startup error."""

INSTALL_HINT = (
    "dataset recording needs minari with h5py: the record extra (pip install '.[record]' "
    "from a clone, or the wheel's [record])"
)


def _import_minari() -> Any:
    try:
        import h5py  # noqa: F401  (Minari's HDF5 storage imports it lazily: fail here)
        import minari
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return minari


def dataset_path(dataset_id: str) -> Path:
    """Where Minari keeps ``dataset_id``: ``$MINARI_DATASETS_PATH/ID`` or
    ``~/.minari/datasets/ID``."""
    _import_minari()
    from minari.storage.datasets_root_dir import get_dataset_path

    return Path(get_dataset_path(dataset_id))


def env_spec_for(env_id: str, kwargs: Mapping[str, Any] | None = None) -> EnvSpec:
    """The registered spec of ``env_id`` with ``kwargs`` over its own (no env is made)."""
    import gymnasium

    spec = gymnasium.spec(env_id)
    if not kwargs:
        return spec
    return dataclasses.replace(spec, kwargs={**spec.kwargs, **dict(kwargs)})


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class DatasetWriter:
    """A Minari dataset ``dataset_id`` that finished :class:`Episode` objects go into,
    written on one thread of its own (:class:`~rlmesh_trio._record._worker.BoundedWorker`).

    ``put`` is the sink for an :class:`~rlmesh_trio._record._episode.EpisodeAccumulator`;
    it blocks while ``capacity`` episodes wait. ``close`` writes what is queued and
    raises the writer's error, if any. ``linger``: how long the writer waits for a
    quarter of ``capacity`` episodes before it writes what it has (Minari's HDF5 storage
    costs about 1.7 ms of CPU per episode written alone, 0.6 ms in batches of 16).
    ``prepare`` turns each queued episode into the one
    written, on the writer's thread (the server queues wire forms and decodes them there).
    ``own_process``: the writer's thread prepares each batch and a child process of its
    own stores it (:mod:`~rlmesh_trio._record._child`: Minari's HDF5 work off this
    process's GIL; the server's choice). ``append``: an existing dataset of the same env
    and spaces is continued (:mod:`._continue`), its episodes untouched; without it an
    existing one is a ``FileExistsError``. The writer holds the dataset's lock for its
    life. Made on any thread; never touches an env."""

    def __init__(
        self,
        dataset_id: str,
        observation_space: spaces.Space[Any],
        action_space: spaces.Space[Any],
        *,
        env_spec: EnvSpec | None = None,
        record_infos: bool = False,
        capacity: int = 64,
        linger: float = 0.0,
        description: str | None = None,
        on_batch: Callable[[int, int], None] | None = None,
        prepare: Callable[[Episode], Episode] | None = None,
        own_process: bool = False,
        append: bool = False,
    ) -> None:
        minari = _import_minari()
        from minari.dataset.minari_dataset import parse_dataset_id
        from minari.dataset.minari_storage import MinariStorage
        from minari.namespace import create_namespace, list_local_namespaces

        check_space(observation_space, "observation_space")
        check_space(action_space, "action_space")
        namespace, _, _ = parse_dataset_id(dataset_id)  # ValueError names the form
        root = dataset_path(dataset_id)
        if root.exists() and not append:
            raise exists_error(dataset_id, root)
        if namespace is not None and namespace not in list_local_namespaces():
            create_namespace(namespace)
        existed = root.exists()
        self._storage: MinariStorage
        self._lock = lock_dataset(root, dataset_id)  # one writer at a time
        try:
            data = root / "data"
            self._before: dict[str, Any] | None = None
            """What the dataset's metadata said of earlier runs (appending), else None."""
            if existed:
                self._storage, count, self._before = open_to_continue(
                    dataset_id, root, observation_space, action_space, env_spec
                )
            else:
                data.mkdir(parents=True)
                self._storage = MinariStorage.new(
                    data,
                    observation_space=observation_space,
                    action_space=action_space,
                    env_spec=env_spec,
                    data_format="hdf5",
                    jpeg_encoding=False,
                )
                self._storage.update_metadata(
                    {
                        "dataset_id": dataset_id,
                        "minari_version": minari.__version__,
                        "description": description or "Episodes served by rlmesh-trio, per lane.",
                    }
                )
                count = 0
        except BaseException:
            self._lock.close()
            raise
        self.dataset_id = dataset_id
        self.observation_space = observation_space
        self.action_space = action_space
        self.record_infos = record_infos
        self.path = root
        self.episodes_before = count
        """The episodes the dataset held when this writer opened it (0: a new one)."""
        self._data = data
        self._prepare = prepare
        self._size = _tree_size(data)
        self._next_id = count
        self.episodes_written = 0
        self.steps_written = 0
        self.episodes_queued = 0
        """Episodes put (written, waiting, or refused by a failed writer)."""
        self.children_recycled = 0
        """Storage children replaced by a fresh one (:meth:`_recycle_child`)."""
        self._counting = threading.Lock()
        self.infos_dropped = 0
        """Episodes whose infos were dropped (their structure varied)."""
        self.own_process = own_process
        self._child: StorageChild | None = None
        self._worker: BoundedWorker[Episode] = BoundedWorker(
            f"rlmesh-trio-dataset[{dataset_id}]",
            self._write,
            capacity=capacity,
            on_batch=on_batch,
            linger=linger,
            batch=max(1, capacity // 4),
            start=self._start_child if own_process else None,
            finish=self._finish,
        )
        if own_process:  # the child's startup errors are the writer's, raised here
            started = self._worker.started.wait(CHILD_START_TIMEOUT)
            error = self._worker.error
            if not started or error is not None:
                with contextlib.suppress(RecordingError):
                    self._worker.close(CHILD_START_TIMEOUT)
                self._lock.close()
                raise RecordingError(
                    "the dataset's storage process did not start: "
                    + (repr(error) if error is not None else f"not within {CHILD_START_TIMEOUT} s")
                ) from error

    # -- the lane's side ------------------------------------------------------------

    def put(self, episode: Episode) -> None:
        """Queue a finished episode (blocks while the queue is full)."""
        with self._counting:
            self.episodes_queued += 1
        self._worker.put(episode)

    def close(self, timeout: float | None = None, *, unrecorded: int = 0) -> None:
        """Write every queued episode, stop the writer, say in the dataset's metadata
        what it holds (:mod:`._seal`; ``unrecorded``: episodes the lanes played and did
        not queue, having stopped recording), raise the writer's error if it failed.
        A writer still writing after ``timeout`` has its storage child killed (the
        writer then ends too: nothing is left waiting on it). After a failure the file
        keeps the episodes that read whole (:func:`~._seal.salvage`)."""
        played = self.episodes_queued + unrecorded
        try:
            self._worker.close(timeout)
        except RecordingError as exc:
            if self._worker.alive and self._child is not None:
                self._child.kill()
            try:
                kept = self._after_failure(exc, played)
            finally:
                if not self._worker.alive:  # (a wedged write keeps the dataset locked)
                    self._lock.close()
            raise RecordingError(f"{exc}; {kept}") from exc
        try:
            with contextlib.suppress(OSError):  # (a full disk: the dataset is whole anyway)
                seal(self._data, played=played, error=None, before=self._before)
        finally:
            self._lock.close()

    def _after_failure(self, exc: RecordingError, played: int) -> str:
        """The dataset made to hold what reads whole and say so; what it keeps, in words."""
        error = str(exc)
        kept = f"the dataset {self.dataset_id} at {self.path}"
        if self._worker.alive:  # a write wedged in this process: the file is not ours
            error += "; its file was not checked (a write was still under way)"
        else:
            try:
                count, _steps, done = salvage(self._data)
            except Exception as salvage_exc:
                error += f"; its file could not be checked: {salvage_exc!r}"
                logger.error("dataset %s: after the failure: %r", self.dataset_id, salvage_exc)
            else:
                kept += f" keeps {count - self.episodes_before} of the {played} episodes played"
                if self.episodes_before:
                    kept += f" here (and the {self.episodes_before} it held before)"
                logger.warning("dataset %s: after the failure: %s", self.dataset_id, done)
        try:
            seal(self._data, played=played, error=error, before=self._before)
        except OSError as seal_exc:
            return f"{kept}; its metadata could not say it is incomplete ({seal_exc})"
        return f"{kept}, marked incomplete in its metadata.json ({SEAL_KEY}.complete: false)"

    # -- counters (for the metrics) -------------------------------------------------

    @property
    def depth(self) -> int:
        return self._worker.depth

    @property
    def bytes_written(self) -> int:
        """How much the dataset's files grew since it was created."""
        return self._worker.bytes_written

    @property
    def worker(self) -> BoundedWorker[Episode]:
        return self._worker

    # -- the writer's thread --------------------------------------------------------

    def _write(self, batch: list[Episode]) -> int:
        first = self._next_id
        if self._child is not None:
            steps, dropped = self._child.write(batch, first)
        else:
            steps, dropped = store_batch(self._storage, self._prepare, batch, first)
        for lane, index, reason in dropped:
            if self.infos_dropped == 0:
                logger.warning(
                    "dataset %s: lane %d episode %d: infos not recorded (%s); Minari "
                    "needs one info structure per episode. The episode's data is kept; "
                    "later such episodes are only counted (infos_dropped)",
                    self.dataset_id,
                    lane,
                    index,
                    reason,
                )
            self.infos_dropped += 1
        self._next_id += len(batch)
        self.episodes_written += len(batch)
        self.steps_written += steps
        size = _tree_size(self._data)
        grown, self._size = size - self._size, size
        if self._child is not None:  # (after the counters: this batch is written)
            self._recycle_child(len(batch))
        return grown

    def _start_child(self) -> None:
        """The writer's thread, first: its storage child (which dies with this thread)."""
        self._child = StorageChild((self._storage, self._prepare), f"dataset {self.dataset_id}")
        self._child_episodes = 0
        self._child_rss: int | None = None

    def _recycle_child(self, written: int) -> None:
        """After a batch: a child that wrote :data:`CHILD_RECYCLE_EPISODES` episodes, or
        grew :data:`CHILD_RSS_GROWTH` bytes past its size after its first batch, is
        replaced by a fresh one (between batches: nothing is in flight), so the storage
        process's memory stays bounded over a recording of any length (HDF5's and
        Minari's per-file state grows with every episode written)."""
        assert self._child is not None
        self._child_episodes += written
        rss = self._child.rss()
        if self._child_rss is None:
            self._child_rss = rss
        grown = rss is not None and self._child_rss is not None and rss - self._child_rss
        if self._child_episodes >= CHILD_RECYCLE_EPISODES or (grown and grown > CHILD_RSS_GROWTH):
            self._child.close()
            self.children_recycled += 1
            self._start_child()

    def _finish(self) -> None:
        """The writer's thread ends: its storage child, if any, exits."""
        if self._child is not None:
            self._child.close()
