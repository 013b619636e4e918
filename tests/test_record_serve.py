"""Recording what is served (issue 33), end to end with the real minari and PyAV.

``serve_env`` with ``ServeOptions(record_dataset=..., record_video=...)``, driven by rlmesh
0.1.0's ``rlmesh.run`` and by our own client: the dataset's episodes, returns, seeds and
lanes; a bit-for-bit replay of the recorded actions on a local env; episodes cut by a
fault and by the server's stop (recorded truncated and marked, or dropped); a slow writer
(the lanes wait, nothing is lost); video files of chosen lanes that decode to episode
length + 1 frames of the env's render size; the startup errors.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import trio
from support import envs, scripts, wire
from support.faulty import HANG, RAISE, Controller, Factory
from support.recording import (
    NEEDS_PYGAME,
    episode_metadata,
    private_minari_root,
    put_blocked,
    replay_equal,
    storage_children,
)
from support.serving import served

from rlmesh_trio import ServeOptions, serve_env
from rlmesh_trio._record import CUT_INFO_KEY
from rlmesh_trio._record._dataset import DatasetWriter
from rlmesh_trio.client import EnvError, open_endpoint

minari = pytest.importorskip("minari")
av = pytest.importorskip("av")
TAXI = "Taxi-v4" if "Taxi-v4" in gym.registry else "Taxi-v3"
"""Taxi-v4 in newer gymnasiums (1.4 at the CI pins); 1.1.0, the lowest the range admits, has Taxi-v3."""

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def minari_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return private_minari_root(tmp_path, monkeypatch)


def replays(seed: int | None, actions: Any, observations: Any) -> bool:
    """A local CartPole reset with ``seed`` and stepped with ``actions`` produces
    ``observations``, bit for bit."""
    env = gym.make("CartPole-v1")
    try:
        return replay_equal(env, seed, actions, observations)
    finally:
        env.close()


async def test_a_served_evaluation_is_a_dataset_that_replays_bit_for_bit() -> None:
    seeds = list(range(8))
    async with served("CartPole-v1", num_envs=3, record_dataset="rlmesh/eval-v0") as address:
        played = await trio.to_thread.run_sync(scripts.run_session, address, "cartpole", seeds)
    dataset = minari.load_dataset("rlmesh/eval-v0")
    metadata = episode_metadata(dataset)
    assert dataset.total_episodes == len(seeds)
    returns = {e["seed"]: e["reward"] for e in played}
    by_seed = {}
    for episode, meta in zip(dataset, metadata, strict=True):
        assert "cut" not in meta and 0 <= meta["lane"] < 3
        by_seed[meta["seed"]] = episode
        assert float(np.sum(episode.rewards)) == returns[meta["seed"]]
        assert episode.terminations[-1] or episode.truncations[-1]
        assert replays(meta["seed"], episode.actions, episode.observations)
    assert sorted(by_seed) == seeds
    assert dataset.total_steps == sum(e["steps"] for e in played)
    env = dataset.recover_environment()  # the served id and kwargs
    assert env.spec is not None and env.spec.id == "CartPole-v1"
    env.close()


async def _remote_shutdown(address: str) -> None:
    async with wire.WireClient(address) as client:
        await client.shutdown("the test is over")


async def test_a_stop_mid_episode_records_it_truncated_and_marked() -> None:
    """The server stops (a remote Shutdown) under a client still joined."""
    async with (
        served(
            "CartPole-v1", num_envs=2, record_dataset="rlmesh/stop-v0", allow_remote_shutdown=True
        ) as address,
        open_endpoint(address) as ep,
    ):
        await ep.reset(seeds=[7], env_indices=[0])
        await ep.reset(env_indices=[1])
        for _ in range(3):
            await ep.step(np.array([0, 1]))
        await trio.to_thread.run_sync(wire.run, _remote_shutdown(address))
    dataset = minari.load_dataset("rlmesh/stop-v0")
    metadata = episode_metadata(dataset)
    assert sorted(m["lane"] for m in metadata) == [0, 1]
    for episode, meta in zip(dataset, metadata, strict=True):
        assert meta["cut"] == "server_stop"
        assert len(episode.actions) == 3 and episode.truncations.tolist() == [False, False, True]
        marks = [m.decode() if isinstance(m, bytes) else m for m in episode.infos[CUT_INFO_KEY]]
        assert marks == ["", "", "", "server_stop"]  # HDF5 gives the strings back as bytes
        assert meta.get("seed") == (7 if meta["lane"] == 0 else None)  # never invented
    lane0 = metadata.index(next(m for m in metadata if m["lane"] == 0))
    episode = dataset[lane0]
    assert replays(7, episode.actions, episode.observations)


async def test_an_episode_a_session_left_open_is_cut_as_the_sessions() -> None:
    """A client closes mid-episode: the next session's reset cuts the episode
    (``session_close``, not ``reset``); a lane the next session steps on without a reset
    goes on with the same episode, which that session's close then leaves."""
    async with served("CartPole-v1", num_envs=2, record_dataset="rlmesh/left-v0") as address:
        async with open_endpoint(address) as first:
            await first.reset(seeds=[7], env_indices=[0])
            await first.reset(seeds=[8], env_indices=[1])
            for _ in range(3):
                await first.step(np.array([0, 1]))
        async with open_endpoint(address) as second:
            await second.reset(seeds=[9], env_indices=[0])
            await second.step(np.array([1]), env_indices=[1])
            await second.step(np.array([0]), env_indices=[0])
    dataset = minari.load_dataset("rlmesh/left-v0")
    metadata = episode_metadata(dataset)
    by_seed = {m["seed"]: (episode, m) for episode, m in zip(dataset, metadata, strict=True)}
    assert sorted(by_seed) == [7, 8, 9]
    for seed, lane, actions in ((7, 0, [0, 0, 0]), (8, 1, [1, 1, 1, 1]), (9, 0, [0])):
        episode, meta = by_seed[seed]
        assert (meta["lane"], meta["cut"]) == (lane, "session_close")
        assert episode.actions.tolist() == actions and bool(episode.truncations[-1])
        assert replays(seed, episode.actions, episode.observations)


