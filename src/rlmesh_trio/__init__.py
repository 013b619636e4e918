"""rlmesh-trio: gymnasium environments served over rlmesh-wire-v1, on Trio.

The public surface is what this module re-exports; everything in ``_*`` modules is
internal. Of the error hierarchy only what a caller can meet is public: the base class,
and the startup errors of :func:`serve_env` (an env whose spaces cannot be served, lanes
that disagree on the env contract).

Importing it registers the gymnasium id ``rlmesh_trio/Remote-v0`` (docs/trainers.md):
``gymnasium.make("rlmesh_trio/Remote-v0", address=...)`` is a one-lane
:class:`rlmesh_trio.client.Env`, ``gymnasium.make_vec(..., num_envs=N, address=...)`` a
:class:`rlmesh_trio.client.VectorEnv`; the client itself is imported when one is made.
"""

from typing import TYPE_CHECKING, Any

from ._errors import CodecError as CodecError
from ._errors import ContractMismatchError as ContractMismatchError
from ._errors import RlmeshTrioError as RlmeshTrioError
from ._errors import UnsupportedSpaceError as UnsupportedSpaceError
from ._exports import fix as _fix
from ._exports import publish as _publish
from ._options import ServeOptions as ServeOptions
from ._version import __version__ as __version__

if TYPE_CHECKING:
    from ._serve import ServerInfo as ServerInfo
    from ._serve import serve_env as serve_env


_REMOTE_ENV_ID = "rlmesh_trio/Remote-v0"


def _register_with_gymnasium() -> None:
    """Register ``rlmesh_trio/Remote-v0`` once (string entry points: nothing of the
    client is imported until an env is made). The passive env checker stays on, as for
    any registered env: it checks the results of the caller's first reset, step and
    render and never calls the env itself."""
    from gymnasium.envs.registration import register, registry

    if _REMOTE_ENV_ID in registry:
        return
    register(
        id=_REMOTE_ENV_ID,
        entry_point="rlmesh_trio.client:Env",
        vector_entry_point="rlmesh_trio.client:VectorEnv",
    )


_register_with_gymnasium()


_LAZY = ("serve_env", "ServerInfo")
"""Names served by :func:`__getattr__` (and listed by :func:`__dir__`)."""


def __getattr__(name: str) -> Any:
    # The server (trio, grpclib, h2, ...) is imported on first use, so that a process
    # lane's child, which only needs the codec, starts fast.
    if name in _LAZY:
        from . import _serve

        value = getattr(_serve, name)
        _fix(value, __name__)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """What the module has, the names it imports on first use included."""
    return sorted({*globals(), *_LAZY})


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

_publish(__name__, globals())
