"""Building a :class:`~rlmesh_trio._lanes.LaneEngine` in tests, by its engine-level names.

The engine takes resolved options (``rlmesh_trio._options.resolve``, the one validator);
:func:`engine` maps the short names the engine tests use onto :class:`ServeOptions`
fields and resolves them, so a bad value fails exactly as it would in ``serve_env``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym

from rlmesh_trio import ServeOptions
from rlmesh_trio._lanes import LaneEngine
from rlmesh_trio._options import Resolved, resolve

_FIELDS = {
    "policy": "validation_policy",
    "teardown_timeout": "close_timeout_seconds",
    "on_fault": "on_lane_fault",
    "lane_timeout": "lane_timeout_seconds",
    "max_abandoned": "max_abandoned_lanes",
    "max_given_up": "max_given_up_lanes",
    "min_serving": "min_serving_lanes",
    "isolation": "lane_isolation",
}


def lane_options(**kwargs: Any) -> Resolved:
    """``lane_options(teardown_timeout=0.2, on_fault="rebuild")`` -> resolved options."""
    fields = {_FIELDS[name]: value for name, value in kwargs.items()}
    fields.setdefault("validation_policy", "warn")
    return resolve(ServeOptions(**fields), environ={})


def engine(
    make_env: Callable[[], gym.Env[Any, Any]],
    num_envs: int = 1,
    *,
    rebuild_backoff: tuple[float, float] | None = None,
    **kwargs: Any,
) -> LaneEngine:
    """A lane engine with the given engine-level options (see :func:`lane_options`)."""
    extra = {} if rebuild_backoff is None else {"rebuild_backoff": rebuild_backoff}
    return LaneEngine(make_env, num_envs, lane_options(**kwargs), **extra)
