"""Recording what the server serves (issue 33): every episode into a Minari dataset,
chosen lanes to video, written off the step path.

The pieces, each usable alone and importable without the ``record`` extra (minari and
PyAV are imported when a writer is made):

* :class:`EpisodeAccumulator` (``_episode``): one per lane, fed plain data; hands each
  finished or cut episode to a sink.
* :class:`DatasetWriter` (``_dataset``): the sink; a Minari dataset written on one plain
  thread of its own through a bounded queue (``put`` blocks when full).
* :class:`VideoRecorder` / :class:`LaneVideo` (``_video``): frames of chosen lanes'
  episodes, encoded on an encoder thread of its own.
* :class:`BoundedWorker` (``_worker``): the queue and thread both use; its counters
  (``depth``, ``bytes_written``, ``put_wait_ns``, ...) are what the metrics module reads.

Where the hooks go (nothing here imports the lanes or the session, nor they this yet):

* **Server start** (``_serve``, with ``ServeOptions.record_dataset`` / ``record_video``):
  one ``DatasetWriter(ID, contract observation/action spaces,
  env_spec=env_spec_for(env_id, env_kwargs), record_infos=...)``; one
  ``VideoRecorder(DIR, lanes=..., every=K, fps=env.metadata["render_fps"])`` after
  ``require_rgb_array(env.render_mode, env_id)`` on the first lane's env. Per lane, at the
  lane's start: ``EpisodeAccumulator(lane, spaces, writer.put, record_infos=...,
  drop_faulted=...)`` and ``recorder.lane(lane)`` (None: not recorded).
* **Lane thread** (``_lanes/_work.LaneWork._reset`` / ``_step``, where the env runs): after
  ``env.reset(seed=s)``: ``acc.reset(obs, s, info)`` with the seed the client sent (None
  when it sent none: never one we invent), then ``if video.begin():
  video.frame(env.render())``; after ``env.step(a)``: ``acc.step(a, obs, r, term, trunc,
  info)`` with the action exactly as the env received it (after decoding, before any
  clipping of ours: we do none), then ``if video.recording: video.frame(env.render())``
  and, when the episode ended, ``video.end()``. Rendering stays on the lane thread (GL
  contexts live there); encoding and writing do not. ``put`` may block: that is the
  backpressure, and it blocks only that lane.
* **NEXT_STEP autoreset**: where a step request on a finished lane is served as a reset
  (the client's action discarded), the hook calls ``acc.reset`` (and ``video.begin``),
  never ``acc.step``: the discarded action is not recorded.
* **Session / lanes, cuts**: a lane fault calls ``acc.cut("lane_fault")`` (on the lane's
  thread, or on the supervisor's once the lane's thread is gone) and ``video.end()``; a
  session's close ``acc.cut("session_close")`` for each of its lanes; the server's stop
  ``acc.cut("server_stop")`` for every lane, then ``writer.close()`` and
  ``recorder.close()`` after the lanes stopped (a normal stop loses nothing).
* **Metrics**: gauges from ``writer.depth`` / ``recorder.depth``, counters from
  ``bytes_written`` and ``worker.put_wait_ns`` (or the ``on_batch`` callbacks).
"""

from __future__ import annotations

from ._dataset import CUT_INFO_KEY, DatasetWriter, InfoMismatch, dataset_path, env_spec_for
from ._episode import (
    CUT_REASONS,
    CutReason,
    Episode,
    EpisodeAccumulator,
    UnsupportedSpaceError,
    check_space,
)
from ._video import LaneVideo, VideoRecorder, require_rgb_array, video_name
from ._worker import BoundedWorker, RecordingError

__all__ = [
    "CUT_INFO_KEY",
    "CUT_REASONS",
    "BoundedWorker",
    "CutReason",
    "DatasetWriter",
    "Episode",
    "EpisodeAccumulator",
    "InfoMismatch",
    "LaneVideo",
    "RecordingError",
    "UnsupportedSpaceError",
    "VideoRecorder",
    "check_space",
    "dataset_path",
    "env_spec_for",
    "require_rgb_array",
    "video_name",
]
