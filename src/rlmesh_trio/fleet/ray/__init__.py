"""Endpoints launched and supervised on Ray (the ``ray`` extra).

Ray is the control plane only: each endpoint is one Ray actor -- a process running
:func:`rlmesh_trio.serve_env` under ``trio.run`` in a thread of its own -- placed by a
placement group, restarted by Ray when its process dies (``max_restarts``), and watched
by a health-driven supervisor in the driver that kills (and so restarts) an endpoint
failing several probes in a row: Ray alone sees a wedged endpoint as healthy. Env
traffic never goes through Ray: clients dial each endpoint's address directly.

>>> from rlmesh_trio.fleet.ray import launch
>>> with launch("CartPole-v1", endpoints=4, num_envs=8) as fleet:   # doctest: +SKIP
...     result = fleet.run(model, seeds=range(1000))

The package: ``_actor`` (the endpoint actor, :class:`EndpointInfo`), ``_supervisor``
(:class:`RayFleet`, its health supervisor, :class:`SupervisorStats`), ``_launch``
(:func:`launch`, :func:`resolve_bind`, :func:`ray_output_to_stderr`,
:func:`kill_process`).
"""

from ..._exports import publish as _publish
from ._actor import EndpointInfo as EndpointInfo
from ._launch import kill_process as kill_process
from ._launch import launch as launch
from ._launch import ray_output_to_stderr as ray_output_to_stderr
from ._launch import resolve_bind as resolve_bind
from ._supervisor import RayFleet as RayFleet
from ._supervisor import SupervisorStats as SupervisorStats

__all__ = [
    "EndpointInfo",
    "RayFleet",
    "SupervisorStats",
    "kill_process",
    "launch",
    "ray_output_to_stderr",
    "resolve_bind",
]

_publish(__name__, globals())
