"""What an endpoint serves, as its Handshake tells it (SPEC §4, §6): :class:`Contract`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from .._codec import from_meta_map, spec_to_space
from .._errors import CodecError
from .._wire._protobuf import DecodeError
from ._errors import (
    HandshakeError,
)
from ._messages import EDITION, decode_handshake_response

__all__ = ["AUTORESET_NAMES", "Contract", "contract_from_handshake"]

AUTORESET_NAMES = {0: "UNSPECIFIED", 1: "NEXT_STEP", 2: "SAME_STEP", 3: "DISABLED"}


@dataclass(frozen=True, repr=False)
class Contract:
    """What the endpoint serves, from its Handshake (SPEC §4, §6)."""

    env_id: str
    num_envs: int
    render_mode: str | None
    autoreset_mode: str
    """The server's own autoreset mode: ``DISABLED`` for lane endpoints."""
    metadata: dict[str, Any]
    capabilities: dict[str, str]
    observation_space: gym.spaces.Space[Any]
    action_space: gym.spaces.Space[Any]
    server: dict[str, str] = field(default_factory=dict)
    """The server's peer info (component, package_version, language, ...)."""

    def __repr__(self) -> str:
        return (
            f"Contract(env_id={self.env_id!r}, num_envs={self.num_envs}, "
            f"autoreset_mode={self.autoreset_mode}, observation_space={self.observation_space}, "
            f"action_space={self.action_space})"
        )

    @property
    def subset_step(self) -> bool:
        """The endpoint takes lane-scoped requests (capability ``subset_step: "true"``)."""
        return self.capabilities.get("subset_step") == "true"


def contract_from_handshake(data: bytes | None) -> Contract:
    """Check a HandshakeResponse (generation, editions, contract) and read its contract."""
    if data is None:
        raise HandshakeError("the server answered the Handshake with no message")
    try:
        response = decode_handshake_response(data)
    except DecodeError as exc:
        raise HandshakeError(f"undecodable HandshakeResponse: {exc}") from None
    base = response.base
    if base is None or not base.compatible:
        detail = base.error_message if base is not None and base.error_message else "incompatible"
        raise HandshakeError(f"handshake refused by the server: {detail}")
    editions = list(base.supported_workflow_editions)
    preferred = base.preferred_workflow_edition
    if EDITION not in editions and preferred != EDITION:
        raise HandshakeError(
            f"handshake failed: no mutual workflow edition with the env: env wants "
            f"{preferred!r} and can {editions!r}; this client implements [{EDITION!r}]"
        )
    ec = response.env_contract
    if ec is None or ec.spec is None:
        raise HandshakeError("the server sent no env contract")
    spec = ec.spec
    if spec.observation_space is None or spec.action_space is None:
        raise HandshakeError("the env contract has no observation or action space")
    try:
        observation_space = spec_to_space(spec.observation_space)
        action_space = spec_to_space(spec.action_space)
    except CodecError as exc:
        raise HandshakeError(f"the env contract's spaces are not usable: {exc}") from None
    if ec.num_envs < 1:
        raise HandshakeError(f"the env contract says num_envs={ec.num_envs}")
    peer = base.peer_info
    server = (
        {}
        if peer is None
        else {
            k: getattr(peer, k)
            for k in ("component", "package_version", "language", "language_version", "os")
        }
    )
    return Contract(
        env_id=spec.id,
        num_envs=int(ec.num_envs),
        render_mode=ec.render_mode or None,
        autoreset_mode=AUTORESET_NAMES.get(int(ec.autoreset_mode), str(int(ec.autoreset_mode))),
        metadata=from_meta_map(spec.metadata),
        capabilities=dict(base.capabilities),
        observation_space=observation_space,
        action_space=action_space,
        server=server,
    )
