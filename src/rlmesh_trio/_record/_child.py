"""The dataset's storage in a process of its own: Minari's HDF5 work off the server's GIL.

Writing an episode into Minari's HDF5 storage costs far more CPU than serving its steps
(an ``h5py`` dataset per field per episode, the metadata file rewritten per batch), and
it holds the GIL while it runs: in the server's writer thread it slowed the lanes and the
transport (issue 33: 0.76x the steps/s of the same server without recording). The
:class:`~rlmesh_trio._record._dataset.DatasetWriter`'s thread therefore hands each batch,
as the lanes queued it (wire forms: the step jobs, the observations' leaves), to a child
that decodes it, stacks it into Minari's ``EpisodeBuffer`` and stores it
(:func:`~rlmesh_trio._record._store.store_batch`): ``python -m rlmesh_trio._recordchild
FD PARENT_PID`` (a plain child over a socketpair, :mod:`rlmesh_trio._pipe`, as process
lanes are). What is left on the server's side is pickling the batch.

The protocol, strictly request and answer, one batch in flight (the writer waits for
its answer, so the bounded queue in front of it stays the backpressure):

* parent → child, first: the parent's ``sys.path`` (so that what the server imports from
  ``--app-dir`` or ``--package`` unpickles in the child too), then, pickled apart, the
  storage object (Minari's ``MinariStorage`` the parent created, so the dataset's spaces
  and settings are the parent's, bit for bit) and the episodes' decoder
  (:class:`~rlmesh_trio._record._served.WireDecoder`, or None);
  child → parent: ``("ready",)``, or ``("error", text)`` and exit;
* a batch's episodes, each pickled apart as ``("episode", episode)``: those up to
  :data:`GROUP_BYTES` together in ``("group", [pickled, ...], None)``, a bigger one alone
  (the 4-byte length frames up to 4 GiB, and a batch of pixel episodes can be more),
  each message answered ``("ok",)``; the last message is ``("group", [pickled, ...],
  first_id)`` (its list may be empty): the child stores the batch and answers ``("done",
  steps, dropped)`` (the steps written; the episodes whose infos it could not store, for
  the parent's counters and log) or ``("error", text)``. A batch of small episodes is one
  round trip;
* ``("close",)``, or the pipe's end: the child exits. It also dies with the server
  (``PR_SET_PDEATHSIG`` on Linux; it is started from the writer's thread, which lives
  until the writer is closed).

A child that dies or breaks the protocol fails the writer (:class:`RecordingError`, which
the server reports when it stops), the lanes go on serving. Messages from the parent are
trusted (the child accepts any size the frame allows: an episode of Atari frames is
hundreds of MiB); the parent accepts only short answers from the child. The child
ignores SIGINT and SIGTERM (a terminal's Ctrl-C and a service manager's stop reach the
whole process group; the server decides when its child stops, after the last batch).

An episode is pickled by :func:`dumps`: its actions (the lanes' step jobs) as their
fields, the leaves a big request's decoder left as
read-only memoryviews go as bytes, and an info ``MetaMap`` as its wire bytes (betterproto's
own pickling serialises it in pure Python, ~20x slower).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import subprocess
import sys
from typing import Any

from .._jobs import StepJob
from .._pipe import FRAME_LIMIT, PipeEnd, PipeViolation, die_with_parent, start_child
from .._proto.rlmesh.spaces import v1 as spaces_v1
from .._wire import decode_message, encode_meta_map
from ._worker import RecordingError

__all__ = [
    "CHILD_STOP_TIMEOUT",
    "GROUP_BYTES",
    "StorageChild",
    "storage_child_main",
]

CHILD_STOP_TIMEOUT = 10.0
"""Seconds the child gets to exit after ``close`` (it has nothing left to write then:
every batch was answered), before SIGKILL."""

ANSWER_CAP = 1 << 20
"""The longest answer the parent reads from its child (an error's text is the longest)."""

GROUP_BYTES = 4 << 20
"""Episodes up to this size (pickled) are sent to the child together, in one message of
at most about this size: a round trip per batch, not per episode. A bigger one goes
alone (its bytes are not copied into a group)."""

TRUSTED_CAP = FRAME_LIMIT
"""What the child accepts from its parent: anything the frame holds (the parent is the
server)."""


def meta_map(data: bytes) -> spaces_v1.MetaMap:
    """An info map from its wire bytes (what :func:`dumps` sends for one)."""
    return decode_message(spaces_v1.MetaMap, data)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is StepJob:  # an episode's actions: copyreg's way is ~4x slower
            return StepJob, (obj.leaves, obj.n, obj.row, obj.validated, obj.id)
        if type(obj) is memoryview:
            return bytes, (obj.tobytes(),)
        if type(obj) is spaces_v1.MetaMap:
            return meta_map, (encode_meta_map(obj),)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for the storage child (see the module's docstring)."""
    out = io.BytesIO()
    _Pickler(out, pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


class StorageChild:
    """The writer thread's handle on its storage child. Made, used and closed on that
    one thread (PR_SET_PDEATHSIG follows the thread that started the child)."""

    def __init__(self, setup: Any, name: str) -> None:
        self._process, ours = start_child("rlmesh_trio._recordchild", name)
        self._conn = PipeEnd(ours, ANSWER_CAP)
        try:
            self._conn.send((list(sys.path), pickle.dumps(setup, pickle.HIGHEST_PROTOCOL)))
            self._answer("start")
        except BaseException:
            self.kill()
            self._conn.close()
            raise

    def write(self, episodes: list[Any], first: int) -> tuple[int, list[tuple[int, int, str]]]:
        """Store one batch (episode ids ``first``, ``first + 1``, ...): the steps written
        and the infos dropped; raise :class:`RecordingError` when the child failed or is
        gone. Small episodes go together (one message and one answer for a whole batch
        of CartPole episodes), a big one alone, never copied once more."""
        group: list[bytes] = []
        size = 0
        for episode in episodes:
            data = dumps(("episode", episode))
            if group and size + len(data) > GROUP_BYTES:
                self._send(dumps(("group", group, None)))
                self._answer("episode")
                group, size = [], 0
            if len(data) > GROUP_BYTES:
                self._send(data)
                self._answer("episode")
            else:
                group.append(data)
                size += len(data)
        self._send(dumps(("group", group, first)))
        answer = self._answer("write")
        return answer[1], answer[2]

    def _send(self, data: bytes) -> None:
        try:
            self._conn.send_pickled(data)
        except OSError as exc:
            raise self._gone(f"the pipe to it broke ({exc})") from None
        except ValueError as exc:  # over the frame limit: this episode cannot go
            raise RecordingError(f"an episode could not be sent to the storage: {exc}") from None

    def _answer(self, what: str) -> Any:
        try:
            answer = self._conn.recv()
        except EOFError:
            raise self._gone("it exited") from None
        except (OSError, PipeViolation) as exc:
            self.kill()
            raise self._gone(str(exc)) from None
        if (what, answer) in (("start", ("ready",)), ("episode", ("ok",))):
            return answer
        if (
            what == "write"
            and isinstance(answer, tuple)
            and len(answer) == 3
            and answer[0] == "done"
            and isinstance(answer[1], int)
            and isinstance(answer[2], list)
        ):
            return answer
        if isinstance(answer, tuple) and len(answer) == 2 and answer[0] == "error":
            raise RecordingError(f"the dataset's storage process failed: {answer[1]}")
        self.kill()
        raise self._gone(f"it answered {answer!r:.100}")

    def _gone(self, how: str) -> RecordingError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(1.0)
        code = self._process.returncode
        status = "still running" if code is None else f"exit status {code}"
        return RecordingError(f"the dataset's storage process is gone: {how} ({status})")

    def close(self) -> None:
        """Ask the child to exit; kill it if it has not within :data:`CHILD_STOP_TIMEOUT`."""
        with contextlib.suppress(OSError):
            self._conn.send(("close",))
        try:
            self._process.wait(CHILD_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
        self._conn.close()

    def rss(self) -> int | None:
        """The child's resident memory in bytes (Linux), else None."""
        try:
            with open(f"/proc/{self._process.pid}/statm") as statm:
                pages = int(statm.read().split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return pages * os.sysconf("SC_PAGE_SIZE")

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self._process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(CHILD_STOP_TIMEOUT)


def storage_child_main(conn: PipeEnd, parent_pid: int) -> None:
    """The child's whole life: open the storage, store batches until closed."""
    die_with_parent(parent_pid)
    for name in ("SIGINT", "SIGTERM"):  # the server stops us, after the last batch
        if (number := getattr(signal, name, None)) is not None:
            signal.signal(number, signal.SIG_IGN)
    from ._store import store_batch

    try:
        path, setup = conn.recv()
        sys.path[:] = path
        storage, prepare = pickle.loads(setup)  # unpickling the storage imports minari
    except EOFError:
        return
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready",))
    episodes: list[Any] = []
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        except PipeViolation as exc:  # (a server's message that does not unpickle here)
            conn.send(("error", str(exc)))
            return
        if message[0] == "episode":  # a big one, alone
            episodes.append(message[1])
            conn.send(("ok",))
            continue
        if message[0] != "group":
            return  # ("close",)
        _tag, group, first = message
        try:
            episodes.extend(pickle.loads(data)[1] for data in group)
        except Exception as exc:  # (a server's episode that does not unpickle here)
            conn.send(("error", f"an episode does not unpickle: {type(exc).__name__}: {exc}"))
            return
        if first is None:
            conn.send(("ok",))
            continue
        try:
            steps, dropped = store_batch(storage, prepare, episodes, first)
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            return
        episodes = []
        conn.send(("done", steps, dropped))