class Escapes(gym.Env[np.ndarray, int]):
    """Action 1 gives an observation out of its bounds (which ``strict`` refuses)."""

    observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return np.full(1, 0.5, np.float32), {}

    def step(self, action: int) -> Any:
        self.t += 1
        obs = np.full(1, 5.0 if action == 1 else 0.5, np.float32)
        return obs, 1.0, self.t >= 3, False, {}


async def test_a_step_the_env_ran_but_whose_answer_was_refused_cuts_the_episode() -> None:
    """The env stepped, its observation was refused (``strict``): what it does next is
    not what was recorded, so the episode is cut there (``lane_fault``); a refused
    action (the env never ran) changes nothing."""
    options = {"record_dataset": "rlmesh/refused-v0", "validation_policy": "strict"}
    async with served(Escapes, num_envs=1, **options) as address:
        async with open_endpoint(address) as ep:
            await ep.reset(seeds=[1])
            await ep.step(np.array([0]))
            with pytest.raises(EnvError, match="out of bounds"):
                await ep.step(np.array([1]))  # fatal under strict: the session ends
        async with open_endpoint(address) as ep:
            await ep.reset(seeds=[2])
            with pytest.raises(EnvError, match="not in range"):
                await ep.step(np.array([7]))  # refused before the env: nothing changes
            for _ in range(3):
                await ep.step(np.array([0]))
    dataset = minari.load_dataset("rlmesh/refused-v0")
    by_seed = {m["seed"]: (e, m) for e, m in zip(dataset, episode_metadata(dataset), strict=True)}
    cut, whole = by_seed[1], by_seed[2]
    assert cut[1]["cut"] == "lane_fault" and cut[0].actions.tolist() == [0]
    assert "cut" not in whole[1] and whole[0].actions.tolist() == [0, 0, 0]
    assert bool(whole[0].terminations[-1])


class Wide(gym.Env[np.ndarray, np.ndarray]):
    """A Box action of 1.2 MB (a step request over 1 MiB: its leaves stay views of the
    request's buffer) in [0, 1]; the observation is the action's mean."""

    observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Box(0.0, 1.0, (300_000,), np.float32)

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action: Any) -> Any:
        self.t += 1
        return np.array([np.mean(action)], np.float32), 0.0, self.t >= 3, False, {}


async def test_big_step_requests_and_refused_actions_are_recorded_as_the_env_saw_them() -> None:
    """Steps of 1.2 MB actions are recorded (their leaves are views of the request's
    buffer); under ``strict``, an out-of-bounds action is refused before the env runs:
    the episode goes on uncut (a next session steps it on) and holds only the actions the
    env took."""
    options = {"record_dataset": "rlmesh/wide-v0", "validation_policy": "strict"}
    taken = [np.full(300_000, v, np.float32) for v in (0.25, 0.5, 0.75)]
    async with served(Wide, num_envs=1, **options) as address:
        async with open_endpoint(address) as ep:
            await ep.reset(seeds=[1])
            await ep.step(taken[0][None])
            with pytest.raises(EnvError, match="bounds"):
                await ep.step(np.full((1, 300_000), 5.0, np.float32))
        async with open_endpoint(address) as ep:
            for action in taken[1:]:
                await ep.step(action[None])
    (episode,) = minari.load_dataset("rlmesh/wide-v0")
    (meta,) = episode_metadata(minari.load_dataset("rlmesh/wide-v0"))
    assert "cut" not in meta and bool(episode.terminations[-1])
    assert np.array_equal(episode.actions, np.stack(taken))
    assert episode.observations[:, 0].tolist() == [0.0, 0.25, 0.5, 0.75]


async def test_drop_faulted_drops_the_cut_episodes_and_keeps_the_finished() -> None:
    async with (
        served(
            "CartPole-v1", num_envs=1, record_dataset="rlmesh/drop-v0", record_drop_faulted=True
        ) as address,
        open_endpoint(address) as ep,
    ):
        obs, _ = await ep.reset(seeds=[3])
        done = False
        while not done:  # one whole episode, then one cut by the stop
            obs, _r, term, trunc, _i = await ep.step(np.array([scripts.cartpole_policy(obs[0])]))
            done = bool(term[0] or trunc[0])
        await ep.reset(seeds=[4])
        await ep.step(np.array([0]))
    dataset = minari.load_dataset("rlmesh/drop-v0")
    assert dataset.total_episodes == 1
    assert episode_metadata(dataset)[0]["seed"] == 3


