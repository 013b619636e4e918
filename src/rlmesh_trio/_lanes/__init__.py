"""The lane engine: N gymnasium envs as the lanes of one endpoint.

* :mod:`._engine` -- :class:`LaneEngine`: the lane supervisors and threads, startup,
  fault handling (rebuild, watchdog, abandon) and bounded teardown;
* :mod:`._work` -- what a lane thread does with one job (decode, env call, encode);
* :mod:`._process` -- process lanes: the env in a child process, the lane thread its proxy;
* :mod:`._lane` -- one lane's mailbox, state and thread incarnations, the timing split
  of a job;
* :mod:`._contract` -- what a lane's env serves, and the agreement of every lane with
  lane 0.
"""

from typing import TYPE_CHECKING, Any

from ._contract import UNKNOWN_ENV_ID as UNKNOWN_ENV_ID

if TYPE_CHECKING:
    from ._engine import LANE_TEARDOWN_TIMEOUT as LANE_TEARDOWN_TIMEOUT
    from ._engine import LANE_THREAD_PREFIX as LANE_THREAD_PREFIX
    from ._engine import LaneEngine as LaneEngine
    from ._engine import LaneStatus as LaneStatus
    from ._lane import LaneState as LaneState

_ENGINE = ("LANE_TEARDOWN_TIMEOUT", "LANE_THREAD_PREFIX", "LaneEngine", "LaneStatus", "LaneState")


def __getattr__(name: str) -> Any:
    # The engine (trio, the bridge) is imported on first use: a process lane's child
    # imports only the wire work of a job.
    if name in _ENGINE:
        from . import _engine

        return getattr(_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
