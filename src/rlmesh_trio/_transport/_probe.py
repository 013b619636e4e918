"""``rlmesh-trio probe``'s client side: a Handshake and a health check against an endpoint.

A small grpclib client (so it lives in the transport package, the only one that speaks
asyncio): it works against rlmesh-trio and against rlmesh 0.1.0's server (which has no
health service: a Handshake that answers then counts as serving).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from .._address import TcpAddress, UnixAddress, parse_address
from .._proto.rlmesh.core import v1 as core_v1
from .._proto.rlmesh.env import v1 as env_v1
from .._session import PROTOCOL_GENERATION
from ._server import HANDSHAKE_PATH, HEALTH_CHECK_PATH, SERVICE_NAME
from ._shim import RawCodec

__all__ = ["ProbeResult", "probe"]

_UNARY = Cardinality.UNARY_UNARY
_HEALTH_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


@dataclass
class ProbeResult:
    """What one probe found. ``serving``: the endpoint answers and can take a Join."""

    address: str
    serving: bool = False
    health: str = "unknown"
    handshake: env_v1.HandshakeResponse | None = None
    error: str | None = None


async def _call(
    channel: Channel, path: str, payload: bytes, metadata: dict[str, str] | None, timeout: float
) -> bytes | None:
    """One unary call with raw bytes; raises GRPCError for a non-OK status."""
    async with channel.request(
        path, _UNARY, bytes, bytes, timeout=timeout, metadata=metadata
    ) as stream:
        await stream.send_message(payload, end=True)
        reply: bytes | None = await stream.recv_message()
    return reply


async def _health(channel: Channel, metadata: dict[str, str] | None, timeout: float) -> str:
    # grpc.health.v1.HealthCheckRequest{service}: field 1, a string.
    name = SERVICE_NAME.encode()
    try:
        reply = await _call(
            channel, HEALTH_CHECK_PATH, b"\x0a" + bytes([len(name)]) + name, metadata, timeout
        )
    except GRPCError as exc:
        if exc.status is Status.UNIMPLEMENTED:
            return "no health service"
        return f"error ({exc.status.name}: {exc.message or ''})".rstrip(": )") + ")"
    if not reply or len(reply) < 2 or reply[0] != 0x08:
        return "UNKNOWN"
    return _HEALTH_NAMES.get(reply[1], f"status {reply[1]}")


async def _probe(address: str, timeout: float, token: str | None) -> ProbeResult:
    result = ProbeResult(address=address)
    parsed = parse_address(address)
    if isinstance(parsed, UnixAddress):
        channel = Channel(path=parsed.path, codec=RawCodec())
    else:
        assert isinstance(parsed, TcpAddress)
        channel = Channel(parsed.host, parsed.port, codec=RawCodec())
    metadata = None if token is None else {"authorization": f"Bearer {token}"}
    try:
        result.health = await _health(channel, metadata, timeout)
        request = env_v1.HandshakeRequest(
            base=core_v1.HandshakeRequest(protocol_generation=PROTOCOL_GENERATION)
        )
        data = await _call(channel, HANDSHAKE_PATH, bytes(request), metadata, timeout)
        response = env_v1.HandshakeResponse.parse(data or b"")
        result.handshake = response
        compatible = response.base is not None and response.base.compatible
        healthy = result.health in ("SERVING", "no health service")
        result.serving = compatible and healthy
        if not compatible:
            message = response.base.error_message if response.base is not None else ""
            result.error = f"incompatible: {message}" if message else "incompatible"
        elif not healthy:
            result.error = f"health: {result.health}"
    except GRPCError as exc:
        result.error = f"{exc.status.name}: {exc.message or ''}".rstrip(": ")
    except (OSError, asyncio.TimeoutError, StreamTerminatedError) as exc:
        result.error = f"unreachable: {type(exc).__name__}: {exc}".rstrip(": ")
    finally:
        channel.close()
    return result


def probe(address: str, *, timeout: float = 5.0, token: str | None = None) -> ProbeResult:
    """Probe ``address`` (any form rlmesh accepts) within ``timeout`` seconds per call."""
    return asyncio.run(asyncio.wait_for(_probe(address, timeout, token), 3 * timeout))