async def test_a_lane_fault_cuts_the_episode_and_the_lane_records_on() -> None:
    ctl = Controller()
    async with (
        served(
            Factory(ctl), num_envs=2, record_dataset="rlmesh/fault-v0", on_lane_fault="rebuild"
        ) as address,
        open_endpoint(address) as ep,
    ):
        await ep.reset(seeds=[1, 2])
        await ep.step(np.array([0, 0]))
        with pytest.raises(Exception, match="boom"):
            await ep.step(np.array([RAISE, 0]), env_indices=None)
        await ep.reset(seeds=[5], env_indices=[0])
        for _ in range(ctl.episode_steps):
            await ep.step(np.array([1]), env_indices=[0])
    assert not ctl.violations
    dataset = minari.load_dataset("rlmesh/fault-v0")
    metadata = episode_metadata(dataset)
    cuts = {(m["lane"], m.get("seed")): m.get("cut") for m in metadata}
    # lane 0: seed 1 cut by the fault (one step recorded), seed 5 whole; lane 1's
    # episode was left open by the client's close, then cut at the server's stop
    assert cuts[(0, 1)] == "lane_fault"
    assert cuts[(0, 5)] is None
    assert cuts[(1, 2)] == "session_close"
    faulted = dataset[next(i for i, m in enumerate(metadata) if m.get("seed") == 1)]
    assert len(faulted.actions) == 1 and bool(faulted.truncations[-1])


async def test_an_abandoned_step_cuts_the_episode_as_a_lane_fault() -> None:
    """Beside the raise: a step that hangs past ``lane_timeout_seconds`` is abandoned and
    the lane rebuilt; its episode is cut ``lane_fault`` (the abandoned thread never
    comes back to cut it: the rebuilt lane's first reset does), not ``reset``."""
    ctl = Controller()
    try:
        async with (
            served(
                Factory(ctl),
                num_envs=2,
                record_dataset="rlmesh/abandoned-v0",
                on_lane_fault="rebuild",
                lane_timeout_seconds=0.3,
            ) as address,
            open_endpoint(address) as ep,
        ):
            await ep.reset(seeds=[1, 2])
            await ep.step(np.array([0, 0]))
            with pytest.raises(EnvError, match=r"env\.step timed out after 300ms"):
                await ep.step(np.array([HANG]), env_indices=[0])
            with trio.fail_after(30):
                while True:  # the rebuilt lane takes a reset once it serves again
                    try:
                        await ep.reset(seeds=[5], env_indices=[0])
                        break
                    except EnvError:
                        await trio.sleep(0.05)
            for _ in range(ctl.episode_steps):
                await ep.step(np.array([1]), env_indices=[0])
    finally:
        ctl.release.set()  # the abandoned thread returns and ends
    dataset = minari.load_dataset("rlmesh/abandoned-v0")
    cuts = {(m["lane"], m.get("seed")): m.get("cut") for m in episode_metadata(dataset)}
    assert cuts[(0, 1)] == "lane_fault"
    assert cuts[(0, 5)] is None


