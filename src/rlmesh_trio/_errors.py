"""The package's error hierarchy.

Kept small on purpose (one base, a few kinds); the mapping of these errors onto the wire
(``EnvError`` codes, gRPC statuses) lives in one place, the session.
"""

from __future__ import annotations


class RlmeshTrioError(Exception):
    """Base class of every error rlmesh-trio raises on purpose."""


class CodecError(RlmeshTrioError, ValueError):
    """A value or a space could not be converted to or from its wire form."""


class UnsupportedSpaceError(CodecError):
    """A gymnasium space (or a SpaceSpec) that rlmesh-wire-v1 cannot express.

    The message names the path of the offending space (``$``, ``$.key``, ``$[1]``).
    """


class ActionError(CodecError):
    """A client-supplied action failed validation.

    ``str(error)`` is the exact text the reference server puts in its
    ``INVALID_ACTION`` reply (SPEC §9), e.g. ``$: value 5 not in range [0, 2)``.
    """


class PolicyViolation(RlmeshTrioError):
    """A soft conformance violation turned into an error by the ``strict`` policy.

    ``str(error)`` is the violation's ``detail`` text (SPEC §3.7.8). ``kind`` says
    whether the action (``INVALID_ACTION``, recoverable) or the observation
    (``INTERNAL``, fatal) violated its space.
    """

    def __init__(self, detail: str, kind: str = "observation") -> None:
        super().__init__(detail)
        self.kind = kind


class ContractMismatchError(RlmeshTrioError):
    """Two lanes of one endpoint do not serve the same env contract."""


class LaneError(RlmeshTrioError):
    """A job could not be delivered to a lane, or the lane died before answering."""


class LaneClosedError(LaneError):
    """The lane was closed in an orderly way (by the engine) and takes no more jobs."""


class LaneBrokenError(LaneError):
    """The lane's thread is gone or stopped before answering (crash, abandon)."""


class InvalidRequestError(RlmeshTrioError):
    """A unary request the server cannot serve (mapped to gRPC INVALID_ARGUMENT)."""
