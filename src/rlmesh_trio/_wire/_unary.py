"""Strict decoders of the unary requests, and the grpc.health.v1 messages.

Handshake and Shutdown go through the schema-driven decoder (rare, small, and their
nested PeerInfo must be checked as strictly as the reference checks it); the health
request has one field that matters, so it is read directly.
"""

from __future__ import annotations

from .._proto.rlmesh.env import v1 as env_v1
from ._protobuf import decode_message, encode_varint, expect_wire, iter_fields, text

__all__ = [
    "HEALTH_NOT_SERVING",
    "HEALTH_SERVING",
    "HEALTH_STATUS_NAMES",
    "decode_handshake_request",
    "decode_health_request",
    "decode_health_response",
    "decode_shutdown_request",
    "encode_health_request",
    "encode_health_response",
]

HEALTH_SERVING = 1
HEALTH_NOT_SERVING = 2
HEALTH_STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
"""``grpc.health.v1.HealthCheckResponse.ServingStatus``."""


def decode_handshake_request(data: bytes | bytearray) -> env_v1.HandshakeRequest:
    return decode_message(env_v1.HandshakeRequest, data)


def decode_shutdown_request(data: bytes | bytearray) -> env_v1.ShutdownRequest:
    return decode_message(env_v1.ShutdownRequest, data)


def decode_health_request(data: bytes | bytearray) -> str:
    """``grpc.health.v1.HealthCheckRequest.service`` (field 1; the last one wins)."""
    service = ""
    for number, wire, _value, start, stop in iter_fields(data, 0, len(data)):
        if number == 1:
            expect_wire(wire, 2)
            service = text(data, start, stop)
    return service


def encode_health_response(status: int) -> bytes:
    """``grpc.health.v1.HealthCheckResponse{status}`` (field 1, an enum)."""
    return b"\x08" + encode_varint(status)


def encode_health_request(service: str) -> bytes:
    """``grpc.health.v1.HealthCheckRequest{service}`` (the client's half)."""
    name = service.encode()
    return b"\x0a" + encode_varint(len(name)) + name if name else b""


def decode_health_response(data: bytes | bytearray) -> int:
    """``grpc.health.v1.HealthCheckResponse.status`` (field 1, an enum; the last one
    wins; absent: 0, UNKNOWN). Raises ``DecodeError`` for a malformed message."""
    status = 0
    for number, wire, value, _start, _stop in iter_fields(data, 0, len(data)):
        if number == 1:
            expect_wire(wire, 0)
            status = value if value < 2**63 else value - 2**64  # int32 enums sign-extend
    return status