async def test_a_slow_writer_makes_the_lanes_wait_and_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = threading.Event()
    real_write: Callable[..., int] = DatasetWriter._write
    writers: list[DatasetWriter] = []
    blocked: list[threading.Event] = []

    def slow_write(self: DatasetWriter, batch: list[Any]) -> int:
        gate.wait(30)  # the writer is stuck until the test lets it go
        return real_write(self, batch)

    real_init = DatasetWriter.__init__

    def small_queue(self: DatasetWriter, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **{**kwargs, "capacity": 2})
        blocked.append(put_blocked(self.worker))
        writers.append(self)

    monkeypatch.setattr(DatasetWriter, "_write", slow_write)
    monkeypatch.setattr(DatasetWriter, "__init__", small_queue)
    ctl = Controller(episode_steps=1)  # every step ends an episode
    episodes = 6
    async with (
        served(Factory(ctl), num_envs=1, record_dataset="rlmesh/slow-v0") as address,
        open_endpoint(address) as ep,
    ):

        async def play() -> None:
            for seed in range(episodes):
                await ep.reset(seeds=[seed])
                await ep.step(np.array([0]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(play)
            # the writer holds one episode, the queue two: the lane waits on the 4th
            (writer,) = writers
            assert await trio.to_thread.run_sync(blocked[0].wait, 30)
            assert writer.worker.depth == 2
            gate.set()
    assert writer.worker.put_waits >= 1
    dataset = minari.load_dataset("rlmesh/slow-v0")
    assert dataset.total_episodes == episodes
    assert [m["seed"] for m in episode_metadata(dataset)] == list(range(episodes))


@NEEDS_PYGAME
async def test_video_of_chosen_lanes_decodes_to_length_plus_one_frames(tmp_path: Path) -> None:
    directory = tmp_path / "video"
    async with (
        served(
            "CartPole-v1",
            num_envs=2,
            env_kwargs={"render_mode": "rgb_array"},
            record_video=str(directory),
            record_video_lanes=(1,),
            record_video_every=2,
        ) as address,
        open_endpoint(address) as ep,
    ):
        lengths = []
        for seed in range(3):  # lane 1's episodes 0 and 2 are recorded; lane 0 idles
            obs, _ = await ep.reset(seeds=[seed], env_indices=[1])
            steps = 0
            done = False
            while not done:
                action = np.array([scripts.cartpole_policy(obs[0])])
                obs, _r, term, trunc, _i = await ep.step(action, env_indices=[1])
                steps += 1
                done = bool(term[0] or trunc[0])
            lengths.append(steps)
    files = sorted(p.name for p in directory.iterdir())
    assert files == ["lane-001-episode-000000.mp4", "lane-001-episode-000002.mp4"]
    for name, length in (files[0], lengths[0]), (files[1], lengths[2]):
        with av.open(str(directory / name)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == length + 1
        assert frames[0].shape == (400, 600, 3)


async def start_fails(make_env: Any, **options: Any) -> BaseException:
    """What ``nursery.start(serve_env, ...)`` raises."""
    async with trio.open_nursery() as nursery:
        with pytest.raises(Exception) as caught:
            await nursery.start(
                functools.partial(serve_env, make_env, options=ServeOptions(**options))
            )
    return caught.value


async def test_video_needs_rgb_array_rendering(tmp_path: Path) -> None:
    error = await start_fails("CartPole-v1", record_video=str(tmp_path / "v"))
    assert isinstance(error, ValueError)
    assert """--kwargs-json '{"render_mode": "rgb_array"}'""" in str(error)


async def test_an_existing_dataset_is_a_startup_error_before_any_env_is_built() -> None:
    async with served("CartPole-v1", num_envs=1, record_dataset="rlmesh/twice-v0"):
        pass
    built: list[int] = []

    def make() -> gym.Env[Any, Any]:
        built.append(1)
        return gym.make("CartPole-v1")

    error = await start_fails(make, record_dataset="rlmesh/twice-v0")
    assert isinstance(error, FileExistsError) and "twice-v0" in str(error)
    assert built == []


def test_options_are_validated() -> None:
    from rlmesh_trio._options import resolve

    with pytest.raises(ValueError, match="record_video_every"):
        resolve(ServeOptions(record_video="d", record_video_every=0))
    with pytest.raises(ValueError, match="need record_video"):
        resolve(ServeOptions(record_video_lanes=(0,)))
    with pytest.raises(ValueError, match="need record_dataset"):
        resolve(ServeOptions(record_infos=True))
    plan = resolve(ServeOptions(record_dataset="a/b-v0", record_video="d")).record
    assert plan is not None and plan.dataset == "a/b-v0" and plan.video_lanes is None
    for good in ("cartpole-v0", "rlmesh/cartpole-eval-v12", "a/b/c-v1"):
        assert resolve(ServeOptions(record_dataset=good)).record is not None
    # An id without its -vN: our words (Minari's parser fails on it with a TypeError).
    for bad in ("cartpole", "rlmesh/cartpole", "rlmesh/cartpole-v", "a b-v0", "x-v1/"):
        with pytest.raises(ValueError, match="NAMESPACE/NAME-vVERSION, the version required"):
            resolve(ServeOptions(record_dataset=bad))


BAD_ID = ("--record-dataset", "cartpole")


def test_the_cli_refuses_a_dataset_id_without_a_version_before_building_envs() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "rlmesh_trio", "serve", "--env", "NoSuchEnv-v0", *BAD_ID],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "'cartpole' is not a Minari dataset id" in out.stderr
    assert "NoSuchEnv" not in out.stderr  # refused before the env was looked up


@NEEDS_PYGAME
@contextmanager
def cli_server(args: list[str], tmp_path: Path, minari_root: Path, **env: str) -> Iterator[str]:
    """``python -m rlmesh_trio serve ARGS`` in a process group of its own (as a terminal
    gives it), run in ``tmp_path`` and logging to a file there; yields its address. On
    leaving, a terminal's Ctrl-C: SIGINT to the whole group (the lanes' children and the
    dataset's storage child too, which leave the stop to the server); it must exit 0."""
    import os
    import select
    import signal
    import subprocess
    import sys

    log_path = tmp_path / "server.log"  # a file, not a pipe nobody reads while it runs
    read_fd, write_fd = os.pipe()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlmesh_trio", "serve", *args, "--ready-fd", str(write_fd)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MINARI_DATASETS_PATH": str(minari_root), **env},
            pass_fds=(write_fd,),
            cwd=tmp_path,  # (MuJoCo writes its MUJOCO_LOG.TXT where it runs)
            start_new_session=True,
        )
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb", buffering=0) as ready:
            readable, _, _ = select.select([ready], [], [], 60)
            assert readable, "no address on the ready fd: " + log_path.read_text(errors="replace")
            address = ready.read(4096).decode().strip()
        yield address
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == 0, log_path.read_text(errors="replace")


def test_the_cli_records_a_dataset_and_video_with_process_lanes(
    tmp_path: Path, minari_root: Path
) -> None:
    """``rlmesh-trio serve --record-dataset ... --record-video ...`` in a subprocess, with
    process lanes (the frames are rendered in each lane's child), driven by rlmesh.run;
    a terminal's Ctrl-C (SIGINT to the process group) stops it and every episode is on
    disk."""
    directory = tmp_path / "video"
    args = ["--env", "CartPole-v1", "--num-envs", "2", "--lane-isolation", "process"]
    args += ["--kwargs-json", '{"render_mode": "rgb_array"}', "--record-dataset", "rlmesh/cli-v0"]
    args += ["--record-video", str(directory), "--record-video-lanes", "1"]
    seeds = [0, 1, 2, 3]
    with cli_server(args, tmp_path, minari_root) as address:
        played = scripts.run_session(address, "cartpole", seeds)
    dataset = minari.load_dataset("rlmesh/cli-v0")
    metadata = episode_metadata(dataset)
    returns = {e["seed"]: e["reward"] for e in played}
    finished = [m for m in metadata if "cut" not in m]
    assert sorted(m["seed"] for m in finished) == seeds
    for episode, meta in zip(dataset, metadata, strict=True):
        if "cut" not in meta:
            assert float(np.sum(episode.rewards)) == returns[meta["seed"]]
            assert replays(meta["seed"], episode.actions, episode.observations)
    lane1 = [i for i, m in enumerate(metadata) if m["lane"] == 1]
    videos = sorted(directory.iterdir())
    assert len(videos) == len(lane1) > 0
    for path in videos:
        meta = next(
            m
            for m in metadata
            if m["lane"] == 1 and path.name.endswith(f"episode-{m['lane_episode']:06d}.mp4")
        )
        length = len(dataset[metadata.index(meta)].actions)
        with av.open(str(path)) as container:
            assert sum(1 for _ in container.decode(video=0)) == length + 1


