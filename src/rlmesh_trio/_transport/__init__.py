"""The gRPC server transport: the only package that imports asyncio or grpclib (the
client speaks h2 on Trio itself).

* :mod:`._service` -- :class:`TransportService`, the Trio task owning the loop thread;
* :mod:`._server` -- the loop side: method table, the one error-to-status mapping,
  health, idle timer, stop phases;
* :mod:`._join` -- the Join driver (explicit states, back-pressure);
* :mod:`._connection` -- one HTTP/2 connection: dispatcher (admission), frame gate, GOAWAY,
  the lingering close;
* :mod:`._reader` -- the Join's request reader, inside the connection's data callback;
* :mod:`._shim` -- the rest of grpclib's seam: codec, method table, the Join's sender,
  unary reads, reflection's servicers;
* :mod:`._flood` -- what one connection may cost (flood limits, per-turn slices);
* :mod:`._privates` -- every private name of grpclib and h2 used, its check and fallback.

``rlmesh-trio probe`` and the fleets' health checks are a client's job:
:func:`rlmesh_trio.client.probe`.
"""

from .._wire import HANDSHAKE_PATH as HANDSHAKE_PATH
from .._wire import HEALTH_CHECK_PATH as HEALTH_CHECK_PATH
from .._wire import JOIN_PATH as JOIN_PATH
from .._wire import SERVICE_NAME as SERVICE_NAME
from .._wire import SHUTDOWN_PATH as SHUTDOWN_PATH
from ._service import THREAD_NAME as THREAD_NAME
from ._service import TransportService as TransportService
