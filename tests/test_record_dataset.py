"""Episodes of real gymnasium envs into a real Minari dataset (the ``record`` extra), read
back with ``minari.load_dataset``: returns, seeds, lanes, a bit-for-bit replay, every
space Minari stores, images lossless, cut episodes, infos, backpressure, errors, no jax."""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.wrappers import AddRenderObservation
from support.recording import (
    NEEDS_PYGAME,
    episode_metadata,
    private_minari_root,
    put_blocked,
    replay_equal,
)

minari = pytest.importorskip("minari")
pytest.importorskip("h5py")

from rlmesh_trio._record import (  # noqa: E402
    CUT_INFO_KEY,
    DatasetWriter,
    Episode,
    EpisodeAccumulator,
    RecordingError,
    env_spec_for,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def minari_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return private_minari_root(tmp_path, monkeypatch)


def play(
    env: gym.Env[Any, Any], acc: EpisodeAccumulator, seed: int | None, steps: int | None = None
) -> tuple[float, int]:
    """One episode with actions drawn from a generator seeded by ``seed``; its return and
    length. With ``steps``, stop after that many (the episode stays open)."""
    obs, info = env.reset(seed=seed)
    acc.reset(obs, seed, info)
    env.action_space.seed(seed)
    total, n = 0.0, 0
    while steps is None or n < steps:
        action = env.action_space.sample()
        obs, reward, terminated, truncated, info = env.step(action)
        total, n = total + float(reward), n + 1
        if acc.step(action, obs, float(reward), terminated, truncated, info) is not None:
            break
    return total, n


OWN_PROCESS = [False, pytest.param(True, id="storage-child")]
"""The writer's storage on its thread, or in a child process of its own (the server's)."""


@pytest.mark.parametrize("own_process", OWN_PROCESS)
def test_cartpole_episodes_load_with_minari_and_replay_bit_for_bit(own_process: bool) -> None:
    env = gym.make("CartPole-v1")
    writer = DatasetWriter(
        "rlmesh/cartpole-v0",
        env.observation_space,
        env.action_space,
        env_spec=env_spec_for("CartPole-v1"),
        own_process=own_process,
    )
    lanes = [
        EpisodeAccumulator(lane, env.observation_space, env.action_space, writer.put)
        for lane in range(2)
    ]
    played = []  # (lane, seed, return, length), in the order the episodes ended
    for seed in [*range(6), None]:
        lane = (seed or 0) % 2
        played.append((lane, seed, *play(env, lanes[lane], seed)))
    writer.close(60)
    assert writer.episodes_written == 7 and writer.bytes_written > 0
    assert writer.steps_written == sum(p[3] for p in played)

    dataset = minari.load_dataset("rlmesh/cartpole-v0")
    assert dataset.total_episodes == 7 and dataset.total_steps == writer.steps_written
    assert dataset.observation_space == env.observation_space
    assert dataset.action_space == env.action_space
    metadata = episode_metadata(dataset)
    for (lane, seed, total, length), episode, meta in zip(played, dataset, metadata, strict=True):
        assert float(episode.rewards.sum()) == total and len(episode) == length
        assert episode.observations.shape == (length + 1, 4)
        assert episode.observations.dtype == np.float32
        assert meta["lane"] == lane and meta.get("seed") == seed and "cut" not in meta
        if seed is not None:  # a replay with the recorded seed and actions
            assert replay_equal(
                gym.make("CartPole-v1"), seed, episode.actions, episode.observations
            )
    recovered = dataset.recover_environment()
    assert recovered.spec is not None and recovered.spec.id == "CartPole-v1"
    assert recovered.spec.max_episode_steps == 500
    recovered.close()


@NEEDS_PYGAME
@pytest.mark.parametrize("own_process", OWN_PROCESS)
def test_a_dict_observation_with_an_image_is_stored_losslessly(own_process: bool) -> None:
    env = AddRenderObservation(gym.make("CartPole-v1", render_mode="rgb_array"), render_only=False)
    assert isinstance(env.observation_space, spaces.Dict)
    writer = DatasetWriter(
        "pixels-v0",
        env.observation_space,
        env.action_space,
        env_spec=env.spec,
        own_process=own_process,
    )
    acc = EpisodeAccumulator(0, env.observation_space, env.action_space, writer.put)
    returns = [play(env, acc, seed, steps=6)[0] for seed in (11, 12)]
    assert acc.in_episode  # the last one still open: the server stops
    acc.cut("server_stop")
    writer.close(60)
    env.close()

    dataset = minari.load_dataset("pixels-v0")
    assert dataset.storage.jpeg_encoding is False
    first, second = dataset
    assert [float(first.rewards.sum()), float(second.rewards.sum())] == returns
    assert first.observations["pixels"].shape == (7, 400, 600, 3)
    # the first episode was cut by the reset of the second one
    assert [m.get("cut") for m in episode_metadata(dataset)] == ["reset", "server_stop"]
    # (not recover_environment(): gymnasium 1.1's AddRenderObservation spec names a
    # keyword its __init__ no longer takes)
    fresh = AddRenderObservation(
        gym.make("CartPole-v1", render_mode="rgb_array"), render_only=False
    )
    assert replay_equal(fresh, 11, first.actions, first.observations)
    fresh.close()


def test_every_space_minari_stores_round_trips() -> None:
    observation_space = spaces.Dict(
        {
            "box": spaces.Box(-2.0, 2.0, (3,), np.float64),
            "multi": spaces.MultiDiscrete([3, 5]),
            "binary": spaces.MultiBinary(6),
            "text": spaces.Text(6),
            "pair": spaces.Tuple((spaces.Discrete(4, start=1), spaces.Box(0, 9, (2,), np.int32))),
        }
    )
    action_space = spaces.Tuple((spaces.Discrete(3), spaces.Text(4)))
    observation_space.seed(3)
    action_space.seed(4)
    writer = DatasetWriter("spaces-v0", observation_space, action_space)
    acc = EpisodeAccumulator(5, observation_space, action_space, writer.put)
    observations = [observation_space.sample() for _ in range(5)]
    actions = [action_space.sample() for _ in range(4)]
    acc.reset(observations[0], 99)
    for i, action in enumerate(actions):
        acc.step(action, observations[i + 1], float(i), False, i == 3)
    writer.close(60)

    (episode,) = minari.load_dataset("spaces-v0")
    assert episode.rewards.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert episode.truncations.tolist() == [False, False, False, True]
    for i, obs in enumerate(observations):
        assert np.array_equal(episode.observations["box"][i], obs["box"])
        assert np.array_equal(episode.observations["multi"][i], obs["multi"])
        assert np.array_equal(episode.observations["binary"][i], obs["binary"])
        assert episode.observations["text"][i] == obs["text"]
        assert episode.observations["pair"][0][i] == obs["pair"][0]
        assert np.array_equal(episode.observations["pair"][1][i], obs["pair"][1])
    assert [episode.actions[0][i] for i in range(4)] == [a[0] for a in actions]
    assert list(episode.actions[1]) == [a[1] for a in actions]


def test_cut_episodes_are_marked_in_their_infos_or_dropped() -> None:
    env = gym.make("CartPole-v1")
    writer = DatasetWriter("cuts-v0", env.observation_space, env.action_space)
    marked = EpisodeAccumulator(0, env.observation_space, env.action_space, writer.put)
    dropping = EpisodeAccumulator(
        1, env.observation_space, env.action_space, writer.put, drop_faulted=True
    )
    play(env, marked, 1, steps=4)
    marked.cut("lane_fault")
    play(env, dropping, 2, steps=4)
    dropping.cut("lane_fault")
    full = play(env, dropping, 3)
    play(env, marked, 4, steps=2)
    marked.cut("session_close")
    writer.close(60)

    dataset = minari.load_dataset("cuts-v0")
    assert [(m["lane"], m.get("cut")) for m in episode_metadata(dataset)] == [
        (0, "lane_fault"),
        (1, None),
        (0, "session_close"),
    ]
    fault, whole, closed = dataset
    assert fault.truncations.tolist() == [False, False, False, True]
    assert fault.infos[CUT_INFO_KEY].tolist() == [b""] * 4 + [b"lane_fault"]
    assert closed.infos[CUT_INFO_KEY][-1] == b"session_close"
    assert float(whole.rewards.sum()) == full[0] and CUT_INFO_KEY not in (whole.infos or {})


class InfoEnv(gym.Env[np.ndarray, int]):
    """A small env whose infos hold a number, an array and a string; from step
    ``vary_at`` on, its infos gain a key (the case Minari's DataCollector refuses)."""

    observation_space = spaces.Box(0, 10, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, vary_at: int | None = None) -> None:
        self.vary_at = vary_at
        self.t = 0

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "t": self.t,
            "pos": np.full(2, self.t, np.int16),
            "tag": f"s{self.t}",
        }
        if self.vary_at is not None and self.t >= self.vary_at:
            info["extra"] = 1.0
        return info

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), self._info()

    def step(self, action: int) -> Any:
        self.t += 1
        return np.full(1, self.t, np.float32), 1.0, self.t == 3, False, self._info()