async def test_a_malformed_dataset_id_is_a_startup_error() -> None:
    error = await start_fails("CartPole-v1", record_dataset="a/b-v0")
    assert isinstance(error, ValueError) and "Malformed dataset ID" in str(error)


def test_the_recorders_metrics() -> None:
    from rlmesh_trio._metrics import ServerMetrics

    metrics = ServerMetrics(2, "CartPole-v1")
    assert b"rlmesh_trio_record" not in metrics.exposition()  # nothing recorded: no series
    metrics.watch_recording(
        lambda: [("dataset", 3, 40, 5000, 2_500_000_000, 0), ("video", 0, 9, 100, 0, 2)]
    )
    text = metrics.exposition().decode()
    assert 'rlmesh_trio_record_queue_depth{recorder="dataset"} 3.0' in text
    assert 'rlmesh_trio_record_items_written_total{recorder="dataset"} 40.0' in text
    assert 'rlmesh_trio_record_written_bytes_total{recorder="dataset"} 5000.0' in text
    assert 'rlmesh_trio_record_put_wait_seconds_total{recorder="dataset"} 2.5' in text
    assert 'rlmesh_trio_record_lanes_stopped{recorder="dataset"} 0.0' in text
    assert 'rlmesh_trio_record_lanes_stopped{recorder="video"} 2.0' in text


async def test_a_video_lane_beyond_the_lanes_served_is_a_startup_error(tmp_path: Path) -> None:
    error = await start_fails(
        "CartPole-v1", record_video=str(tmp_path / "v"), record_video_lanes=(0, 3)
    )
    assert isinstance(error, ValueError) and "beyond the 1 served" in str(error)


async def test_record_infos_keeps_steady_infos_and_drops_varying_ones_not_the_data() -> None:
    """Taxi's infos keep one structure (stored, stacked per key); FrozenLake's ``prob`` is
    an int at the reset and a float after (Minari needs one structure: the episode keeps
    its data, not its infos, and says why)."""
    async with (
        served(TAXI, num_envs=1, record_dataset="rlmesh/taxi-v0", record_infos=True) as a,
        open_endpoint(a) as ep,
    ):
        await ep.reset(seeds=[0])
        for action in (1, 1, 0):
            await ep.step(np.array([action]))
    (episode,) = minari.load_dataset("rlmesh/taxi-v0")
    assert episode.infos["action_mask"].shape == (4, 6)  # as the wire carried it
    assert episode.infos["action_mask"][0].tolist() == [1, 1, 0, 0, 0, 0]
    assert episode.infos["prob"].tolist() == [1.0] * 4
    async with (
        served(
            "FrozenLake-v1", num_envs=1, record_dataset="rlmesh/lake-v0", record_infos=True
        ) as a,
        open_endpoint(a) as ep,
    ):
        await ep.reset(seeds=[0])
        await ep.step(np.array([1]))
    dataset = minari.load_dataset("rlmesh/lake-v0")
    (meta,) = episode_metadata(dataset)
    assert "another structure" in meta["infos_dropped"] and meta["cut"] == "session_close"
    assert len(dataset[0].actions) == 1 and "prob" not in dataset[0].infos


MUJOCO = pytest.mark.skipif(
    importlib.util.find_spec("mujoco") is None,
    reason="MuJoCo is not installed (the test extra has it where it has wheels)",
)


def _egl_problem() -> str | None:
    """Why MuJoCo cannot render offscreen through EGL here (no libEGL, no device), or
    None: asked of a fresh interpreter, as the server's lanes will ask it."""
    import os
    import subprocess
    import sys

    probe = "import mujoco; c = mujoco.GLContext(8, 8); c.make_current(); c.free()"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "MUJOCO_GL": "egl"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


@MUJOCO
def test_a_mujoco_env_under_egl_is_recorded_from_the_cli(tmp_path: Path, minari_root: Path) -> None:
    """The README's MuJoCo line with the recorders on: ``MUJOCO_GL=egl rlmesh-trio serve
    --env HalfCheetah-v5`` (the GL context made and used on the lane's own thread); the
    episodes replay bit for bit on a local env and each video has a frame per step + 1
    of the render size asked for."""
    from rlmesh_trio.client import Env

    problem = _egl_problem()
    if problem is not None:
        pytest.skip(f"MuJoCo cannot render through EGL on this machine: {problem}")
    directory = tmp_path / "video"
    kwargs = {"render_mode": "rgb_array", "width": 96, "height": 64, "max_episode_steps": 30}
    args = ["--env", "HalfCheetah-v5", "--kwargs-json", json.dumps(kwargs)]
    args += ["--record-dataset", "rlmesh/cheetah-v0", "--record-video", str(directory)]
    played: dict[int, list[np.ndarray]] = {}
    with cli_server(args, tmp_path, minari_root, MUJOCO_GL="egl") as address:
        remote = Env(address)
        try:
            remote.action_space.seed(5)
            for seed in (3, 4):
                remote.reset(seed=seed)
                actions = played.setdefault(seed, [])
                done = False
                while not done:
                    action = remote.action_space.sample()
                    actions.append(action)
                    _obs, _r, terminated, truncated, _i = remote.step(action)
                    done = terminated or truncated
        finally:
            remote.close()
    dataset = minari.load_dataset("rlmesh/cheetah-v0")
    metadata = episode_metadata(dataset)
    assert [m["seed"] for m in metadata] == [3, 4] and all("cut" not in m for m in metadata)
    local = gym.make("HalfCheetah-v5", max_episode_steps=30)
    try:
        for episode, meta in zip(dataset, metadata, strict=True):
            assert len(episode.actions) == len(played[meta["seed"]]) == 30
            assert np.array_equal(episode.actions, np.stack(played[meta["seed"]]))
            assert replay_equal(local, meta["seed"], episode.actions, episode.observations)
    finally:
        local.close()
    videos = sorted(directory.iterdir())
    assert len(videos) == 2
    for path in videos:
        with av.open(str(path)) as container:
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        assert len(frames) == 31 and frames[0].shape == (64, 96, 3)
        assert len({frame.tobytes() for frame in frames}) > 1  # the cheetah moved


