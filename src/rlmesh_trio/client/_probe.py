""":func:`probe`: is an endpoint there, healthy and compatible -- and what does it serve?

One connection of the client's own (the blocking driver: callable from any thread, no
event loop): the grpc.health.v1 Check, then a Handshake. Works against rlmesh-trio and
against rlmesh 0.1.0's server, which has no health service (a compatible Handshake then
counts as serving). ``rlmesh-trio probe`` prints :meth:`ProbeResult.report`; the fleets'
health checks read the same result.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from .._codec import spec_to_space
from .._deprecation import renamed_kwargs
from .._tls import TlsSetting
from .._wire import DecodeError
from .._wire._protocol import HANDSHAKE_PATH, HEALTH_CHECK_PATH, SERVICE_NAME
from .._wire._unary import HEALTH_STATUS_NAMES, decode_health_response, encode_health_request
from ._blocking import BlockingConnection
from ._contract import AUTORESET_NAMES
from ._errors import ConnectionLostError, grpc_status_name
from ._grpc import Call
from ._messages import decode_handshake_response, handshake_request
from ._settings import ConnectionSettings, Target

__all__ = ["ProbeResult", "probe"]

_UNIMPLEMENTED = 12
LANE_STATES_KEY = "rlmesh_trio.lane_states"
SERVER_IMPLEMENTATION_KEY = "rlmesh.server.implementation"


@dataclass(frozen=True)
class ProbeResult:
    """What one :func:`probe` found.

    ``serving``: the endpoint answers health with SERVING (or has no health service, as
    rlmesh 0.1.0's server) and accepts a Handshake: it can take a session. ``error``
    says why not: ``unreachable: ...`` (nothing listening, no answer in time, a TLS
    handshake that failed), a gRPC status of the Handshake (``UNAUTHENTICATED: ...``
    without the endpoint's token), ``incompatible: ...`` or ``health: NOT_SERVING``.
    The other fields are what the Handshake told (None / empty when it was not
    answered).
    """

    address: str
    serving: bool = False
    health: str = "unknown"
    """``SERVING``, ``NOT_SERVING``, ``UNKNOWN``, ``SERVICE_UNKNOWN``, ``no health
    service``, ``error (STATUS: message)``, or ``unknown`` when it was not reached."""
    error: str | None = None
    compatible: bool | None = None
    """The Handshake's verdict (None: no Handshake answered)."""
    edition: str | None = None
    editions: tuple[str, ...] = ()
    capabilities: dict[str, str] = field(default_factory=dict)
    server: str | None = None
    """The server implementation (``rlmesh-trio 0.2.0``, ``rlmesh-env-server 0.1.0``)."""
    platform: str | None = None
    lane_states: tuple[str, ...] = ()
    """Each lane's supervision state (rlmesh-trio servers), in lane order."""
    env_id: str | None = None
    num_envs: int | None = None
    render_mode: str | None = None
    autoreset_mode: str | None = None
    observation_space: gym.spaces.Space[Any] | None = None
    action_space: gym.spaces.Space[Any] | None = None
    unreadable_spaces: dict[str, str] = field(default_factory=dict)
    """``observation_space`` / ``action_space`` the contract has but this build cannot
    express, with why."""

    def report(self) -> dict[str, Any]:
        """Everything found, as ``rlmesh-trio probe`` prints it (JSON-ready, in order)."""
        out: dict[str, Any] = {
            "address": self.address,
            "serving": self.serving,
            "health": self.health,
        }
        if self.error is not None:
            out["error"] = self.error
        if self.compatible is not None:
            out["compatible"] = self.compatible
            out["edition"] = self.edition
            out["editions"] = list(self.editions)
            out["capabilities"] = dict(self.capabilities)
            if self.server is not None:
                out["server"] = self.server
                out["platform"] = self.platform
            if self.lane_states:
                out["lanes"] = {str(i): state for i, state in enumerate(self.lane_states)}
        if self.env_id is not None:
            out["env_id"] = self.env_id
            out["num_envs"] = self.num_envs
            out["render_mode"] = self.render_mode
            out["autoreset_mode"] = self.autoreset_mode
            for key in ("observation_space", "action_space"):
                space = getattr(self, key)
                problem = self.unreadable_spaces.get(key)
                out[key] = f"<{problem}>" if problem else None if space is None else repr(space)
        return out


class _Unreachable(Exception):
    """The call got no answer: the connection failed or the deadline passed."""


def _status(call: Call) -> str:
    name = grpc_status_name(call.status or 0)
    return f"{name}: {call.status_message}" if call.status_message else name


def _call(link: BlockingConnection, path: str, payload: bytes, timeout: float) -> Call:
    try:
        call = link.unary(path, payload, time.monotonic() + timeout)
    except ConnectionLostError:
        what = path.rsplit("/", 1)[-1]
        raise _Unreachable(f"TimeoutError: no answer to {what} within {timeout:g} s") from None
    if call.status is None:
        raise _Unreachable(call.lost or "the stream ended without a status")
    return call


def _health(link: BlockingConnection, timeout: float) -> str:
    call = _call(link, HEALTH_CHECK_PATH, encode_health_request(SERVICE_NAME), timeout)
    if call.status == _UNIMPLEMENTED:
        return "no health service"
    if call.status != 0:
        return f"error ({_status(call)})"
    if not call.messages:
        return "UNKNOWN"
    try:
        status = decode_health_response(call.messages[0])
    except DecodeError:
        return "UNKNOWN"
    return HEALTH_STATUS_NAMES.get(status, f"status {status}")


def _handshake(found: dict[str, Any], data: bytes) -> None:
    """What a HandshakeResponse says, into ``found``; raises DecodeError."""
    response = decode_handshake_response(data)
    base = response.base
    found["compatible"] = bool(base is not None and base.compatible)
    if base is None:
        found["error"] = "incompatible: no handshake base"
        return
    if not base.compatible:
        found["error"] = (
            f"incompatible: {base.error_message}" if base.error_message else "incompatible"
        )
    found["edition"] = base.preferred_workflow_edition
    found["editions"] = tuple(base.supported_workflow_editions)
    found["capabilities"] = dict(base.capabilities)
    peer = base.peer_info
    if peer is not None:
        found["server"] = peer.extra.get(SERVER_IMPLEMENTATION_KEY) or (
            f"{peer.component} {peer.package_version}"
        )
        found["platform"] = f"{peer.language} {peer.language_version}, {peer.os} {peer.arch}"
        states = peer.extra.get(LANE_STATES_KEY)
        if states:
            found["lane_states"] = tuple(states.split(","))
    contract = response.env_contract
    if contract is None or contract.spec is None:
        return
    spec = contract.spec
    found["env_id"] = spec.id
    found["num_envs"] = int(contract.num_envs)
    found["render_mode"] = contract.render_mode or None
    mode = int(contract.autoreset_mode)
    found["autoreset_mode"] = AUTORESET_NAMES.get(mode, str(mode))
    unreadable: dict[str, str] = {}
    for key, space in (
        ("observation_space", spec.observation_space),
        ("action_space", spec.action_space),
    ):
        if space is None:
            continue
        try:
            found[key] = spec_to_space(space)
        except Exception as exc:  # a space this build cannot show: say so, not fail
            unreadable[key] = f"{type(exc).__name__}: {exc}"
    found["unreadable_spaces"] = unreadable


DEFAULT_PROBE_TIMEOUT_SECONDS = 5.0


@renamed_kwargs(token="auth_token", timeout="timeout_seconds")
def probe(
    address: str,
    *,
    auth_token: str | None = None,
    tls: TlsSetting = None,
    timeout_seconds: float = DEFAULT_PROBE_TIMEOUT_SECONDS,
) -> ProbeResult:
    """Probe ``address`` (any form rlmesh accepts): connect, the grpc.health.v1 Check,
    a Handshake; each step within ``timeout_seconds`` (so at most ~3x in all).

    ``auth_token`` is sent as ``authorization: Bearer`` (the health check needs none,
    the Handshake does when the endpoint has one). ``tls`` as
    :func:`~rlmesh_trio.client.open_endpoint` takes it. Never raises for what the
    endpoint does (the result says it); ``ValueError``/``TypeError`` for a bad address,
    timeout or ``tls``. Blocking: from Trio, ``await trio.to_thread.run_sync(...)``.
    The 0.1 keywords ``token`` and ``timeout`` still work (deprecated, removed in 0.2).
    """
    timeout = timeout_seconds
    if not timeout > 0 or math.isinf(timeout):
        raise ValueError(f"timeout_seconds must be a number of seconds > 0, got {timeout!r}")
    target = Target.parse(address)
    found: dict[str, Any] = {}
    try:
        link = BlockingConnection(
            target,
            ConnectionSettings(
                auth_token=auth_token,
                tls=tls,
                connect_timeout_seconds=timeout,
                ping_interval_seconds=timeout,
                ping_timeout_seconds=timeout,
            ),
        )
    except ConnectionLostError as exc:
        cause = exc.__cause__
        error = f"{type(cause).__name__}: {cause}" if isinstance(cause, OSError) else exc.message
        return ProbeResult(address, error=f"unreachable: {error}".rstrip(": "))
    try:
        found["health"] = _health(link, timeout)
        call = _call(link, HANDSHAKE_PATH, handshake_request(), timeout)
        if call.status != 0:
            found["error"] = _status(call)
        elif not call.messages:
            found["error"] = "the server answered the Handshake with no message"
        else:
            try:
                _handshake(found, call.messages[0])
            except DecodeError as exc:
                found["error"] = f"undecodable HandshakeResponse: {exc}"
    except _Unreachable as exc:
        found["error"] = f"unreachable: {exc}"
    finally:
        link.close()
    healthy = found.get("health") in ("SERVING", "no health service")
    if found.get("compatible") and not healthy and "error" not in found:
        found["error"] = f"health: {found.get('health', 'unknown')}"
    serving = bool(found.get("compatible")) and healthy and "error" not in found
    return ProbeResult(address, serving=serving, **found)