def test_infos_are_recorded_and_an_episode_whose_infos_vary_loses_only_its_infos(
    caplog: pytest.LogCaptureFixture,
) -> None:
    writer = DatasetWriter(
        "infos-v0", InfoEnv.observation_space, InfoEnv.action_space, record_infos=True
    )
    acc = EpisodeAccumulator(
        0, InfoEnv.observation_space, InfoEnv.action_space, writer.put, record_infos=True
    )
    with caplog.at_level(logging.WARNING, logger="rlmesh_trio.record"):
        for vary_at in (None, 2, 1, None):
            play(InfoEnv(vary_at), acc, seed=None)
        writer.close(60)
    assert writer.infos_dropped == 2
    assert len([r for r in caplog.records if "infos not recorded" in r.getMessage()]) == 1

    dataset = minari.load_dataset("infos-v0")
    steady, varied, _, again = dataset
    assert steady.infos["t"].tolist() == [0, 1, 2, 3]
    assert steady.infos["pos"].shape == (4, 2) and steady.infos["pos"].dtype == np.int16
    assert steady.infos["tag"].tolist() == [b"s0", b"s1", b"s2", b"s3"]
    assert again.infos["t"].tolist() == [0, 1, 2, 3]
    assert not varied.infos and len(varied) == 3  # the data is kept, the infos are not
    metadata = episode_metadata(dataset)
    assert "another structure" in metadata[1]["infos_dropped"]
    assert "infos_dropped" not in metadata[0]


