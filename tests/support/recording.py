"""What the recording tests share: the skip for envs whose ``rgb_array`` frames need
pygame, a private Minari root per test, a dataset's episode metadata, and the replay
check (recorded actions on a fresh env reproduce the recorded observations)."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

__all__ = [
    "NEEDS_PYGAME",
    "episode_metadata",
    "private_minari_root",
    "put_blocked",
    "replay_equal",
    "storage_children",
]

NEEDS_PYGAME = pytest.mark.skipif(
    importlib.util.find_spec("pygame") is None,
    reason="rgb_array rendering of classic-control envs needs pygame (not installed)",
)


def private_minari_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point Minari (``MINARI_DATASETS_PATH``) at a fresh directory under ``tmp_path``
    and return it, so that no test reads or writes the user's datasets."""
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root


def episode_metadata(dataset: Any) -> list[dict[str, Any]]:
    return list(dataset.storage.get_episode_metadata(range(dataset.total_episodes)))


def replay_equal(env: gym.Env[Any, Any], seed: int | None, actions: Any, observations: Any) -> bool:
    """Reset ``env`` with ``seed``, take ``actions``: every observation equal, bit for bit."""

    def same(a: Any, b: Any) -> bool:
        if isinstance(b, dict):
            return all(same(a[k], b[k]) for k in b)
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()

    def at(tree: Any, i: int) -> Any:
        return {k: at(v, i) for k, v in tree.items()} if isinstance(tree, dict) else tree[i]

    obs, _ = env.reset(seed=seed)
    if not same(obs, at(observations, 0)):
        return False
    for i in range(len(actions)):
        obs, *_ = env.step(at(actions, i))
        if not same(obs, at(observations, i + 1)):
            return False
    return True


class _Signalling(threading.Condition):
    """A worker's not-full condition that says when a put waits on it while the writer
    holds a batch (items put, neither written nor queued)."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker._lock)
        self.worker = worker
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        w = self.worker
        if w.items_put - w.items_written - len(w._items) > 0:  # the lock is held here
            self.waiting.set()
        return super().wait(timeout)


def put_blocked(worker: Any) -> threading.Event:
    """An event set once a ``put`` on ``worker`` (a ``BoundedWorker``) waits for room
    while its writer holds a batch: the backpressure seen as it happens, not polled for
    (a put that waits before the writer took its first batch does not count)."""
    signalling = _Signalling(worker)
    worker._not_full = signalling
    return signalling.waiting


def storage_children(parent: int) -> list[int]:
    """The dataset storage children of process ``parent`` (``python -m
    rlmesh_trio._recordchild``), from /proc (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"rlmesh_trio._recordchild" in cmdline:
            found.append(int(stat.parent.name))
    return found
