"""rlmesh-trio's client: a Trio-native async client and gymnasium adapters.

* :func:`open_endpoint` — ``async with open_endpoint(address) as ep:`` then
  ``await ep.reset(...)``, ``await ep.step(...)``, ``await ep.render()``,
  ``await ep.aclose()``; lane-scoped requests pipeline across Trio tasks.
* :class:`VectorEnv` — a synchronous ``gymnasium.vector.VectorEnv`` over an endpoint,
  with gymnasium's autoreset modes done client-side.
  With ``batch_size=k``: ``await ep.send(actions, env_indices)`` and ``await ep.recv()``
  step the lanes that are ready, EnvPool's way (also on :class:`VectorEnv`).
* :class:`Env` — a synchronous ``gymnasium.Env`` over a one-lane endpoint.
* The address: one (``tcp://host:port``, ``unix:///path``), a list of several endpoints
  (a vector spans them; a one-lane client takes the first free one), or none, which
  reads ``RLMESH_TRIO_ADDRESS`` (what a trainer that builds envs by id uses).
* :func:`probe` — health, handshake and contract of an endpoint, as a
  :class:`ProbeResult` (what ``rlmesh-trio probe`` prints).

Errors are one family rooted at :class:`EndpointError` (``code``, ``is_recoverable``,
``message``), itself a :class:`rlmesh_trio.RlmeshTrioError`; a gRPC status is named
(``UNAUTHENTICATED: invalid env token``). Durations are ``*_seconds`` (float); the
0.1 keywords (``token``, ``connect_timeout``, ``request_timeout_ms``, ...) still work
with a ``DeprecationWarning`` until 0.2. Works against rlmesh-trio and rlmesh 0.1.0's server, over TCP and unix
sockets, plaintext or TLS (``tls=``: True, a CA file, or an ``ssl.SSLContext``).
"""

from .._exports import publish as _publish
from ._contract import Contract as Contract
from ._endpoint import Endpoint as Endpoint
from ._errors import ConnectionLostError as ConnectionLostError
from ._errors import EndpointClosedError as EndpointClosedError
from ._errors import EndpointError as EndpointError
from ._errors import EnvError as EnvError
from ._errors import ErrorCode as ErrorCode
from ._errors import HandshakeError as HandshakeError
from ._errors import LaneBusyError as LaneBusyError
from ._errors import LaneError as LaneError
from ._errors import RequestTimeoutError as RequestTimeoutError
from ._errors import RpcError as RpcError
from ._gather import EndpointsUnavailableError as EndpointsUnavailableError
from ._gym import Env as Env
from ._gym import VectorEnv as VectorEnv
from ._messages import Episode as Episode
from ._opening import open_endpoint as open_endpoint
from ._probe import ProbeResult as ProbeResult
from ._probe import probe as probe

__all__ = [
    "ConnectionLostError",
    "Contract",
    "Endpoint",
    "EndpointClosedError",
    "EndpointError",
    "EndpointsUnavailableError",
    "Env",
    "EnvError",
    "Episode",
    "ErrorCode",
    "HandshakeError",
    "LaneBusyError",
    "LaneError",
    "ProbeResult",
    "RequestTimeoutError",
    "RpcError",
    "VectorEnv",
    "open_endpoint",
    "probe",
]

# Reprs, pickles and docs name the public module, not the private one a name is defined in.
_publish(__name__, globals())
