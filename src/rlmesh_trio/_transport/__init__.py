"""The gRPC server transport: the only package that imports asyncio or grpclib (the
client speaks h2 on Trio itself).

Its modules, from the Trio side down to the bytes:

* :mod:`._service` -- :class:`TransportService`, the Trio task owning the loop thread;
* :mod:`._server` -- the loop side: method table, the one error-to-status mapping,
  health, idle timer, stop phases;
* :mod:`._routes` -- the lane replies routed to the Join that posted their jobs;
* :mod:`._join` -- the Join driver (its state table, back-pressure);
* :mod:`._states` -- the Join's and its request reader's states, each one table of moves;
* :mod:`._deadlines` -- a Join's request deadlines on one loop timer;
* :mod:`._reflection` -- server reflection (``--reflection``);
* :mod:`._connection` -- one HTTP/2 connection: dispatcher (admission), frame gate,
  GOAWAY, the lingering close;
* :mod:`._reader` -- the Join's request reader, inside the connection's data callback;
* :mod:`._shim` -- the rest of grpclib's seam: codec, method table, the Join's sender,
  unary reads, reflection's servicers;
* :mod:`._h2frames` -- the direct DATA path: a Join's plain DATA frames past h2's objects;
* :mod:`._headers` -- the request header block, checked as the reference checks it; our
  HPACK encoder, its table capped;
* :mod:`._flood` -- what one connection, and all of them together, may cost (flood
  limits, header blocks, the server's budget, per-turn slices);
* :mod:`._quiet` -- calls cut off by their connection: one rate-limited log line;
* :mod:`._privates` -- every private name of grpclib and h2 used, its check and fallback.

The wire's names (paths, the service name) are :mod:`rlmesh_trio._wire`'s, imported from
there. ``rlmesh-trio probe`` and the fleets' health checks are a client's job:
:func:`rlmesh_trio.client.probe`.
"""

from ._server import Wiring as Wiring
from ._service import THREAD_NAME as THREAD_NAME
from ._service import TransportService as TransportService