def test_a_slow_writer_holds_the_lane_back_and_loses_nothing() -> None:
    env = gym.make("CartPole-v1")
    gate = threading.Event()

    class SlowWriter(DatasetWriter):
        def _write(self, batch: list[Episode]) -> int:
            gate.wait(30)
            return super()._write(batch)

    writer = SlowWriter("slow-v0", env.observation_space, env.action_space, capacity=2)
    blocked = put_blocked(writer.worker)
    acc = EpisodeAccumulator(0, env.observation_space, env.action_space, writer.put)
    returns: list[float] = []
    done = threading.Event()

    def lane() -> None:
        lane_env = gym.make("CartPole-v1")
        for seed in range(12):
            returns.append(play(lane_env, acc, seed)[0])
        done.set()

    thread = threading.Thread(target=lane, name="lane-0")
    thread.start()
    assert blocked.wait(30)  # the lane waits for room while the writer is held
    assert writer.worker.put_waits >= 1 and writer.depth == 2 and writer.episodes_written == 0
    # at most one batch taken (<= 2), two queued, one waiting in put: the lane waits
    assert not done.is_set() and len(returns) <= 4
    gate.set()
    thread.join(60)
    writer.close(60)
    assert done.is_set() and writer.worker.put_wait_ns > 0
    dataset = minari.load_dataset("slow-v0")
    assert [float(e.rewards.sum()) for e in dataset] == returns
    assert [m["seed"] for m in episode_metadata(dataset)] == list(range(12))


def test_a_write_that_fails_is_raised_not_swallowed() -> None:
    space = spaces.Box(0.0, 1.0, (2,), np.float32)
    writer = DatasetWriter("broken-v0", space, space)
    acc = EpisodeAccumulator(0, spaces.Box(0.0, 1.0, (3,), np.float32), space, writer.put)
    acc.reset(np.zeros(3, np.float32), None)  # not of the dataset's space
    acc.step(np.zeros(2, np.float32), np.zeros(3, np.float32), 0.0, True, False)
    with pytest.raises(RecordingError, match="1 item\\(s\\) not written"):
        writer.close(60)