async def test_the_recorders_metrics_count_what_a_served_run_wrote() -> None:
    """Scraped over HTTP from a recording server: the episodes written (once the writer
    has written them: polled, the scrape being the only view), the bytes, an empty
    queue."""
    import time
    import urllib.request

    def scrape(address: str) -> dict[str, float]:
        with urllib.request.urlopen("http" + address[3:] + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return {
            name: float(value)
            for name, _, value in (line.rpartition(" ") for line in text.splitlines())
            if name and not name.startswith("#")
        }

    def written_when(address: str, want: float) -> dict[str, float]:
        deadline = time.monotonic() + 30
        while True:
            samples = scrape(address)
            key = 'rlmesh_trio_record_items_written_total{recorder="dataset"}'
            if samples.get(key) == want or time.monotonic() > deadline:
                return samples
            time.sleep(0.05)

    pytest.importorskip("prometheus_client")
    seeds = [0, 1, 2, 3, 4]
    options = ServeOptions(record_dataset="rlmesh/metrics-v0", metrics_address="tcp://127.0.0.1:0")
    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(serve_env, "CartPole-v1", num_envs=2, options=options)
        )
        assert info.metrics_address is not None
        await trio.to_thread.run_sync(scripts.run_session, info.address, "cartpole", seeds)
        samples = await trio.to_thread.run_sync(written_when, info.metrics_address, 5.0)
        nursery.cancel_scope.cancel()
    label = '{recorder="dataset"}'
    assert samples[f"rlmesh_trio_record_items_written_total{label}"] == len(seeds)
    assert samples[f"rlmesh_trio_record_written_bytes_total{label}"] > 0
    assert samples[f"rlmesh_trio_record_queue_depth{label}"] == 0
    assert minari.load_dataset("rlmesh/metrics-v0").total_episodes == len(seeds)


class RacyFirstRender(gym.Env[np.ndarray, int]):
    """An env library whose first render in the process sets itself up lazily and is not
    thread-safe (pygame's ``surfarray`` import): a render that finds the setup under way
    in another thread fails as pygame did."""

    metadata: dict[str, Any] = {"render_modes": ["rgb_array"], "render_fps": 30}
    setup: dict[str, Any] = {"done": False, "entered": 0}
    lock = threading.Lock()

    def __init__(self, render_mode: str | None = "rgb_array") -> None:
        self.render_mode = render_mode
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action: int) -> Any:
        self.t += 1
        return np.full(2, self.t / 10, np.float32), 1.0, self.t >= 4, False, {}

    def render(self) -> np.ndarray:
        setup = RacyFirstRender.setup
        if not setup["done"]:
            with RacyFirstRender.lock:
                setup["entered"] += 1
                racing = setup["entered"] > 1
            if racing:
                raise AttributeError("module 'fakegame.surfarray' has no attribute 'pixels3d'")
            threading.Event().wait(0.05)  # the lazy import, long enough for others to race
            setup["done"] = True
        return np.full((16, 16, 3), self.t * 20, np.uint8)


async def test_lanes_render_their_first_frames_one_at_a_time(tmp_path: Path) -> None:
    """Eight thread lanes whose envs' first render is a racy lazy setup, all reset at
    once: every lane's video is written (before, lanes lost theirs at random)."""
    RacyFirstRender.setup = {"done": False, "entered": 0}
    directory = tmp_path / "video"
    async with (
        served(RacyFirstRender, num_envs=8, record_video=str(directory)) as address,
        open_endpoint(address) as ep,
    ):
        for _ in range(2):
            await ep.reset(seeds=list(range(8)))
            for _ in range(4):
                await ep.step(np.zeros(8, np.int64))
    assert RacyFirstRender.setup == {"done": True, "entered": 1}
    files = sorted(p.name for p in directory.iterdir())
    assert files == [f"lane-{lane:03d}-episode-{k:06d}.mp4" for lane in range(8) for k in range(2)]
    for name in files:
        with av.open(str(directory / name)) as container:
            assert sum(1 for _ in container.decode(video=0)) == 5


VIDEO_RUNS = int(os.environ.get("RLMESH_TRIO_VIDEO_RUNS", "2"))
"""Fresh servers the next test starts (``nox -s stress`` runs 20): pygame's first render
races only once per process."""


@NEEDS_PYGAME
@pytest.mark.parametrize("run", range(VIDEO_RUNS))
def test_every_thread_lanes_video_is_written_with_a_real_classic_control_env(
    run: int, tmp_path: Path, minari_root: Path
) -> None:
    """The reported case, as a user runs it: ``serve --env CartPole-v1 --num-envs 8
    --kwargs-json '{"render_mode": "rgb_array"}' --record-video DIR`` (thread lanes: every
    recorded lane renders for the first time at once; pygame's lazy ``surfarray`` import
    is not thread-safe), then ``rlmesh.run`` over 16 seeds: every lane's every episode
    has its video, and none stopped."""
    rlmesh = pytest.importorskip("rlmesh")
    from rlmesh.numpy import Model

    directory = tmp_path / "video"
    args = ["--env", "CartPole-v1", "--num-envs", "8"]
    args += ["--kwargs-json", '{"render_mode": "rgb_array"}', "--record-video", str(directory)]
    with cli_server(args, tmp_path, minari_root, SDL_VIDEODRIVER="dummy") as address:
        result = rlmesh.run(Model(lambda o: int(o[2] > 0)), address, seeds=list(range(16)))
    assert len(result.episodes) == 16
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "video recording stopped" not in log, log
    for lane in range(8):
        videos = sorted(directory.glob(f"lane-{lane:03d}-episode-*.mp4"))
        assert len(videos) >= 2, (lane, sorted(p.name for p in directory.iterdir()))
        for path in videos:
            with av.open(str(path)) as container:
                assert sum(1 for _ in container.decode(video=0)) >= 1


