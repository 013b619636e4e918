"""The lane engine: N gymnasium envs as the lanes of one endpoint.

* :mod:`._engine` -- :class:`LaneEngine`: construction, startup (the contract), bounded
  teardown and the public API (post, close, status);
* :mod:`._state` -- a lane's states and the one table of allowed moves;
* :mod:`._lane` -- one lane's mailbox, the transitions that change its state and the
  events that change its other fields (nothing else writes them); the incarnation
  protocol (build, execute, interrupt, close);
* :mod:`._incarnation` -- its two variants: the env on the lane's thread, or in a child
  process the thread proxies for;
* :mod:`._thread` -- the lane thread's body: build, serve the mailbox, hand over after a
  fault, close;
* :mod:`._supervisor` -- a lane's supervisor task (rebuild backoff, retiring and
  abandoning old threads) and the ledger of abandoned threads;
* :mod:`._watchdog` -- wedged env calls: the watchdog and what a wedge does;
* :mod:`._work` -- what a lane does with one job (decode, env call, encode);
* :mod:`._process` -- process lanes: the child process and the parent's handle on it;
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
    from ._state import LaneState as LaneState

_ENGINE = ("LANE_TEARDOWN_TIMEOUT", "LANE_THREAD_PREFIX", "LaneEngine", "LaneStatus")


def __getattr__(name: str) -> Any:
    # The engine (trio, the bridge) is imported on first use: a process lane's child
    # imports only the wire work of a job.
    if name == "LaneState":
        from ._state import LaneState

        return LaneState
    if name in _ENGINE:
        from . import _engine

        return getattr(_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """What the package has, the names it imports on first use included."""
    return sorted({*globals(), "LaneState", *_ENGINE})
