"""rlmesh-trio: gymnasium environments served over rlmesh-wire-v1, on Trio.

The public surface is what this module re-exports; everything in ``_*`` modules is
internal.
"""

from ._errors import ActionError as ActionError
from ._errors import CodecError as CodecError
from ._errors import ContractMismatchError as ContractMismatchError
from ._errors import InvalidRequestError as InvalidRequestError
from ._errors import LaneBrokenError as LaneBrokenError
from ._errors import LaneClosedError as LaneClosedError
from ._errors import LaneError as LaneError
from ._errors import PolicyViolation as PolicyViolation
from ._errors import RlmeshTrioError as RlmeshTrioError
from ._errors import UnsupportedSpaceError as UnsupportedSpaceError
from ._options import ServeOptions as ServeOptions
from ._serve import ServerInfo as ServerInfo
from ._serve import serve_env as serve_env
from ._version import __version__ as __version__

__all__ = [
    "ActionError",
    "CodecError",
    "ContractMismatchError",
    "InvalidRequestError",
    "LaneBrokenError",
    "LaneClosedError",
    "LaneError",
    "PolicyViolation",
    "RlmeshTrioError",
    "ServeOptions",
    "ServerInfo",
    "UnsupportedSpaceError",
    "__version__",
    "serve_env",
]
