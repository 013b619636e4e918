"""Video of chosen lanes with PyAV (the ``record`` extra): lanes on their own threads
render a real env; the files decode to episode length + 1 frames of the render's size."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from support.recording import NEEDS_PYGAME

av = pytest.importorskip("av")

from rlmesh_trio._record import (  # noqa: E402
    LaneVideo,
    RecordingError,
    VideoRecorder,
    require_rgb_array,
    video_name,
)

pytestmark = pytest.mark.timeout(120)


def decode(path: Path) -> list[np.ndarray[Any, Any]]:
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def run_lane(
    video: LaneVideo | None, lane: int, episodes: int, lengths: dict[tuple[int, int], int]
) -> None:
    """A lane's thread: its own env, rendered on this thread as the hook will."""
    env = gym.make("CartPole-v1", render_mode="rgb_array")
    env.action_space.seed(lane)
    for episode in range(episodes):
        env.reset(seed=100 * lane + episode)
        if video is not None and video.begin():
            video.frame(env.render())
        n = 0
        while True:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            n += 1
            if video is not None and video.recording:
                video.frame(env.render())
            if terminated or truncated:
                break
        if video is not None:
            video.end()
        lengths[(lane, episode)] = n
    env.close()


@NEEDS_PYGAME
def test_chosen_lanes_every_kth_episode_decode_to_length_plus_one_frames(tmp_path: Path) -> None:
    env = gym.make("CartPole-v1", render_mode="rgb_array")
    require_rgb_array(env.render_mode, "CartPole-v1")
    env.reset(seed=0)
    height, width, _ = env.render().shape
    recorder = VideoRecorder(
        tmp_path / "videos", lanes=[0, 2], every=2, fps=env.metadata["render_fps"], capacity=8
    )
    env.close()
    videos = {lane: recorder.lane(lane) for lane in range(3)}
    assert videos[1] is None  # not a chosen lane: the hook does not render
    lengths: dict[tuple[int, int], int] = {}
    threads = [
        threading.Thread(
            target=run_lane, args=(videos[lane], lane, 3, lengths), name=f"lane-{lane}"
        )
        for lane in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    recorder.close(60)

    expected = {(lane, episode) for lane in (0, 2) for episode in (0, 2)}
    names = sorted(p.name for p in (tmp_path / "videos").iterdir())
    assert names == sorted(video_name(lane, episode) for lane, episode in expected)
    assert sorted(p.name for p in recorder.files) == names
    for lane, episode in expected:
        frames = decode(tmp_path / "videos" / video_name(lane, episode))
        assert len(frames) == lengths[(lane, episode)] + 1
        assert {f.shape for f in frames} == {(height, width, 3)}
    assert recorder.bytes_written == sum(p.stat().st_size for p in recorder.files)
    assert not recorder.worker.alive


def test_odd_sized_frames_keep_their_size_and_close_ends_an_open_episode(tmp_path: Path) -> None:
    recorder = VideoRecorder(tmp_path, fps=15)
    video = recorder.lane(4)
    assert video is not None and video.begin()
    rng = np.random.default_rng(0)
    for _ in range(5):
        video.frame(rng.integers(0, 256, (33, 45, 3), dtype=np.uint8))
    recorder.close(60)  # the server stops mid-episode: the file is finished
    frames = decode(tmp_path / video_name(4, 0))
    assert len(frames) == 5 and frames[0].shape == (33, 45, 3)


def test_bad_frames_and_envs_without_rgb_array_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="render_mode='rgb_array'"):
        require_rgb_array(None, "CartPole-v1")
    recorder = VideoRecorder(tmp_path)
    video = recorder.lane(0)
    assert video is not None and video.begin()
    with pytest.raises(ValueError, match="H x W x 3 uint8"):
        video.frame(np.zeros((4, 4), np.uint8))
    video.frame(np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="in an episode of"):
        video.frame(np.zeros((6, 4, 3), np.uint8))
    assert video.end() == tmp_path / video_name(0, 0)
    assert video.begin() and video.end() is None  # an episode without frames: no file
    recorder.close(60)
    with pytest.raises(ValueError, match="every"):
        VideoRecorder(tmp_path, every=0)


def test_an_encoder_failure_is_raised(tmp_path: Path) -> None:
    recorder = VideoRecorder(tmp_path / "gone")
    video = recorder.lane(0)
    assert video is not None and video.begin()
    (tmp_path / "gone").rmdir()  # the files' directory disappears
    video.frame(np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(RecordingError, match="not written"):
        recorder.close(60)
