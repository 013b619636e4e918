"""Recording a served endpoint: the lanes' side of the recorders, and the server's.

The lane engine hands every reset and step job, with its result, to the lane's
:class:`LaneRecorder` on the lane's own thread (the parent-side lane thread, so thread and
process lanes alike), right where the job and its result meet. What is kept there is
references, in their wire form: the step job the env's action was decoded from (its
leaves are the step request's, shared by every lane it stepped), the observation
leaves the env's observation was encoded into, the info ``MetaMap`` (with ``record_infos``
only), reward and flags. No decoding, no copy, no encoding on the step path: the
:class:`~rlmesh_trio._record._dataset.DatasetWriter`'s thread decodes a finished episode
with the endpoint's codecs (:class:`WireDecoder`, in the storage child), which give back the values
the env saw and produced, bit for bit (the codec is lossless; the action is decoded the
way the lane decoded it).

Episode boundaries, as the lane sees them:

* a reset job answered starts an episode (one still open is cut: ``reset``, or
  ``session_close`` when the client's Join session ended since its last step), with the
  seed the client sent (None when it sent none);
* a step answered terminated or truncated ends it (the writer's queue gets it: ``put``
  blocks the lane while the queue is full, which is the backpressure);
* the env faulting in a job, or its incarnation ending while the lane goes on (rebuilt),
  cuts it (``lane_fault``); the lane's stop cuts it (``server_stop``, or
  ``session_close`` as for a reset);
* a client's Join session ending (not by the server's stop) marks an open episode as
  left (:meth:`LaneRecorder.session_closed`, from the transport thread: a mark on its
  :class:`OpenEpisode` record, no lock, no wait); the lane cuts it at its next reset or
  its stop, or unmarks it when the next session steps the lane on without a reset (the
  env's episode goes on, and so does its record). A step of the old session that
  completes after its Join ended unmarks it too (the reset then says ``reset``);
* a job the env never ran (refused, a bad action) changes nothing.

Under NEXT_STEP autoreset rlmesh's client resets a finished lane with a Reset request
(this server declares no autoreset of its own): the client's discarded action never
reaches the lane and is never recorded.

Video: for a lane chosen for it, at each reset and step of a recorded episode the lane
runs ``env.render()`` through its own executor (a :class:`~rlmesh_trio._jobs.CallJob`, so
on the env's own thread, or in the child of a process lane) and hands the frame to its
:class:`~rlmesh_trio._record._video.LaneVideo`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import outcome

from .._codec import from_meta_map
from .._jobs import CallJob, Job, Phases, ResetJob, ResetResult, StepJob, StepResult
from ._episode import CutReason, Episode, EpisodeAccumulator
from ._worker import RecordingError

if TYPE_CHECKING:
    import gymnasium as gym

    from .._jobs import EnvContract
    from .._options import Recording
    from ._dataset import DatasetWriter
    from ._video import LaneVideo, VideoRecorder

__all__ = ["LaneRecorder", "ServedRecording", "WireDecoder", "render_frame", "served_recording"]

logger = logging.getLogger("rlmesh_trio.record")

Execute = Callable[[Job, int], "tuple[outcome.Outcome[Any], Phases, bool]"]


DATASET_LINGER = 0.5
"""Seconds the dataset writer waits for a batch of episodes (16) before it writes fewer:
a crash loses at most what finished in the last half second (and the queue)."""


FIRST_RENDER_WAIT = 30.0
"""Seconds a lane's first render waits for another lane's to finish before it renders
anyway (a wedged render must not hold every other lane's video)."""

_FIRST_RENDERS = threading.Lock()
"""Each recorded lane's first render, one lane at a time, process-wide. An env library
may set itself up on its first render, and that is rarely thread-safe: pygame imports
``pygame.surfarray`` lazily, and 8 thread lanes rendering their first frames at once
lost whole lanes' videos at random (``module 'pygame.surfarray' has no attribute
'pixels3d'``). Once a lane has rendered, its renders run freely."""


def render_frame(env: gym.Env[Any, Any]) -> Any:
    """``env.render()``: a video frame, run as a lane job (module level, so it pickles
    for a process lane's child)."""
    return env.render()


class Failures:
    """What the lanes of one recording have lost, shared by their recorders (appends and
    set adds only: safe from the lane threads)."""

    def __init__(self) -> None:
        self.said: set[str] = set()
        """The writer failures logged already (each once, not once per lane)."""
        self.videos: list[tuple[int, str]] = []
        """The lanes whose video stopped (a render gave no frame), and why."""
        self._unrecorded: list[int] = []  # (list.append is atomic: no lock on the lanes)

    def unrecorded_episode(self, lane: int) -> None:
        """A lane that stopped recording finished an episode (it is not in the dataset)."""
        self._unrecorded.append(lane)

    @property
    def unrecorded(self) -> int:
        """Episodes finished by lanes that had stopped recording."""
        return len(self._unrecorded)


class OpenEpisode:
    """The episode a lane's recorder has open: whose it is, and whether the client left it.

    Made at each reset a lane answers; dropped when the episode ends or is cut. The
    transport thread marks it :attr:`left` without the recorder's lock: a mark that comes
    as the episode closes lands on this record, never on the next episode's."""

    __slots__ = ("left", "number")

    def __init__(self, number: int) -> None:
        self.number = number
        """The incarnation that reset it (an episode belongs to its incarnation)."""
        self.left = False
        """The client's Join session ended with the episode open (the cut's reason when
        the lane next resets, or stops); a step of the lane unmarks it."""


class LaneRecorder:
    """One lane's recording: its episode under way and, if chosen, its video.

    Called on the lane's thread; a lock makes a late call from an abandoned incarnation's
    thread harmless (an episode belongs to the incarnation that reset it: another one's
    cut does not touch it)."""

    __slots__ = (
        "_acc",
        "_failed",
        "_failures",
        "_lock",
        "_newest",
        "_open",
        "_rendered",
        "_video",
        "lane",
    )

    def __init__(
        self,
        lane: int,
        accumulator: EpisodeAccumulator | None,
        video: LaneVideo | None,
        failures: Failures | None = None,
    ) -> None:
        self.lane = lane
        self._failures = Failures() if failures is None else failures
        """Shared by the lanes of one recording: a writer's failure is logged once, not
        once per lane; the lanes whose video stopped are named at the stop."""
        self._acc = accumulator
        self._video = video
        self._lock = threading.Lock()
        self._open: OpenEpisode | None = None
        """The episode under way, or None."""
        self._newest = -1
        """The newest incarnation heard from: an older one (abandoned, its call returning
        late) is not heard any more."""
        self._failed = False
        self._rendered = False
        """This lane has rendered a frame (its first render is one at a time)."""

    @property
    def failed(self) -> bool:
        """This lane records no more (a writer failed: :meth:`_give_up`)."""
        return self._failed

    def session_closed(self) -> None:
        """The client's Join session ended (any thread; never waits)."""
        if (episode := self._open) is not None:
            episode.left = True

    def saw(
        self,
        number: int,
        job: Job,
        result: outcome.Outcome[Any],
        phases: Phases,
        execute: Execute,
    ) -> None:
        """Incarnation ``number`` answered ``job`` with ``result`` (not faulted). A reset
        or step whose env call ran but whose result was refused (an observation the
        strict policy refuses, an info that cannot be sent) cuts the episode: what the
        env did next is not what was recorded. A refused action changes nothing: the env
        never ran (the time inside the env call, ``phases.user_ns``, says which)."""
        if isinstance(result, outcome.Error):
            if phases.user_ns > 0 and isinstance(job, (StepJob, ResetJob)):
                self.cut(number, "lane_fault")
            return
        assert isinstance(result, outcome.Value)
        value = result.value
        try:
            with self._lock:
                if number < self._newest:
                    return  # an abandoned incarnation's call, returning late
                self._newest = number
                if isinstance(job, StepJob) and isinstance(value, StepResult):
                    episode = self._open
                    if episode is None or episode.number != number:
                        return  # no episode of this incarnation open
                    self._step(episode, job, value, execute)
                elif isinstance(job, ResetJob) and isinstance(value, ResetResult):
                    self._reset(number, job, value, execute)
        except Exception as exc:  # never the lane's problem: it goes on serving
            self._give_up(exc)

    def _reset(self, number: int, job: ResetJob, value: ResetResult, execute: Execute) -> None:
        episode = self._open
        if episode is not None:
            if episode.number < number:
                # The episode of an incarnation that was abandoned (its call wedged past
                # --lane-timeout-seconds: its thread never came back to cut it) ends as
                # the fault it was, not as this reset.
                if self._video is not None:
                    self._video.end()
                if self._acc is not None and self._acc.in_episode:
                    self._acc.cut("lane_fault")
            elif episode.left and self._acc is not None and self._acc.in_episode:
                self._acc.cut("session_close")
        self._open = OpenEpisode(number)
        if self._acc is not None:
            self._acc.reset(value.observation, job.seed, value.info)
        video = self._video
        if video is not None and video.begin():
            self._frame(video, execute)

    def _step(
        self, episode: OpenEpisode, job: StepJob, value: StepResult, execute: Execute
    ) -> None:
        episode.left = False
        ended = value.terminated or value.truncated
        video = self._video
        if video is not None and video.recording:
            self._frame(video, execute)
            if ended:
                video.end()
        if ended:
            self._open = None
            if self._failed:
                self._failures.unrecorded_episode(self.lane)
        if self._acc is not None:
            self._acc.step(
                job, value.observation, value.reward, value.terminated, value.truncated, value.info
            )

    def _frame(self, video: LaneVideo, execute: Execute) -> None:
        if self._rendered:
            frame, _phases, _faulted = execute(CallJob(render_frame), 0)
        else:
            held = _FIRST_RENDERS.acquire(timeout=FIRST_RENDER_WAIT)
            try:
                frame, _phases, _faulted = execute(CallJob(render_frame), 0)
            finally:
                if held:
                    _FIRST_RENDERS.release()
            self._rendered = True
        try:
            if not isinstance(frame, outcome.Value) or frame.value is None:
                raise ValueError(f"env.render() gave no frame ({frame!r})")
            video.frame(frame.value)
        except ValueError as exc:
            # This lane records no more video (the env goes on; its dataset too).
            logger.error("lane %d: video recording stopped: %s", self.lane, exc)
            self._failures.videos.append((self.lane, str(exc)))
            video.end()
            self._video = None

    def cut(self, number: int, reason: CutReason) -> None:
        """Incarnation ``number`` ended (``lane_fault``) or the lane stopped
        (``server_stop``): cut its episode, if one is open."""
        try:
            with self._lock:
                episode = self._open
                if episode is None or episode.number != number or number < self._newest:
                    return
                if episode.left and reason == "server_stop":
                    reason = "session_close"
                self._open = None
                if self._video is not None:
                    self._video.end()
                if self._acc is not None:
                    self._acc.cut(reason)
        except Exception as exc:
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        """A writer failed (or recording this lane did): stop recording this lane (the
        env and its client go on; a writer's failure is raised when the server stops)."""
        self._acc = None
        self._video = None
        if not self._failed:
            self._failed = True
            said = str(exc)
            if said not in self._failures.said:  # (a race may say it twice: harmless)
                self._failures.said.add(said)
                logger.error(
                    "recording stopped (lane %d first; the server goes on, the episodes not "
                    "yet written are lost): %s",
                    self.lane,
                    exc,
                )


class WireDecoder:
    """The writer's side of an episode in wire form: the env's values, with the
    endpoint's codecs (the action decoded as the lane decoded it). Picklable (the codecs
    are): the dataset's storage child decodes with it, off the server's GIL."""

    __slots__ = ("_action", "_observation")

    def __init__(self, contract: EnvContract) -> None:
        self._observation = contract.observation_codec
        self._action = contract.action_codec

    def __getstate__(self) -> tuple[Any, Any]:
        return self._observation, self._action

    def __setstate__(self, state: tuple[Any, Any]) -> None:
        self._observation, self._action = state

    def __call__(self, episode: Episode) -> Episode:
        obs_codec, action_codec = self._observation, self._action
        observations = [obs_codec.decode(leaves, 1)[0] for leaves in episode.observations]
        actions = []
        for job in episode.actions:  # each the StepJob, decoded as the lane decoded it
            action, _ = action_codec.step_action(
                job.leaves, job.n, job.row, validated=job.validated, soft_checks=False
            )
            actions.append(action)
        infos = None
        if episode.infos is not None:
            infos = [from_meta_map(meta) for meta in episode.infos]
        return dataclasses.replace(episode, observations=observations, actions=actions, infos=infos)


class ServedRecording:
    """The server's recorders, made once the contract is agreed (:meth:`start`), closed
    after the lanes stopped (:meth:`close`).

    ``make_writer(observation_space, action_space, decode)`` makes the dataset writer
    (None: no dataset); ``make_video(contract)`` the video recorder (None: no video)."""

    def __init__(
        self,
        *,
        make_writer: Callable[[EnvContract, Callable[[Episode], Episode]], DatasetWriter]
        | None = None,
        make_video: Callable[[EnvContract], VideoRecorder] | None = None,
        record_infos: bool = False,
        drop_faulted: bool = False,
    ) -> None:
        self._make_writer = make_writer
        self._make_video = make_video
        self._record_infos = record_infos
        self._drop_faulted = drop_faulted
        self.writer: DatasetWriter | None = None
        self.video: VideoRecorder | None = None
        self._recorders: list[LaneRecorder] = []
        self._failures = Failures()

    def start(self, contract: EnvContract, num_envs: int) -> list[LaneRecorder | None]:
        """Make the writers (a startup error raises here) and one recorder per lane."""
        if self._make_video is not None:
            self.video = self._make_video(contract)
        try:
            if self._make_writer is not None:
                self.writer = self._make_writer(contract, WireDecoder(contract))
        except BaseException:
            if self.video is not None:
                self.video.close()
            raise
        recorders: list[LaneRecorder | None] = []
        failures = self._failures
        for lane in range(num_envs):
            acc = None
            if self.writer is not None:
                acc = EpisodeAccumulator(
                    lane,
                    contract.observation_space,
                    contract.action_space,
                    self.writer.put,
                    record_infos=self._record_infos,
                    drop_faulted=self._drop_faulted,
                    copy=False,
                )
            video = self.video.lane(lane) if self.video is not None else None
            recorders.append(
                None if acc is None and video is None else LaneRecorder(lane, acc, video, failures)
            )
        self._recorders = [recorder for recorder in recorders if recorder is not None]
        return recorders

    def session_closed(self) -> None:
        """A client's Join session ended while the server goes on (the transport thread):
        every lane's open episode is marked as left by it."""
        for recorder in self._recorders:
            recorder.session_closed()

    def close(self, timeout: float | None = None) -> None:
        """After the lanes stopped: write what is queued, close the files; raise the
        first writer's error. ``timeout`` bounds the whole (video and dataset together)."""
        errors: list[BaseException] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        closers: list[Callable[[float | None], None]] = []
        if self.video is not None:
            closers.append(self.video.close)
        if self.writer is not None:
            closers.append(
                functools.partial(self.writer.close, unrecorded=self._failures.unrecorded)
            )
        for close in closers:
            try:
                close(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except BaseException as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        videos = self._failures.videos
        if videos:
            lanes = sorted({lane for lane, _ in videos})
            raise RecordingError(
                f"video recording stopped on lanes {lanes} (their later episodes have no "
                f"video): lane {videos[0][0]}: {videos[0][1]}"
            )

    def counters(self) -> list[tuple[str, int, int, int, int, int]]:
        """Each recorder's name, queue depth, items and bytes written, put wait (ns), and
        the lanes it records no more, for the metrics."""
        out = []
        for name, recorder in (("dataset", self.writer), ("video", self.video)):
            if recorder is not None:
                w = recorder.worker
                if name == "video":
                    lost = len({lane for lane, _ in self._failures.videos})
                else:
                    lost = sum(1 for r in self._recorders if r.failed)
                out.append((name, w.depth, w.items_written, w.bytes_written, w.put_wait_ns, lost))
        return out


def served_recording(
    plan: Recording, make_env: object, env_kwargs: Mapping[str, Any] | None, num_envs: int
) -> ServedRecording:
    """The recorders ``plan`` asks for, checked as far as they can be before any env is
    built: the ``record`` extra is installed, the dataset id is well formed and free, the
    video lanes exist."""
    make_writer = make_video = None
    if plan.video_lanes is not None and max(plan.video_lanes) >= num_envs:
        raise ValueError(
            f"record_video_lanes {sorted(plan.video_lanes)} names a lane beyond the "
            f"{num_envs} served (lanes 0 to {num_envs - 1})"
        )
    dataset_id = plan.dataset
    if dataset_id is not None:
        from ._continue import exists_error
        from ._dataset import DatasetWriter, dataset_path, env_spec_for

        root = dataset_path(dataset_id)  # ImportError naming the extra
        from minari.dataset.minari_dataset import parse_dataset_id

        parse_dataset_id(dataset_id)  # ValueError naming the form, before any env is built
        if root.exists() and not plan.append:
            raise exists_error(dataset_id, root)
        kwargs = dict(env_kwargs or {})

        def make_writer(
            contract: EnvContract, decode: Callable[[Episode], Episode]
        ) -> DatasetWriter:
            name = make_env if isinstance(make_env, str) else contract.env_id
            try:
                spec = env_spec_for(name, kwargs)
            except Exception:  # not a registered id: the dataset has no env spec
                spec = None
            return DatasetWriter(
                dataset_id,
                contract.observation_space,
                contract.action_space,
                env_spec=spec,
                record_infos=plan.infos,
                prepare=decode,
                append=plan.append,
                linger=DATASET_LINGER,
                own_process=True,  # Minari's HDF5 work off the server's GIL
            )

    directory = plan.video
    if directory is not None:
        from ._video import VideoRecorder, _import_av, require_rgb_array

        _import_av()

        def make_video(contract: EnvContract) -> VideoRecorder:
            require_rgb_array(contract.render_mode or None, contract.env_id)
            metadata = from_meta_map(contract.metadata)
            fps = metadata.get("render_fps")
            return VideoRecorder(
                directory,
                lanes=plan.video_lanes,
                every=plan.video_every,
                fps=float(fps) if isinstance(fps, int | float) and fps > 0 else 30.0,
            )

    return ServedRecording(
        make_writer=make_writer,
        make_video=make_video,
        record_infos=plan.infos,
        drop_faulted=plan.drop_faulted,
    )