async def _play_truncated(ep: Any, seeds: range) -> None:
    """An episode on each of 2 lanes per seed (make_cartpole_trunc3: 3 steps each)."""
    for seed in seeds:
        await ep.reset(seeds=[seed, seed + 1000])
        for _ in range(3):
            await ep.step(np.array([0, 1]))


async def _record_then_cancel(
    dataset_id: str, body: Callable[[Any], Awaitable[None]]
) -> list[BaseException]:
    """``serve_env`` (CartPole truncated at 3 steps, 2 lanes) recording into
    ``dataset_id``; ``body(endpoint)`` in a session; then the server cancelled (how a
    signal stops the CLI): the ``RecordingError``s it raised."""
    from rlmesh_trio._record._worker import RecordingError

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            info = await nursery.start(
                functools.partial(
                    serve_env,
                    envs.make_cartpole_trunc3,
                    num_envs=2,
                    options=ServeOptions(record_dataset=dataset_id),
                )
            )
            async with open_endpoint(info.address) as ep:
                await body(ep)
            nursery.cancel_scope.cancel()

    caught: list[BaseException] = []
    with trio.fail_after(90):
        try:
            await serve()
        except* RecordingError as group:  # from the nursery: in a group
            caught.extend(group.exceptions)
    return caught


async def test_a_failed_recording_is_raised_when_the_server_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A writer that fails while the server serves: the lanes serve on (the failure said
    once), and cancelling the server (how a signal stops the CLI, or an embedding program
    stops it) raises the recording's failure rather than the cancellation."""

    def full_disk(self: DatasetWriter, batch: list[Any]) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DatasetWriter, "_write", full_disk)

    async def body(ep: Any) -> None:
        await _play_truncated(ep, range(20))  # past the writer's first batch

    caught = await _record_then_cancel("rlmesh/full-v0", body)
    assert len(caught) == 1 and "No space left on device" in str(caught[0])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the child in /proc")
async def test_a_killed_storage_child_leaves_a_dataset_that_loads_and_says_so(
    minari_root: Path,
) -> None:
    """The storage child killed while the server records (an OOM killer, a person): the
    lanes serve on; at the stop the failure is raised naming what the dataset keeps, and
    the dataset loads with every episode written before the kill, marked incomplete,
    with the episodes played counted."""
    import signal

    metadata_file = minari_root / "rlmesh" / "killed-v0" / "data" / "metadata.json"

    def written() -> int:
        return int(json.loads(metadata_file.read_text()).get("total_episodes", 0))

    before = 0

    async def body(ep: Any) -> None:
        nonlocal before
        seed = 0
        while written() == 0:  # until a batch is on disk
            await _play_truncated(ep, range(seed, seed + 8))
            seed += 8
            await trio.sleep(0.05)
        (child,) = storage_children(os.getpid())
        before = written()
        os.kill(child, signal.SIGKILL)
        await _play_truncated(ep, range(5000, 5040))  # the lanes serve on

    caught = await _record_then_cancel("rlmesh/killed-v0", body)
    assert len(caught) == 1, caught
    text = str(caught[0])
    assert "storage process is gone" in text and "marked incomplete" in text, text
    dataset = minari.load_dataset("rlmesh/killed-v0")
    said = dataset.storage.metadata["rlmesh_trio"]
    assert said["complete"] is False and "storage process is gone" in said["error"]
    assert dataset.total_episodes == said["episodes_in_dataset"] >= before > 0
    assert said["episodes_played"] >= 2 * 40 + dataset.total_episodes
    assert f"keeps {dataset.total_episodes} of the {said['episodes_played']} episodes" in text
    steps = 0
    for episode in dataset:  # every episode kept reads whole
        assert len(episode.observations) == len(episode.actions) + 1 == 4
        steps += len(episode.actions)
    assert steps == dataset.total_steps


SERVE_CARTPOLE = ("-m", "rlmesh_trio", "serve", "--env", "CartPole-v1", "--num-envs", "4")


def test_the_cli_exits_3_once_a_recording_lost_data(tmp_path: Path, minari_root: Path) -> None:
    """The dataset's files may not grow past 1.5 MB (``RLIMIT_FSIZE``): the recording
    fails while the server serves on; at the stop the CLI says so in one line and exits
    3 (docs/operations.md), and the failure is logged once, not once per lane."""
    import resource
    import signal
    import subprocess
    import sys

    def small_files() -> None:  # pragma: no cover - in the child, before exec
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_500_000, 1_500_000))

    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [
            sys.executable,
            *SERVE_CARTPOLE,
            "--record-dataset",
            "rlmesh/small-v0",
            "--ready-fd",
            str(write_fd),
        ],
        env={**os.environ, "MINARI_DATASETS_PATH": str(minari_root)},
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=(write_fd,),
        preexec_fn=small_files,
    )
    os.close(write_fd)
    try:
        with os.fdopen(read_fd, "rb") as ready:
            address = ready.read().decode().strip()
        rlmesh = pytest.importorskip("rlmesh")
        from rlmesh.numpy import Model

        rlmesh.run(Model(lambda o: int(o[2] > 0)), address, seeds=range(300))
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = err.decode()
    assert proc.returncode == 3, text
    assert text.count("recording stopped") == 1, text
    assert "rlmesh-trio: error: the recording failed (what was not yet written is lost)" in text
    # Not the stop's old traceback of the failure (the storage child's own last words,
    # h5py's, may come: it is that process's stderr).
    assert "rlmesh_trio.serve: recording failed" not in text
    # The batch that would not fit was refused before the file was touched: every
    # episode written before loads, and the dataset says it is incomplete, and how much.
    assert "no room for the next" in text, text
    assert "marked incomplete in its metadata.json" in text, text
    _assert_incomplete_but_loadable("rlmesh/small-v0", at_least_played=300)


