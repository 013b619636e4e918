"""The protocol's names, once for the server, the client and the probe (SPEC §1, §6).

``rlmesh.env.v1.EnvService`` (Handshake, Join, Shutdown), ``grpc.health.v1.Health``
(Check), the generation string the Handshake carries, and the one workflow edition
rlmesh-wire-v1 0.1.0 implements.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "HANDSHAKE_PATH",
    "HEALTH_CHECK_PATH",
    "HEALTH_SERVICE_NAME",
    "JOIN_PATH",
    "PROTOCOL_GENERATION",
    "SERVICE_NAME",
    "SHUTDOWN_PATH",
    "WORKFLOW_EDITION",
]

SERVICE_NAME: Final = "rlmesh.env.v1.EnvService"
HANDSHAKE_PATH: Final = f"/{SERVICE_NAME}/Handshake"
JOIN_PATH: Final = f"/{SERVICE_NAME}/Join"
SHUTDOWN_PATH: Final = f"/{SERVICE_NAME}/Shutdown"

HEALTH_SERVICE_NAME: Final = "grpc.health.v1.Health"
HEALTH_CHECK_PATH: Final = f"/{HEALTH_SERVICE_NAME}/Check"

PROTOCOL_GENERATION: Final = "rlmesh-wire-v1"
"""What a Handshake's ``protocol_generation`` must say on both sides (SPEC §6.3)."""

WORKFLOW_EDITION: Final = "2026.06"
"""The only workflow edition rlmesh-wire-v1 0.1.0 implements."""
