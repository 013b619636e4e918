"""rlmesh-trio: gymnasium environments served over rlmesh-wire-v1, on Trio."""

from ._version import __version__ as __version__

__all__ = ["__version__"]