def _assert_incomplete_but_loadable(dataset_id: str, *, at_least_played: int) -> None:
    import minari

    dataset = minari.load_dataset(dataset_id)
    said = dataset.storage.metadata["rlmesh_trio"]
    assert said["complete"] is False and said["error"]
    kept = dataset.total_episodes
    assert 0 < kept == said["episodes_in_dataset"] < at_least_played <= said["episodes_played"]
    steps = 0
    for episode, meta in zip(dataset, episode_metadata(dataset), strict=True):  # whole
        assert len(episode.observations) == len(episode.actions) + 1
        assert replays(meta.get("seed"), episode.actions, episode.observations)
        steps += len(episode.actions)
    assert steps == dataset.total_steps


def test_a_restarted_cli_endpoint_continues_its_dataset(tmp_path: Path, minari_root: Path) -> None:
    """``--record-append``: the same command run twice (a restart) keeps one dataset,
    the first run's episodes untouched; without the flag the restart is refused at its
    start, before any env is built, naming the flag."""
    import subprocess
    import sys

    rlmesh = pytest.importorskip("rlmesh")
    from rlmesh.numpy import Model

    args = ["--env", "CartPole-v1", "--num-envs", "4", "--record-dataset", "rlmesh/restarts-v0"]
    command = [sys.executable, "-m", "rlmesh_trio", "serve", *args]
    env = {**os.environ, "MINARI_DATASETS_PATH": str(minari_root)}

    def run_once(seeds: range, *extra: str) -> None:  # started, driven, Ctrl-C: exit 0
        with cli_server([*args, *extra], tmp_path, minari_root) as address:
            rlmesh.run(Model(lambda o: int(o[2] > 0)), address, seeds=seeds)

    run_once(range(0, 12), "--record-append")  # a new dataset: the flag is harmless
    first = minari.load_dataset("rlmesh/restarts-v0")
    first_episodes = [e.observations.tobytes() for e in first]
    refused = subprocess.run(command, env=env, capture_output=True, timeout=60)
    assert refused.returncode == 1
    assert b"already exists" in refused.stderr and b"--record-append" in refused.stderr
    run_once(range(100, 112), "--record-append")

    dataset = minari.load_dataset("rlmesh/restarts-v0")
    assert [e.observations.tobytes() for e in dataset][: len(first_episodes)] == first_episodes
    seeds = [m.get("seed") for m in episode_metadata(dataset)]
    assert {*range(12), *range(100, 112)} <= set(seeds)
    assert dataset.storage.metadata["rlmesh_trio"] == {
        "complete": True,
        "episodes_in_dataset": dataset.total_episodes,
        "episodes_played": dataset.total_episodes,
        "runs": 2,
    }
    for episode, meta in zip(dataset, episode_metadata(dataset), strict=True):
        assert replays(meta.get("seed"), episode.actions, episode.observations)


class RenderStops(RacyFirstRender):
    """Renders frames until its third step, then none (``render()`` gives None)."""

    def render(self) -> Any:
        return None if self.t >= 3 else np.full((16, 16, 3), 7, np.uint8)


async def test_a_video_that_stops_mid_run_is_named_when_the_server_stops(tmp_path: Path) -> None:
    """A lane whose render stops giving frames records no more video (the lane serves
    on, logged once, counted in the metrics); at the stop the lanes are named in the
    raised ``RecordingError`` (the CLI's exit 3), not only in a log line."""
    import urllib.request

    from rlmesh_trio._record._worker import RecordingError

    scraped: list[str] = []

    def scrape(address: str) -> str:
        with urllib.request.urlopen(f"http{address[3:]}/metrics", timeout=30) as reply:
            return str(reply.read().decode())

    async def serve_and_cancel() -> None:
        async with trio.open_nursery() as nursery:
            info = await nursery.start(
                functools.partial(
                    serve_env,
                    RenderStops,
                    num_envs=2,
                    options=ServeOptions(
                        record_video=str(tmp_path / "video"), metrics_address="127.0.0.1:0"
                    ),
                )
            )
            async with open_endpoint(info.address) as ep:
                await ep.reset(seeds=[0, 1])
                for _ in range(4):
                    await ep.step(np.zeros(2, np.int64))
            scraped.append(await trio.to_thread.run_sync(scrape, info.metrics_address))
            nursery.cancel_scope.cancel()

    caught: list[BaseException] = []
    with trio.fail_after(60):
        try:
            await serve_and_cancel()
        except* RecordingError as group:
            caught.extend(group.exceptions)
    assert len(caught) == 1
    assert "video recording stopped on lanes [0, 1]" in str(caught[0])
    assert "env.render() gave no frame" in str(caught[0])
    assert 'rlmesh_trio_record_lanes_stopped{recorder="video"} 2.0' in scraped[0]
