"""Process lanes (``lane_isolation="process"``): a lane's env in a child process of its own.

The lane's thread in the server becomes a *proxy*: it routes each job's wire data (action
leaves in, observation leaves and an info map out) over a pipe to the child, which builds
the env, decodes the action, calls the env and encodes the result exactly as a thread
lane does (:class:`~rlmesh_trio._lanes._work.LaneWork`), on its main thread, for the env's
whole life. A child that segfaults, is killed, or calls ``os._exit`` is seen as a closed
pipe: the job in flight is answered as a fault naming the lane and the signal. A child
that hangs, even holding its own GIL, costs the server nothing: the server's transport
and the other lanes run in another process, and the watchdog kills the child. The pipe is
read as the network is (env code in the child can write anything to it): a message's
buffer grows with the bytes that came, a length over :data:`PIPE_MESSAGE_CAP`, bytes past
a message or bytes that do not unpickle get the child killed, and the job in flight is
answered as for a child that died, naming the lane and what the child sent.

A step or reset posted while the proxy waits on an empty mailbox is written to the
child's pipe by the posting thread itself (:meth:`ChildLane.send_ahead`,
:meth:`._lane.Lane.await_job`): the child runs it while the proxy is still being woken,
and the proxy only reads the answer (:meth:`ChildLane.finish`). The pipe still carries
one request at a time, in the mailbox's order (a lane with jobs queued takes none
ahead), and the env is still touched only by the child. Measured in docs/bench.md
(issue 32: the server's system CPU per vector step down a quarter).

Why a plain child (``python -m rlmesh_trio._lanechild``, a socketpair carrying pickled
messages, :class:`PipeEnd`) and not trio-parallel or ``multiprocessing``'s
``Process``: a lane needs ONE dedicated process for the env's whole life (GL contexts,
simulators with state) that its supervisor can kill on its own, which trio-parallel's
pool of interchangeable workers does not give; ``fork`` is out (the server has threads,
and a fork copies their locks in whatever state they are in), and ``spawn`` re-runs the
caller's ``__main__`` in every child, which breaks any program that embeds ``serve_env``
without a ``__main__`` guard. The child gets the parent's ``sys.path`` and the pickled
factory, so ``--app-dir`` modules, ``module:callable`` entrypoints and gymnasium ids work
as they do in the server.

Children never outlive the server: they are stopped (then killed) at teardown within its
bound; on Linux each asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``), and everywhere a child exits when the pipe to its parent closes.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, Final

import gymnasium as gym
import outcome

from .._errors import LaneError, exception_text
from .._jobs import Job, Phases, ResetJob, ResetResult, StepJob, StepResult
from .._options import Policy
from .._pipe import PipeEnd, PipeViolation, die_with_parent, start_child
from .._proto.rlmesh.spaces import v1 as spaces_v1
from .._wire import decode_message, encode_meta_map
from ._contract import EnvFacts, lane_facts
from ._work import LaneWork, verb_of

logger = logging.getLogger("rlmesh_trio.lanes")

CHILD_STOP_TIMEOUT = 2.0
"""Seconds a child gets to close its env and exit after being asked, before SIGKILL."""

AHEAD_LIMIT: Final = 64 * 1024
"""The largest job (pickled) that :meth:`ChildLane.send_ahead` writes from the posting
thread (the transport's), if the socket's send buffer is large enough (a quarter of it):
a bigger one is written by the lane's own thread."""


class LaneProcessDiedError(LaneError):
    """A process lane's child died (a signal, ``os._exit``, the OOM killer). Fatal."""


class RemoteEnvError(Exception):
    """An exception raised in a child that could not be sent as itself (not picklable);
    :func:`remote_error` gives it the original's type name, so the wire text is the same."""


def remote_error(type_name: str, message: str) -> BaseException:
    cls: type[RemoteEnvError] = type(
        type_name, (RemoteEnvError,), {"__module__": "rlmesh_trio.child"}
    )
    return cls(message)


def check_picklable(factory: Callable[[], gym.Env[Any, Any]]) -> None:
    """Raise ``TypeError`` naming the factory when it cannot be sent to a child process."""
    try:
        pickle.dumps(factory)
    except Exception as exc:
        raise TypeError(
            "lane_isolation='process' needs an env factory that can be pickled (a "
            "gymnasium id, a module:callable entrypoint, or a module-level callable), "
            f"got {factory!r}: {type(exc).__name__}: {exception_text(exc)}"
        ) from None


def signal_name(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


# ------------------------------------------------------------------------ parent side


class ChildLane:
    """The proxy's handle on one child: start it, run jobs, stop or kill it.

    Used by one lane thread (the proxy); :meth:`kill` may be called from any thread.

    A child that breaks its pipe's protocol (:class:`PipeViolation`, or an answer of no
    shape it sends) is killed and then treated as a child that died: the job in flight
    gets a :class:`LaneProcessDiedError` naming the lane and what the child sent, and the
    lane's fault policy applies.
    """

    def __init__(
        self, factory: Callable[[], gym.Env[Any, Any]], policy: Policy, index: int, number: int
    ) -> None:
        self.index = index
        self._closed = False
        self._broken: str | None = None  # what the child sent that broke its pipe
        self._lock = threading.Lock()
        self._process, ours = start_child("rlmesh_trio._lanechild", f"lane {index}.{number}")
        # What send_ahead may write without ever blocking the poster (the pipe is empty
        # then): a quarter of the socket's send buffer (Linux reports twice what it
        # holds; macOS's default is 8 KiB), at most AHEAD_LIMIT.
        self._ahead_limit = min(
            AHEAD_LIMIT, ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4
        )
        self._conn = PipeEnd(ours)
        self._conn.send((list(sys.path), pickle.dumps(factory), policy))

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def build(self) -> EnvFacts:
        """Wait for the child to build its env; its facts, or the factory's exception."""
        message = self._recv()
        if message is None:
            raise self.died("make_env")
        try:  # the child's answer, unless it sent something of no shape it sends
            kind, payload = message
            if kind == "built" and isinstance(payload, EnvFacts):
                return payload
            if kind != "error":
                raise TypeError(f"not an answer: {message!r:.100}")
            error = _rebuild(payload)
        except Exception as exc:
            raise self._malformed("make_env", exc) from None
        raise error

    def execute(self, job: Job, queue_ns: int) -> tuple[outcome.Outcome[Any], Phases, bool]:
        """Run one job in the child (same contract as :meth:`LaneWork.execute`)."""
        try:
            self._conn.send(pack_job(job, queue_ns))
        except (OSError, EOFError):
            return outcome.Error(self.died(verb_of(job))), Phases(), True
        except Exception as exc:  # the job itself cannot be pickled (a CallJob's lambda)
            return outcome.Error(exc), Phases(), False
        return self.finish(job, queue_ns)

    def send_ahead(self, job: Job) -> bool:
        """Any thread, while the proxy waits on an empty mailbox (nothing is in flight on
        the pipe, and the proxy writes nothing until it takes ``job``): write a step or a
        reset to the child now, so that the child runs it while the proxy is still being
        woken. False, and nothing written, for any other job or one over
        :data:`AHEAD_LIMIT` bytes: the proxy then sends it itself, with :meth:`execute`.
        True when written, or when the write failed because the child is gone (the proxy's
        :meth:`finish` then finds it dead).

        The poster holds the lane's lock meanwhile: the job is written only if it fits
        the socket's empty send buffer (a quarter of it, at most :data:`AHEAD_LIMIT`), so
        the write never waits for the child. The child starts it at once: its phases say
        it waited 0 ns in the lane's queue, which is what happened."""
        limit = self._ahead_limit
        if type(job) is StepJob:
            if sum(len(leaf) for leaf in job.leaves) > limit:
                return False  # not even pickled here: the proxy sends it
        elif type(job) is not ResetJob:
            return False
        try:
            data = pickle.dumps(pack_job(job, 0), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            return False
        if len(data) > limit:
            return False
        with contextlib.suppress(OSError):
            self._conn.send_pickled(data)
        return True

    def finish(self, job: Job, queue_ns: int) -> tuple[outcome.Outcome[Any], Phases, bool]:
        """The proxy: the child's answer to ``job``, once it was written to the pipe (by
        :meth:`execute` or :meth:`send_ahead`)."""
        message = self._recv()
        if message is None:
            return outcome.Error(self.died(verb_of(job))), Phases(), True
        try:  # the child's answer, unless it sent something of no shape it sends
            kind = message[0]
            if kind == "error":  # the child could not run the job at all
                return outcome.Error(_rebuild(message[1])), Phases(), False
            if kind != "done":
                return unpack_result(message)
            result, phases, faulted = message[1]
            if isinstance(result, tuple):  # an exception, sent apart from its traceback
                result = outcome.Error(_rebuild(result))
            elif not isinstance(result, outcome.Outcome):
                raise TypeError(f"not an outcome: {type(result).__name__}")
            return result, phases, faulted
        except Exception as exc:
            return outcome.Error(self._malformed(verb_of(job), exc)), Phases(), True

    def died(self, verb: str) -> LaneProcessDiedError:
        """The job's error once the child is gone (or its pipe broke: then it is killed)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(CHILD_STOP_TIMEOUT)
        if self._broken is not None:
            return LaneProcessDiedError(
                f"{verb} failed: lane {self.index} process killed: lane pipe: "
                f"the child {self._broken}"
            )
        how = signal_name(self._process.returncode)
        return LaneProcessDiedError(f"{verb} failed: lane {self.index} process died ({how})")

    def _malformed(self, verb: str, exc: Exception) -> LaneProcessDiedError:
        """The child sent a message that unpickled but is no answer of the protocol."""
        self._broke(f"sent a message that is no answer ({type(exc).__name__}: {exc})")
        return self.died(verb)

    def _broke(self, what: str) -> None:
        """The child broke its pipe: kill it (it may still be writing, or waiting)."""
        if self._broken is None:
            self._broken = what
        self.kill()

    def kill(self) -> None:
        """Any thread: SIGKILL the child (the proxy then sees its pipe close)."""
        with contextlib.suppress(Exception):
            self._process.kill()

    def close(self, timeout: float = CHILD_STOP_TIMEOUT) -> None:
        """Ask the child to close its env and exit; kill it if it does not in time."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(OSError, EOFError, ValueError):
            self._conn.send(None)
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning(
                "lane %d: its process %s did not exit within %.3g s; killing it",
                self.index,
                self._process.pid,
                timeout,
            )
            self._process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(CHILD_STOP_TIMEOUT)
        with contextlib.suppress(Exception):
            self._conn.close()

    def _recv(self) -> Any:
        """The child's next message; None once it is gone or has broken its pipe."""
        try:
            return self._conn.recv()
        except (OSError, EOFError):
            return None
        except PipeViolation as exc:
            self._broke(str(exc))
            return None


# ---- the pipe's compact forms -------------------------------------------------------------
#
# A step (the hot path) crosses as a flat tuple of plain values, its info map as protobuf
# bytes: pickling the job and StepJob/StepResult dataclasses and a betterproto MetaMap costs
# tens of µs per step (hundreds for a busy info dict); everything else is pickled whole.


def pack_job(job: Job, queue_ns: int) -> tuple[Any, ...]:
    """Parent side: what goes down the pipe for ``job``."""
    if type(job) is StepJob:
        leaves = [bytes(leaf) if isinstance(leaf, memoryview) else leaf for leaf in job.leaves]
        return ("step", leaves, job.n, job.row, job.validated, job.id, queue_ns)
    return ("job", job, queue_ns)


def unpack_job(message: tuple[Any, ...]) -> tuple[Job, int]:
    """Child side: the job and its queue time back from :func:`pack_job`'s tuple."""
    if message[0] == "step":
        _, leaves, n, row, validated, job_id, queue_ns = message
        return StepJob(leaves=leaves, n=n, row=row, validated=validated, id=job_id), queue_ns
    return message[1], message[2]


def _phases(phases: Phases) -> tuple[int, int, int, int]:
    return (phases.queue_ns, phases.decode_ns, phases.user_ns, phases.encode_ns)


def pack_result(
    result: outcome.Outcome[Any], phases: Phases, faulted: bool
) -> tuple[Any, ...] | None:
    """Child side: a step's or reset's result as a flat tuple (None: pickle it whole)."""
    if type(result) is not outcome.Value:
        return None
    value = result.value
    if type(value) is StepResult:
        return (
            "stepped",
            value.observation,
            value.reward,
            value.terminated,
            value.truncated,
            _info_bytes(value.info),
            value.action_warning,
            value.obs_warning,
            _phases(phases),
            faulted,
        )
    if type(value) is ResetResult:
        info = _info_bytes(value.info)
        return ("reset", value.observation, info, value.obs_warning, _phases(phases), faulted)
    return None


def _info_bytes(info: spaces_v1.MetaMap | None) -> bytes | None:
    return None if info is None else encode_meta_map(info)


def _info(data: bytes | None) -> spaces_v1.MetaMap | None:
    if data is None:  # the env gave no info
        return None
    return decode_message(spaces_v1.MetaMap, data) if data else spaces_v1.MetaMap()


def unpack_result(message: tuple[Any, ...]) -> tuple[outcome.Outcome[Any], Phases, bool]:
    """Parent side: :func:`pack_result`'s tuple back as (outcome, phases, faulted)."""
    result: StepResult | ResetResult
    if message[0] == "stepped":
        _, observation, reward, terminated, truncated, info, action_w, obs_w, ns, faulted = message
        result = StepResult(
            observation=observation,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            info=_info(info),
            action_warning=action_w,
            obs_warning=obs_w,
        )
    else:
        _, observation, info, obs_w, ns, faulted = message
        result = ResetResult(observation=observation, info=_info(info), obs_warning=obs_w)
    return outcome.Value(result), Phases(*ns), faulted


def _rebuild(payload: tuple[Any, str, str, str]) -> BaseException:
    """An exception from the child: itself when it unpickled, else a stand-in by name."""
    exc, type_name, message, trace = payload
    error: BaseException = (
        exc if isinstance(exc, BaseException) else remote_error(type_name, message)
    )
    error.add_note(f"in the lane's child process:\n{trace}")
    return error


# ------------------------------------------------------------------------- child side


def _pack_error(exc: BaseException) -> tuple[Any, str, str, str]:
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickled: Any = pickle.loads(pickle.dumps(exc))
    except Exception:
        pickled = None
    return pickled, type(exc).__qualname__, exception_text(exc), trace


STACK_SIGNAL: Final = getattr(signal, "SIGUSR1", None)
"""The signal on which a lane's child dumps every thread's stack on its stderr (the
server's), for the warning of a wedged lane: ``faulthandler`` writes it from its C
handler, so also while the env holds the GIL."""


def dump_stack(pid: int) -> bool:
    """Ask the lane child ``pid`` for its stack dump; False when it is gone."""
    if STACK_SIGNAL is None:
        return False
    try:
        os.kill(pid, STACK_SIGNAL)
    except OSError:
        return False
    return True


def child_main(conn: PipeEnd, parent_pid: int) -> None:
    """A lane's child process: build the env, serve jobs from the pipe, close the env."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when we stop
    if STACK_SIGNAL is not None:
        faulthandler.register(STACK_SIGNAL, all_threads=True)
    env: gym.Env[Any, Any] | None = None
    try:
        try:
            message = conn.recv()
        except (OSError, EOFError):
            return
        path, pickled, policy = message
        sys.path[:] = path
        try:
            factory = pickle.loads(pickled)
            env = factory()
            facts = lane_facts(env)
            from .._codec import SpaceCodec

            work = LaneWork(SpaceCodec(env.action_space), SpaceCodec(env.observation_space), policy)
        except Exception as exc:
            conn.send(("error", _pack_error(exc)))
            return
        conn.send(("built", facts))
        del facts
        while True:
            try:
                message = conn.recv()
            except (OSError, EOFError):
                return  # the server is gone
            if message is None:
                return
            job, queue_ns = unpack_job(message)
            result, phases, faulted = work.execute(env, job, queue_ns)
            payload: Any = pack_result(result, phases, faulted)
            if payload is None:
                payload = result
                if isinstance(result, outcome.Error):
                    payload = _pack_error(result.error)
                payload = ("done", (payload, phases, faulted))
            try:
                conn.send(payload)
            except (OSError, EOFError):
                return
            except Exception as exc:  # the result cannot be pickled
                conn.send(("error", _pack_error(exc)))
            del job, result, payload
    finally:
        if env is not None:
            try:
                env.close()
            except Exception:
                traceback.print_exc()
        with contextlib.suppress(Exception):
            conn.close()
