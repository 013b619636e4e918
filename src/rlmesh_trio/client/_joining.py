"""How the blocking adapters (``VectorEnv``, ``Env``, SB3's ``RemoteVecEnv``) join their
endpoints, each with the one :class:`~._settings.ConnectionSettings` value it was given:
the endpoints gathered from an address or a list (:func:`open_endpoints`, by
:mod:`._gather`'s rule), what a one-lane client reads before it joins
(:func:`one_lane_contract`), and the checks every endpoint of one vector passes
(:func:`lane_endpoint`, :func:`same_contract`, :func:`count_of`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._blocking import BlockingEndpoint, handshake
from ._contract import Contract
from ._errors import EndpointError
from ._gather import Gathering, addresses_of, passed_over
from ._settings import ConnectionSettings

__all__ = [
    "count_of",
    "lane_endpoint",
    "one_lane_contract",
    "open_endpoints",
    "same_contract",
]


def open_endpoints(
    address: str | Sequence[str] | None, want: int | None, settings: ConnectionSettings
) -> list[tuple[str, BlockingEndpoint]]:
    """The endpoints a client joins: ``address`` (else ``RLMESH_TRIO_ADDRESS``), one
    address as it is, a list gathered whole endpoint by whole endpoint until ``want``
    lanes are held (None: every endpoint of the list) -- see :mod:`._gather`."""
    addresses = addresses_of(address)
    if len(addresses) == 1:
        return [(addresses[0], BlockingEndpoint(addresses[0], settings))]
    gathering = Gathering(addresses, want)
    taken: list[tuple[str, BlockingEndpoint]] = []
    try:
        for each in addresses:
            if gathering.done:
                break
            try:
                ep = BlockingEndpoint(each, settings)
            except EndpointError as exc:
                why = passed_over(exc)
                if why is None:
                    raise
                gathering.refused(each, why)
                continue
            if gathering.offered(each, ep.state.contract.num_envs):
                taken.append((each, ep))
            else:
                ep.close()
        gathering.check()
    except BaseException:
        for _, ep in taken:
            ep.close()
        raise
    return taken


def lane_endpoint(address: str, ep: BlockingEndpoint, who: str) -> Contract:
    """The contract of a lane endpoint (autoreset DISABLED on the server, lane-scoped
    requests when it has more than one lane), which ``who`` needs; ``ValueError``
    otherwise."""
    contract = ep.state.contract
    if contract.autoreset_mode != "DISABLED":
        raise ValueError(
            f"{address} autoresets on the server ({contract.autoreset_mode}); "
            f"{who} needs a lane endpoint (autoreset DISABLED)"
        )
    if contract.num_envs > 1 and not contract.subset_step:
        raise ValueError(f"{address} does not take lane-scoped requests (no subset_step)")
    return contract


def count_of(num_envs: Any) -> int | None:
    """``num_envs=`` as an int (None: whatever the endpoints serve)."""
    if num_envs is None:
        return None
    if isinstance(num_envs, bool) or not isinstance(num_envs, int | np.integer):
        raise TypeError(f"num_envs must be an int, not {type(num_envs).__name__}")
    return int(num_envs)


def same_contract(a: Contract, a_address: str, b: Contract, b_address: str) -> None:
    """Every endpoint of one vector serves the same env: spaces, render mode, env id."""
    for what, mine, theirs in (
        ("observation space", a.observation_space, b.observation_space),
        ("action space", a.action_space, b.action_space),
        ("render_mode", a.render_mode, b.render_mode),
        ("env id", a.env_id, b.env_id),
    ):
        if mine != theirs:
            raise ValueError(
                f"the endpoints of one vector must serve the same env: {a_address} has "
                f"{what} {mine!r}, {b_address} has {theirs!r}"
            )


def one_lane_contract(addresses: list[str], settings: ConnectionSettings) -> tuple[str, Contract]:
    """What a one-lane client of ``addresses`` serves (a Handshake, no session): the
    address answered and its contract. One address: its contract, which must have one
    lane. A list: the first reachable one-lane endpoint's."""
    if len(addresses) == 1:
        contract = handshake(addresses[0], settings)
        if contract.num_envs != 1:
            raise ValueError(f"{addresses[0]} has {contract.num_envs} lanes; use VectorEnv for it")
        return addresses[0], contract
    gathering = Gathering(addresses, 1)
    for each in addresses:
        try:
            contract = handshake(each, settings)
        except EndpointError as exc:
            why = passed_over(exc)
            if why is None:
                raise
            gathering.refused(each, why)
            continue
        if gathering.offered(each, contract.num_envs):
            return each, contract
    gathering.check()
    raise AssertionError("unreachable: no endpoint answered, yet nothing refused")
