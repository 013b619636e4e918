"""rlmesh-trio: gymnasium environments served over rlmesh-wire-v1, on Trio.

The public surface is what this module re-exports; everything in ``_*`` modules is
internal. Of the error hierarchy only what a caller can meet is public: the base class,
and the startup errors of :func:`serve_env` (an env whose spaces cannot be served, lanes
that disagree on the env contract).
"""

from ._errors import CodecError as CodecError
from ._errors import ContractMismatchError as ContractMismatchError
from ._errors import RlmeshTrioError as RlmeshTrioError
from ._errors import UnsupportedSpaceError as UnsupportedSpaceError
from ._options import ServeOptions as ServeOptions
from ._serve import ServerInfo as ServerInfo
from ._serve import serve_env as serve_env
from ._version import __version__ as __version__

__all__ = [
    "CodecError",
    "ContractMismatchError",
    "RlmeshTrioError",
    "ServeOptions",
    "ServerInfo",
    "UnsupportedSpaceError",
    "__version__",
    "serve_env",
]
