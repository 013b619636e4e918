"""The lane engine: N gymnasium envs as the lanes of one endpoint.

* :mod:`._engine` -- :class:`LaneEngine`: the lane tasks and threads, what a lane thread
  does with a job, startup and bounded teardown;
* :mod:`._lane` -- one lane's mailbox and state, the timing split of a job;
* :mod:`._contract` -- what a lane's env serves, and the agreement of every lane with
  lane 0.
"""

from ._contract import UNKNOWN_ENV_ID as UNKNOWN_ENV_ID
from ._engine import LANE_TEARDOWN_TIMEOUT as LANE_TEARDOWN_TIMEOUT
from ._engine import LANE_THREAD_PREFIX as LANE_THREAD_PREFIX
from ._engine import LaneEngine as LaneEngine
