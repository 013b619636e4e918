"""Chosen lanes' episodes to video files, encoded off the step path.

A :class:`VideoRecorder` owns one encoder thread (a
:class:`~rlmesh_trio._record._worker.BoundedWorker`) and hands each chosen lane a
:class:`LaneVideo`, used on that lane's own thread, where the env renders (a GL context
lives on the thread that made it): at each reset ``begin()`` says whether this episode is
recorded (every ``every``-th episode of the lane: 0, K, 2K, ...), and if so the lane passes
``frame(env.render())`` after the reset and after each step, then ``end()``. A frame is
copied and queued; the encoder thread streams it into the episode's file, so memory holds
at most ``capacity`` frames, not whole episodes (a full queue makes the lane wait, as the
dataset writer does).

Files: ``DIR/lane-LLL-episode-EEEEEE.mp4`` (the lane's episode counter), H.264 with PyAV's
bundled ffmpeg (libx264, ``yuv420p`` so that any player plays it; ``yuv444p`` when the frame
has an odd side, which 4:2:0 cannot hold), one frame per render: episode length + 1.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from ._worker import BoundedWorker

__all__ = ["LaneVideo", "VideoRecorder", "require_rgb_array", "video_name"]

INSTALL_HINT = (
    "video recording needs PyAV: the record extra (pip install '.[record]' from a clone, "
    "or the wheel's [record])"
)


def _import_av() -> Any:
    try:
        import av
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return av


def require_rgb_array(render_mode: str | None, env_id: str = "the env") -> None:
    """Raise ``ValueError`` naming the fix unless the env renders ``rgb_array`` frames
    (for the server's startup check, before any lane runs)."""
    if render_mode != "rgb_array":
        raise ValueError(
            f"video recording renders {env_id} as rgb_array frames, but its render_mode is "
            f"{render_mode!r}: make it with render_mode='rgb_array' (rlmesh-trio serve: "
            '--kwargs-json \'{"render_mode": "rgb_array"}\'; serve_env: '
            "env_kwargs={'render_mode': 'rgb_array'}), or record no video"
        )


def video_name(lane: int, episode: int) -> str:
    """The file name of lane ``lane``'s episode ``episode``."""
    return f"lane-{lane:03d}-episode-{episode:06d}.mp4"


@dataclass(slots=True, frozen=True)
class _Message:
    lane: int
    episode: int
    frame: np.ndarray[Any, Any] | None  # None: the episode ended


@dataclass(slots=True)
class _Open:
    container: Any
    stream: Any
    path: Path
    frames: int = 0


class LaneVideo:
    """One lane's side of a :class:`VideoRecorder`; used on the lane's thread only."""

    def __init__(self, recorder: VideoRecorder, lane: int) -> None:
        self._recorder = recorder
        self.lane = lane
        self.episodes = 0
        """Episodes begun on this lane (recorded or not): the next one's number."""
        self.recording = False
        """Whether the episode under way is recorded (render and pass frames)."""
        self._episode = -1
        self._shape: tuple[int, ...] | None = None
        self.frames = 0
        """Frames passed for the episode under way."""

    def begin(self) -> bool:
        """A new episode starts (call at every reset): end one still recorded, and say
        whether this one is recorded."""
        if self.recording:
            self.end()
        index, self.episodes = self.episodes, self.episodes + 1
        self.recording = index % self._recorder.every == 0
        if self.recording:
            self._episode = index
            self._shape = None
            self.frames = 0
        return self.recording

    def frame(self, frame: Any) -> None:
        """One rendered frame (``H x W x 3`` uint8) of the recorded episode."""
        if not self.recording:
            return
        array = np.array(frame, copy=True)  # the env may render into one buffer again
        if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
            raise ValueError(
                f"lane {self.lane}: a video frame must be H x W x 3 uint8 (an rgb_array "
                f"render), not {array.shape} {array.dtype}"
            )
        if self._shape is None:
            self._shape = array.shape
        elif array.shape != self._shape:
            raise ValueError(
                f"lane {self.lane}: frame of {array.shape} in an episode of {self._shape} frames"
            )
        self.frames += 1
        self._recorder._worker.put(_Message(self.lane, self._episode, array))

    def end(self) -> Path | None:
        """The recorded episode ended (by the env or cut): its file is finished on the
        encoder's thread. Returns where it will be, or None if nothing was recorded."""
        if not self.recording:
            return None
        self.recording = False
        if self.frames == 0:
            return None
        self._recorder._worker.put(_Message(self.lane, self._episode, None))
        return self._recorder.directory / video_name(self.lane, self._episode)


class VideoRecorder:
    """Video files of chosen lanes' episodes in ``directory``.

    ``lanes``: the lanes recorded (None: all). ``every``: every K-th episode of each of
    them (1: all). ``fps``: the files' frame rate (the env's ``render_fps`` metadata, say).
    ``capacity``: frames queued before a lane waits."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        lanes: Collection[int] | None = None,
        every: int = 1,
        fps: float = 30.0,
        capacity: int = 256,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        self._av = _import_av()
        if every < 1:
            raise ValueError(f"every must be at least 1, not {every}")
        if fps <= 0:
            raise ValueError(f"fps must be positive, not {fps}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.lanes = None if lanes is None else frozenset(lanes)
        self.every = every
        self.fps = Fraction(fps).limit_denominator(1001)
        self._lane_videos: dict[int, LaneVideo] = {}
        self._open: dict[tuple[int, int], _Open] = {}
        self.files: list[Path] = []
        """The finished files, in the order they were closed."""
        self._worker: BoundedWorker[_Message] = BoundedWorker(
            f"rlmesh-trio-video[{self.directory.name}]",
            self._write,
            capacity=capacity,
            on_batch=on_batch,
        )

    def lane(self, lane: int) -> LaneVideo | None:
        """Lane ``lane``'s recorder, or None when the lane is not recorded (call once per
        lane, at its start)."""
        if self.lanes is not None and lane not in self.lanes:
            return None
        return self._lane_videos.setdefault(lane, LaneVideo(self, lane))

    @property
    def depth(self) -> int:
        return self._worker.depth

    @property
    def bytes_written(self) -> int:
        """The finished files' sizes, summed."""
        return self._worker.bytes_written

    @property
    def worker(self) -> BoundedWorker[_Message]:
        return self._worker

    def close(self, timeout: float | None = None) -> None:
        """End every episode still recorded (call once the lanes have stopped), encode
        what is queued, close the files; raise the encoder's error if it failed."""
        for video in self._lane_videos.values():
            if video.recording and self._worker.error is None:
                video.end()
        try:
            self._worker.close(timeout)
        finally:
            # Only after a failure (their end never came): close the files as they are;
            # the failure itself is what ``close`` raises.
            for key in list(self._open):
                with contextlib.suppress(Exception):
                    self._finish(key)

    # -- the encoder's thread -------------------------------------------------------

    def _write(self, batch: list[_Message]) -> int:
        written = 0
        for message in batch:
            key = (message.lane, message.episode)
            if message.frame is None:
                written += self._finish(key)
                continue
            state = self._open.get(key)
            if state is None:
                state = self._start(key, message.frame.shape)
            frame = self._av.VideoFrame.from_ndarray(message.frame, format="rgb24")
            state.container.mux(state.stream.encode(frame))
            state.frames += 1
        return written

    def _start(self, key: tuple[int, int], shape: tuple[int, ...]) -> _Open:
        height, width = shape[0], shape[1]
        path = self.directory / video_name(*key)
        container = self._av.open(str(path), mode="w")
        try:
            stream = container.add_stream("libx264", rate=self.fps)
            stream.width, stream.height = width, height
            stream.pix_fmt = "yuv420p" if width % 2 == 0 and height % 2 == 0 else "yuv444p"
            stream.thread_count = 1  # one core at most: the lanes need the others
            stream.options = {"preset": "veryfast"}
        except BaseException:
            container.close()
            raise
        state = self._open[key] = _Open(container, stream, path)
        return state

    def _finish(self, key: tuple[int, int]) -> int:
        state = self._open.pop(key, None)
        if state is None:
            return 0
        try:
            state.container.mux(state.stream.encode(None))
        finally:
            state.container.close()
        self.files.append(state.path)
        return state.path.stat().st_size
