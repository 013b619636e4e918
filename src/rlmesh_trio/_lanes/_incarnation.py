"""An incarnation: one OS thread of a lane and the env it drives, for the env's whole life.

The engine speaks one protocol to both kinds (:class:`Incarnation`):

* :meth:`~Incarnation.build` -- on the incarnation's own thread: make the env, return
  what it serves;
* :meth:`~Incarnation.executor` -- the callable the thread runs each job with;
* :meth:`~Incarnation.interrupt` -- any thread: an env call overran, stop it. A process
  is killed (nothing is left behind); a thread cannot be, so it is *abandoned* with its
  env;
* :meth:`~Incarnation.close` -- on the incarnation's own thread, last: close the env,
  within a timeout where that can be enforced;
* :meth:`~Incarnation.lost_by` -- whether a job's error means the env's host is gone (a
  process lane's child died), which makes the lane dead under policy ``error``.

The protocol and the bookkeeping every incarnation carries are in :mod:`._lane`.

:class:`ThreadIncarnation` runs the env on the thread itself (DESIGN.md decision 3: the
env is created and only ever used on that thread). :class:`ProcessIncarnation` runs it
in a child process of its own (:mod:`._process`); the thread is then the env's proxy and
only routes the jobs' bytes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from .._options import LaneIsolation, Policy
from ._contract import EnvFacts, lane_facts
from ._lane import Execute, Incarnation, SendAhead, Spawn
from ._process import (
    CHILD_STOP_TIMEOUT,
    ChildLane,
    LaneProcessDiedError,
    check_picklable,
    dump_stack,
)
from ._work import LaneWork

__all__ = ["Execute", "Incarnation", "ProcessIncarnation", "ThreadIncarnation", "spawner"]

logger = logging.getLogger("rlmesh_trio.lanes")

EnvFactory = Callable[[], gym.Env[Any, Any]]


class ThreadIncarnation(Incarnation):
    """The env on the lane's own thread."""

    __slots__ = ("_env", "_make_env")

    def __init__(self, index: int, number: int, make_env: EnvFactory) -> None:
        super().__init__(index, number)
        self._make_env = make_env
        self._env: gym.Env[Any, Any] | None = None

    def build(self) -> EnvFacts:
        env = self._env = self._make_env()
        return lane_facts(env)

    def executor(self, work: LaneWork) -> Execute:
        assert self._env is not None
        return functools.partial(work.execute, self._env)

    def interrupt(self) -> bool:
        self.abandoned = True  # a Python thread cannot be killed
        return False

    def close(self, timeout: float) -> None:
        """``env.close()`` on this thread. No timeout can stop it: a close that never
        returns keeps this thread, which the supervisor abandons after its timeout."""
        env, self._env = self._env, None
        if env is None:
            return
        try:
            env.close()
        except Exception:
            logger.exception("lane %d: env.close() raised", self.index)


class ProcessIncarnation(Incarnation):
    """The env in a child process of its own; the lane's thread is its proxy."""

    __slots__ = ("_child", "_killed", "_make_env", "_policy")

    def __init__(self, index: int, number: int, make_env: EnvFactory, policy: Policy) -> None:
        super().__init__(index, number)
        self._make_env = make_env
        self._policy: Policy = policy
        self._child: ChildLane | None = None
        self._killed = False

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    def build(self) -> EnvFacts:
        child = self._child = ChildLane(self._make_env, self._policy, self.index, self.number)
        if self._killed:  # interrupted while the process was being started
            child.kill()
        return child.build()

    def executor(self, work: LaneWork) -> Execute:
        assert self._child is not None
        return self._child.execute

    def ahead(self) -> tuple[SendAhead, Execute] | None:
        assert self._child is not None
        return self._child.send_ahead, self._child.finish

    def interrupt(self) -> bool:
        self._killed = True
        if self._child is not None:
            self._child.kill()  # the proxy then sees its pipe close
        return True

    def close(self, timeout: float) -> None:
        """Ask the child to close its env and exit; killed if it does not in time."""
        if self._child is not None:
            self._child.close(min(CHILD_STOP_TIMEOUT, timeout))

    def lost_by(self, error: BaseException) -> bool:
        return isinstance(error, LaneProcessDiedError)

    def stack(self) -> str:
        """The child dumps every thread's stack on the server's stderr (``faulthandler``,
        registered on :data:`STACK_SIGNAL` in the child): the env runs there, not on the
        proxy thread of this process."""
        pid = self.pid
        if pid is None or not dump_stack(pid):
            return "(the lane's process is gone: no stack to show)"
        return f"(process lane: pid {pid} dumped every thread's stack on stderr)"


def spawner(isolation: LaneIsolation, make_env: EnvFactory, policy: Policy) -> Spawn:
    """``spawn(lane, number)`` making the incarnations ``isolation`` asks for.

    Process isolation needs a factory that pickles: checked here, before anything starts.
    """
    if isolation == "process":
        check_picklable(make_env)
        return functools.partial(_process_incarnation, make_env, policy)
    return functools.partial(_thread_incarnation, make_env)


def _thread_incarnation(make_env: EnvFactory, index: int, number: int) -> Incarnation:
    return ThreadIncarnation(index, number, make_env)


def _process_incarnation(
    make_env: EnvFactory, policy: Policy, index: int, number: int
) -> Incarnation:
    return ProcessIncarnation(index, number, make_env, policy)