def test_a_storage_child_that_dies_fails_the_writer_and_is_not_waited_on() -> None:
    """The child killed between two batches: the next batch raises (the writer's error,
    raised by ``close`` with what was lost); the first batch stays readable."""
    space = spaces.Box(0.0, 1.0, (2,), np.float32)
    written = threading.Event()
    writer = DatasetWriter(
        "killed-v0", space, space, own_process=True, on_batch=lambda n, b: written.set()
    )
    acc = EpisodeAccumulator(0, space, space, writer.put)
    acc.reset(np.zeros(2, np.float32), 1)
    acc.step(np.zeros(2, np.float32), np.ones(2, np.float32), 1.0, True, False)
    assert written.wait(60)
    child = writer._child
    assert child is not None
    child._process.kill()
    child._process.wait(60)
    acc.reset(np.zeros(2, np.float32), 2)
    acc.step(np.zeros(2, np.float32), np.ones(2, np.float32), 1.0, True, False)
    with pytest.raises(RecordingError, match="1 item\\(s\\) not written") as caught:
        writer.close(60)
    assert "storage process is gone" in str(caught.value.__cause__)
    assert writer.episodes_written == 1
    assert minari.load_dataset("killed-v0").total_episodes == 1


@pytest.mark.parametrize("group_bytes", [None, 5000])
def test_a_batch_goes_to_the_storage_child_in_groups_and_in_order(
    group_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small episodes go to the child together (a batch of 16 small ones: one message,
    one answer), one bigger than a group alone; either way every episode is stored, in
    the order queued, with its own data."""
    import rlmesh_trio._record._child as child_module

    if group_bytes is not None:
        monkeypatch.setattr(child_module, "GROUP_BYTES", group_bytes)
    sends: list[int] = []
    real_send = child_module.StorageChild._send

    def counted(self: Any, data: bytes) -> None:
        sends.append(len(data))
        real_send(self, data)

    monkeypatch.setattr(child_module.StorageChild, "_send", counted)
    space = spaces.Box(0, 255, (400,), np.uint8)
    lengths = [1, 1, 9, 1, 2, 12, 1, 1, 3, 1, 1, 10, 1, 1, 2, 1]
    written = threading.Event()
    writer = DatasetWriter(
        "groups-v0",
        space,
        space,
        own_process=True,
        capacity=64,  # batches of 16
        linger=60.0,  # ... and none smaller before close
        on_batch=lambda n, b: written.set(),
    )
    acc = EpisodeAccumulator(0, space, space, writer.put)
    for i, length in enumerate(lengths):
        acc.reset(np.full(400, i, np.uint8), i)
        for t in range(length):
            value = np.full(400, (i * 16 + t) % 256, np.uint8)
            acc.step(value, value, float(t), t == length - 1, False)
    assert written.wait(60)
    writer.close(60)
    if group_bytes is None:
        assert len(sends) == 1  # the whole batch in one message
    else:  # the long episodes alone, the short ones grouped: fewer messages than episodes
        big = sum(1 for size in sends if size > group_bytes)
        assert big == 3 and len(sends) < len(lengths) - 3
    dataset = minari.load_dataset("groups-v0")
    assert [len(e) for e in dataset] == lengths
    assert [m["seed"] for m in episode_metadata(dataset)] == list(range(len(lengths)))
    for i, episode in enumerate(dataset):
        assert (episode.observations[0] == i).all()
        assert (episode.actions[:, 0] == [(i * 16 + t) % 256 for t in range(lengths[i])]).all()


def test_the_storage_child_exits_when_the_writer_closes() -> None:
    space = spaces.Discrete(3)
    writer = DatasetWriter("exits-v0", space, space, own_process=True)
    acc = EpisodeAccumulator(0, space, space, writer.put)
    acc.reset(0, None)
    acc.step(1, 2, 0.5, False, True)
    writer.close(60)
    child = writer._child
    assert child is not None and child._process.returncode == 0
    (episode,) = minari.load_dataset("exits-v0")
    assert episode.actions.tolist() == [1] and episode.observations.tolist() == [0, 2]


def test_the_dataset_is_made_at_once_and_a_clash_or_bad_id_says_so(minari_root: Path) -> None:
    space = spaces.Discrete(2)
    writer = DatasetWriter("twice-v0", space, space)
    assert (minari_root / "twice-v0" / "data" / "metadata.json").is_file()
    assert minari.load_dataset("twice-v0").total_episodes == 0
    with pytest.raises(FileExistsError, match="minari delete twice-v0"):
        DatasetWriter("twice-v0", space, space)
    writer.close(60)
    with pytest.raises(ValueError, match="Malformed dataset ID"):
        DatasetWriter("no version", space, space)


class JaxWatch(importlib.abc.MetaPathFinder):
    """Notes every attempt to import jax (it is not installed; an attempt is the bug)."""

    def __init__(self) -> None:
        self.attempts: list[str] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in ("jax", "jaxlib"):
            self.attempts.append(name)


@pytest.fixture
def jax_watch() -> Iterator[JaxWatch]:
    watch = JaxWatch()
    sys.meta_path.insert(0, watch)
    try:
        yield watch
    finally:
        sys.meta_path.remove(watch)


def test_writing_and_loading_never_import_jax(jax_watch: JaxWatch) -> None:
    env = gym.make("CartPole-v1")
    writer = DatasetWriter("nojax-v0", env.observation_space, env.action_space)
    acc = EpisodeAccumulator(0, env.observation_space, env.action_space, writer.put)
    play(env, acc, 0)
    writer.close(60)
    assert len(minari.load_dataset("nojax-v0")) == 1
    assert jax_watch.attempts == []
    assert not any(name.split(".")[0] in ("jax", "jaxlib") for name in sys.modules)


def test_a_storage_child_that_cannot_start_is_a_startup_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The child is started with the writer (not at its first episode), so a child that
    cannot start fails the server's startup, and no thread is left behind."""
    import rlmesh_trio._record._dataset as dataset_module

    def no_child(*args: Any) -> None:
        raise OSError("no interpreter here")

    monkeypatch.setattr(dataset_module, "StorageChild", no_child)
    space = spaces.Discrete(2)
    with pytest.raises(RecordingError, match="did not start: OSError\\('no interpreter here'\\)"):
        DatasetWriter("nochild-v0", space, space, own_process=True)


# ---- what a dataset holds after a failure (_seal) -----------------------------------------


def _written(dataset_id: str, episodes: int) -> Path:
    """A closed dataset of ``episodes`` CartPole episodes; its data directory."""
    env = gym.make("CartPole-v1")
    writer = DatasetWriter(dataset_id, env.observation_space, env.action_space)
    acc = EpisodeAccumulator(0, env.observation_space, env.action_space, writer.put)
    for seed in range(episodes):
        play(env, acc, seed)
    writer.close(60)
    return writer.path / "data"


def test_a_complete_dataset_says_so() -> None:
    data = _written("rlmesh/whole-v0", 5)
    dataset = minari.load_dataset("rlmesh/whole-v0")
    said = dataset.storage.metadata["rlmesh_trio"]
    assert said == {"complete": True, "episodes_in_dataset": 5, "episodes_played": 5, "runs": 1}
    assert not list(data.glob("*.rlmesh-trio-*"))  # nothing left aside


def test_salvage_keeps_the_episodes_that_read_whole_and_drops_the_rest() -> None:
    """A batch cut short: its first group whole but uncounted, the next one's data gone
    (an external file that is not there: reading it fails, as a cut-short write's does).
    The episodes before the broken one are kept, with Minari's totals; the file is
    rewritten aside and renamed; the dataset loads."""
    import h5py

    from rlmesh_trio._record._seal import salvage, seal

    data = _written("rlmesh/broken-v0", 6)
    file = data / "main_data.hdf5"
    with h5py.File(file, "a") as handle:
        handle.copy(handle["episode_5"], handle, name="episode_6")  # whole, uncounted
        broken = handle.create_group("episode_7")
        broken.attrs["total_steps"] = 3
        broken.create_dataset("rewards", shape=(3,), dtype="f8", external=[("gone.bin", 0, 24)])
        handle.copy(handle["episode_5"], handle, name="episode_8")  # past the break
    steps_of_6 = minari.load_dataset("rlmesh/broken-v0")[5].rewards.shape[0]
    total_before = minari.load_dataset("rlmesh/broken-v0").total_steps

    count, steps, done = salvage(data)
    assert count == 7 and steps == total_before + steps_of_6
    assert "2 broken or uncounted" in done
    with h5py.File(file, "r") as handle:
        assert sorted(handle.keys()) == [f"episode_{i}" for i in range(7)]
    seal(data, played=9, error="the storage failed")
    dataset = minari.load_dataset("rlmesh/broken-v0")
    assert dataset.total_episodes == 7 and dataset.total_steps == steps
    assert all(len(e.observations) == len(e.actions) + 1 for e in dataset)
    assert dataset.storage.metadata["rlmesh_trio"] == {
        "complete": False,
        "episodes_in_dataset": 7,
        "episodes_played": 9,
        "runs": 1,
        "error": "the storage failed",
    }
    assert salvage(data)[2] == "the file holds 7 whole episodes"  # and then it is exact


def test_a_batch_with_no_room_is_refused_before_the_file_is_touched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Less room than the batch needs (the file system's free space or the file-size
    limit): NoRoom, raised before the file is opened; the writer fails, its close says
    what the dataset keeps; everything written before loads."""
    from rlmesh_trio._record import _seal

    env = gym.make("CartPole-v1")
    writer = DatasetWriter("rlmesh/noroom-v0", env.observation_space, env.action_space)
    acc = EpisodeAccumulator(0, env.observation_space, env.action_space, writer.put)
    for seed in range(3):
        play(env, acc, seed)
    deadline = time.monotonic() + 30
    while writer.episodes_written < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.episodes_written == 3
    file = writer.path / "data" / "main_data.hdf5"
    size, mtime = file.stat().st_size, file.stat().st_mtime_ns
    monkeypatch.setattr(_seal, "room_for", lambda _file: 10_000)
    for seed in range(3, 6):
        play(env, acc, seed)
    with pytest.raises(RecordingError, match="no room for the next") as raised:
        writer.close(60)
    assert "keeps 3 of the 6 episodes played" in str(raised.value)
    assert (file.stat().st_size, file.stat().st_mtime_ns) == (size, mtime)
    dataset = minari.load_dataset("rlmesh/noroom-v0")
    assert dataset.total_episodes == 3
    said = dataset.storage.metadata["rlmesh_trio"]
    assert said["complete"] is False and said["episodes_played"] == 6
    assert "no room" in said["error"]


def test_room_for_honours_the_file_size_limit(tmp_path: Path) -> None:
    import resource

    from rlmesh_trio._record._seal import room_for

    file = tmp_path / "f"
    file.write_bytes(b"x" * 1000)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (5000, hard))
        assert room_for(file) == 4000
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert room_for(file) > 4000


# ---- datasets that continue across restarts (--record-append) -----------------------------


def _episodes_of(dataset_id: str) -> list[tuple[Any, ...]]:
    dataset = minari.load_dataset(dataset_id)
    return [
        (e.observations.tobytes(), e.actions.tobytes(), e.rewards.tobytes(), m.get("seed"))
        for e, m in zip(dataset, episode_metadata(dataset), strict=True)
    ]


@pytest.mark.parametrize("own_process", OWN_PROCESS)
def test_append_adds_after_the_episodes_written_and_never_changes_them(own_process: bool) -> None:
    env = gym.make("CartPole-v1")
    spec = env_spec_for("CartPole-v1")
    _written_with("rlmesh/restart-v0", range(3), spec=spec)
    first = _episodes_of("rlmesh/restart-v0")
    writer = DatasetWriter(
        "rlmesh/restart-v0",
        env.observation_space,
        env.action_space,
        env_spec=spec,
        append=True,
        own_process=own_process,
    )
    assert writer.episodes_before == 3
    acc = EpisodeAccumulator(1, env.observation_space, env.action_space, writer.put)
    for seed in (10, 11):
        play(env, acc, seed)
    writer.close(60)
    dataset = minari.load_dataset("rlmesh/restart-v0")
    assert dataset.total_episodes == 5
    assert _episodes_of("rlmesh/restart-v0")[:3] == first  # untouched
    metadata = episode_metadata(dataset)
    assert [m.get("seed") for m in metadata] == [0, 1, 2, 10, 11]
    assert [m["lane"] for m in metadata] == [0, 0, 0, 1, 1]
    for episode, meta in zip(dataset, metadata, strict=True):
        assert replay_equal(
            gym.make("CartPole-v1"), meta["seed"], episode.actions, episode.observations
        )
    said = dataset.storage.metadata["rlmesh_trio"]
    assert said == {"complete": True, "episodes_in_dataset": 5, "episodes_played": 5, "runs": 2}


def _written_with(
    dataset_id: str, seeds: Any, *, spec: Any = None, env_id: str = "CartPole-v1"
) -> None:
    env = gym.make(env_id)
    writer = DatasetWriter(dataset_id, env.observation_space, env.action_space, env_spec=spec)
    acc = EpisodeAccumulator(0, env.observation_space, env.action_space, writer.put)
    for seed in seeds:
        play(env, acc, seed)
    writer.close(60)


def test_append_is_refused_for_another_env_or_other_spaces_and_changes_nothing() -> None:
    cartpole = gym.make("CartPole-v1")
    _written_with("rlmesh/other-v0", range(2), spec=env_spec_for("CartPole-v1"))
    before = _episodes_of("rlmesh/other-v0")
    with pytest.raises(FileExistsError, match="--record-append"):
        DatasetWriter("rlmesh/other-v0", cartpole.observation_space, cartpole.action_space)
    mountain = gym.make("MountainCar-v0")
    with pytest.raises(ValueError, match="its observation space is Box"):
        DatasetWriter(
            "rlmesh/other-v0", mountain.observation_space, cartpole.action_space, append=True
        )
    with pytest.raises(ValueError, match="recorded from env"):
        DatasetWriter(
            "rlmesh/other-v0",
            cartpole.observation_space,
            cartpole.action_space,
            env_spec=env_spec_for("CartPole-v1", {"render_mode": "rgb_array"}),
            append=True,
        )
    assert _episodes_of("rlmesh/other-v0") == before
    # and nothing was left locked: the right env continues it
    writer = DatasetWriter(
        "rlmesh/other-v0",
        cartpole.observation_space,
        cartpole.action_space,
        env_spec=env_spec_for("CartPole-v1"),
        append=True,
    )
    writer.close(60)


def test_one_writer_at_a_time() -> None:
    env = gym.make("CartPole-v1")
    first = DatasetWriter("rlmesh/busy-v0", env.observation_space, env.action_space)
    try:
        with pytest.raises(RuntimeError, match=r"being written by rlmesh-trio pid \d+"):
            DatasetWriter("rlmesh/busy-v0", env.observation_space, env.action_space, append=True)
    finally:
        first.close(60)
    DatasetWriter("rlmesh/busy-v0", env.observation_space, env.action_space, append=True).close(60)


def test_an_incomplete_dataset_stays_marked_when_continued(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlmesh_trio._record import _seal

    env = gym.make("CartPole-v1")
    writer = DatasetWriter("rlmesh/lossy-v0", env.observation_space, env.action_space)
    with monkeypatch.context() as patched:
        patched.setattr(_seal, "room_for", lambda _file: 0)
        acc = EpisodeAccumulator(0, env.observation_space, env.action_space, writer.put)
        play(env, acc, 0)
        with pytest.raises(RecordingError):
            writer.close(60)
    continued = DatasetWriter(
        "rlmesh/lossy-v0", env.observation_space, env.action_space, append=True
    )
    acc = EpisodeAccumulator(0, env.observation_space, env.action_space, continued.put)
    play(env, acc, 1)
    continued.close(60)
    said = minari.load_dataset("rlmesh/lossy-v0").storage.metadata["rlmesh_trio"]
    assert said["complete"] is False and "no room" in said["error"]
    assert said["episodes_in_dataset"] == 1 and said["episodes_played"] == 2 and said["runs"] == 2


def test_the_storage_child_is_replaced_by_a_fresh_one_as_it_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every CHILD_RECYCLE_EPISODES episodes (or past CHILD_RSS_GROWTH) the storage child
    is replaced between batches: its memory stays bounded, and nothing is lost or
    changed (totals, ids, episode metadata)."""
    from rlmesh_trio._record import _dataset

    monkeypatch.setattr(_dataset, "CHILD_RECYCLE_EPISODES", 4)
    env = gym.make("CartPole-v1")
    writer = DatasetWriter(
        "rlmesh/recycled-v0", env.observation_space, env.action_space, own_process=True, capacity=4
    )
    acc = EpisodeAccumulator(0, env.observation_space, env.action_space, writer.put)
    lengths = [play(env, acc, seed)[1] for seed in range(13)]
    writer.close(60)
    assert writer.children_recycled >= 2
    dataset = minari.load_dataset("rlmesh/recycled-v0")
    assert dataset.total_episodes == 13 and dataset.total_steps == sum(lengths)
    assert [m["seed"] for m in episode_metadata(dataset)] == list(range(13))
    for episode, meta in zip(dataset, episode_metadata(dataset), strict=True):
        assert replay_equal(
            gym.make("CartPole-v1"), meta["seed"], episode.actions, episode.observations
        )
