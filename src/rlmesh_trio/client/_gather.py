"""Which endpoints a client joins: the address it was given, or ``RLMESH_TRIO_ADDRESS``.

A trainer that builds its envs from an id (``gymnasium.make("rlmesh_trio/Remote-v0")``,
once per env, or ``make_vec(..., num_envs=N)``) has no way to pass an address: it comes
from the environment variable instead, one address or a comma-separated list. With a
list, a client *gathers* whole endpoints in list order until it holds exactly the lanes
it asked for. An endpoint whose one Join session is taken (BUSY) or that cannot be
reached is passed over at once, as is one with more lanes than are still wanted, so N
one-lane clients made in a row take endpoints 0..N-1, and two clients of four lanes over
two four-lane endpoints take one each. When the endpoints that are free cannot make up
the count, :class:`EndpointsUnavailableError` names every endpoint and why it was not
taken.

:class:`Gathering` is the rule alone (no IO); the blocking adapters and the Trio client
drive it with their own connections.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._errors import ConnectionLostError, EndpointError, ErrorCode, RpcError

__all__ = [
    "ADDRESS_VARIABLE",
    "EndpointsUnavailableError",
    "Gathering",
    "addresses_of",
    "passed_over",
]

ADDRESS_VARIABLE = "RLMESH_TRIO_ADDRESS"
"""The environment variable a client reads when it is given no address."""


class EndpointsUnavailableError(EndpointError):
    """The endpoints of an address list that admit this client cannot make up the lanes
    it asked for. ``reasons`` maps each endpoint that was not taken to why; ``BUSY``,
    never recoverable (nothing is held: every endpoint taken on the way was closed)."""

    def __init__(self, message: str, reasons: dict[str, str]) -> None:
        super().__init__(message, code=ErrorCode.BUSY)
        self.reasons = reasons


def addresses_of(address: str | Sequence[str] | None) -> list[str]:
    """The addresses to try, in order: ``address`` (one, or a sequence; a string may be
    a comma-separated list), else ``RLMESH_TRIO_ADDRESS``'s. Raises ``ValueError``
    saying how to give one when there is neither."""
    source = "address"
    if address is None:
        address = os.environ.get(ADDRESS_VARIABLE)
        source = ADDRESS_VARIABLE
        if address is None or not address.strip():
            raise ValueError(
                f"no address: pass address= (one address or a list), or set "
                f"{ADDRESS_VARIABLE} to an endpoint's address (tcp://host:port or "
                "unix:///path) or a comma-separated list of them, e.g. "
                f"{ADDRESS_VARIABLE}=tcp://127.0.0.1:50051 (what `rlmesh-trio serve` prints)"
            )
    items: list[str]
    if isinstance(address, str):
        items = address.split(",")
    elif isinstance(address, Sequence) and all(isinstance(a, str) for a in address):
        items = list(address)
    else:
        raise TypeError(
            f"address must be a string or a sequence of strings, not {type(address).__name__}"
        )
    out = [item.strip() for item in items]
    if not out or any(not item for item in out):
        raise ValueError(f"{source} has an empty address in {address!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"{source} names an endpoint twice: {address!r}")
    return out


def passed_over(exc: BaseException) -> str | None:
    """Why an endpoint that failed to open with ``exc`` is passed over (its Join session
    is taken, or it cannot be reached); None when ``exc`` is an error to raise (a wrong
    token, a server this client cannot talk to, ...)."""
    if isinstance(exc, RpcError) and exc.code == ErrorCode.BUSY:
        return "busy: another client holds its Join session"
    if isinstance(exc, ConnectionLostError):
        return f"unreachable: {exc.message}"
    return None


@dataclass
class Gathering:
    """The gathering rule over ``addresses``: take whole endpoints in order until
    ``want`` lanes are held (None: every endpoint of the list)."""

    addresses: list[str]
    want: int | None
    held: int = 0
    reasons: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.want is not None and self.want < 1:
            raise ValueError(f"num_envs must be >= 1, got {self.want}")

    @property
    def done(self) -> bool:
        return self.want is not None and self.held == self.want

    def refused(self, address: str, why: str) -> None:
        """``address`` did not admit this client."""
        self.reasons[address] = why

    def offered(self, address: str, lanes: int) -> bool:
        """``address`` admitted this client with ``lanes`` lanes: take it (True) or pass
        it over (False; the caller closes it)."""
        if self.want is not None and self.held + lanes > self.want:
            left = self.want - self.held
            self.reasons[address] = (
                f"serves {lanes} lanes, {left} {'lane was' if left == 1 else 'lanes were'} "
                "still wanted (endpoints are taken whole)"
            )
            return False
        self.held += lanes
        return True

    def check(self) -> None:
        """Raise :class:`EndpointsUnavailableError` unless the lanes were made up."""
        complete = self.done if self.want is not None else not self.reasons
        if complete:
            return
        wanted = (
            f"{self.want} {'lane' if self.want == 1 else 'lanes'}"
            if self.want is not None
            else "every endpoint of the list"
        )
        lines = "; ".join(f"{address}: {why}" for address, why in self.reasons.items())
        hint = ""
        if "ray.rllib" in sys.modules:
            hint = (
                " (RLlib: more env runners than free endpoints? With "
                "config.fault_tolerance(restart_failed_env_runners=False) this fails the "
                "run instead of leaving it with fewer runners)"
            )
        raise EndpointsUnavailableError(
            f"cannot gather {wanted} from {len(self.addresses)} endpoints "
            f"({self.held} held, all closed again): {lines}{hint}",
            dict(self.reasons),
        )
