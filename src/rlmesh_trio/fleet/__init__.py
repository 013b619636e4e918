"""Many endpoints, one client: ``Fleet`` (no Ray import; see :mod:`rlmesh_trio.fleet.ray`).

A :class:`Fleet` is K rlmesh-trio (or rlmesh) endpoints of N lanes each. Clients dial
every endpoint directly -- env traffic never goes through the fleet -- and the fleet adds
what a driver of many endpoints needs: their current addresses and states, health over
grpc.health.v1 with a deadline, :meth:`Fleet.map` (one shard per endpoint at a time,
failed shards retried) and :meth:`Fleet.run` (one rlmesh evaluation sharded over the
endpoints, merged into one result with each seed exactly once).

:meth:`Fleet.endpoints` gives each endpoint's :class:`EndpointStatus` (a snapshot;
:class:`rlmesh_trio.client.Endpoint` is a live connection). Errors are
:class:`FleetError`, a :class:`rlmesh_trio.RlmeshTrioError`.

* :meth:`Fleet.from_addresses` -- endpoints something else runs (processes, containers);
* :meth:`Fleet.from_dns` -- a Kubernetes StatefulSet behind a headless Service
  (``deploy/kubernetes/``);
* :func:`rlmesh_trio.fleet.ray.launch` -- endpoints launched and supervised on Ray
  (the ``ray`` extra: ``pip install '.[ray]'`` from a clone).
"""

from typing import Any as _Any

from .._deprecation import module_getattr as _module_getattr
from .._exports import publish as _publish
from ._core import Fleet as Fleet
from ._core import run_fleet as run_fleet
from ._records import EndpointStatus as EndpointStatus
from ._records import FleetError as FleetError
from ._records import FleetRunResult as FleetRunResult
from ._records import Health as Health
from ._records import Retry as Retry
from ._records import ShardRun as ShardRun
from ._records import State as State

__all__ = [
    "EndpointStatus",
    "Fleet",
    "FleetError",
    "FleetRunResult",
    "Health",
    "Retry",
    "ShardRun",
    "State",
    "run_fleet",
]

__getattr__: _Any = _module_getattr(
    __name__, {"Endpoint": ("rlmesh_trio.fleet.EndpointStatus", lambda: EndpointStatus)}
)

_publish(__name__, globals())
