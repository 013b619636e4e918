"""Recording what the server serves (issue 33): every episode into a Minari dataset,
chosen lanes to video, written off the step path.

The pieces, each usable alone and importable without the ``record`` extra (minari and
PyAV are imported when a writer is made):

* :class:`EpisodeAccumulator` (``_episode``): one per lane, fed plain data; hands each
  finished or cut episode to a sink.
* :class:`DatasetWriter` (``_dataset``): the sink; a Minari dataset written on one plain
  thread of its own through a bounded queue (``put`` blocks when full). ``_seal``: each
  batch reckoned against the room left before it is written, the episodes that read
  whole kept after a failure, and ``metadata.json`` saying what the dataset holds.
* :class:`VideoRecorder` / :class:`LaneVideo` (``_video``): frames of chosen lanes'
  episodes, encoded on an encoder thread of its own.
* :class:`BoundedWorker` (``_worker``): the queue and thread both use; its counters
  (``depth``, ``bytes_written``, ``put_wait_ns``, ...) are what the metrics module reads.

How the server uses them (:mod:`._served`; nothing here imports the lanes or the
session):

* **Server start** (``_serve.serve_env``, with ``ServeOptions.record_dataset`` /
  ``record_video``): :func:`~._served.served_recording` checks what it can before any env
  is built (the extra installed, the dataset id well formed and free, the video lanes
  served); the lane engine calls :meth:`~._served.ServedRecording.start` once the
  contract is agreed, which makes the ``DatasetWriter`` (contract spaces,
  ``env_spec_for(id, kwargs)``) and the ``VideoRecorder`` (after ``require_rgb_array``)
  and one :class:`~._served.LaneRecorder` per lane.
* **Lane thread** (``_lanes/_thread.LaneThreads._serve``, the parent-side lane thread,
  for thread and process lanes alike): after each job, ``recorder.saw(incarnation, job,
  result, execute)`` -- an ``EpisodeAccumulator(copy=False)`` keeps the wire forms (the
  ``StepJob``, the observation leaves, the info ``MetaMap``) and the writer's thread
  decodes them (``DatasetWriter(prepare=...)``); video frames are ``env.render()`` run
  through the lane's own executor. A faulted job, and the end of an incarnation, call
  ``recorder.cut`` (``lane_fault``, or ``server_stop`` when the lane stops).
* **Transport thread**: a Join session that ends while the server goes on calls
  ``ServedRecording.session_closed`` (a flag per lane, no wait): the open episode's cut
  then says ``session_close``.
* **Stop**: after the lanes stopped (their open episodes cut and queued),
  ``ServedRecording.close`` writes what is queued and raises a writer's failure, or
  names the lanes whose video stopped.
* **Metrics**: ``ServedRecording.counters`` (queue depth, items and bytes written, put
  wait, lanes stopped), read at each scrape.
"""

from __future__ import annotations

from ._dataset import DatasetWriter, dataset_path, env_spec_for
from ._episode import (
    CUT_REASONS,
    CutReason,
    Episode,
    EpisodeAccumulator,
    UnsupportedSpaceError,
    check_space,
)
from ._store import CUT_INFO_KEY, InfoMismatch
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
