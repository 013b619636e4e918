"""What both drivers share: the contract, request shaping, reply routing and results.

Sans-IO: a :class:`JoinState` owns the :class:`GrpcConnection` and the table of pending
requests (by ``request_id``); the Trio driver and the blocking driver feed it bytes and
wait on its slots in their own way.
"""

from __future__ import annotations

import collections
import io
import itertools
import math
import numbers
import re
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from .._address import TcpAddress, UnixAddress, parse_address
from .._codec import SpaceCodec, from_meta_map, spec_to_space
from .._errors import CodecError
from .._logging import protect_credentials
from .._tls import ABRUPT_END, TlsSetting, client_context, describe_tls_error
from .._wire._protobuf import DecodeError
from .._wire._protocol import HANDSHAKE_PATH, JOIN_PATH
from ._errors import (
    ConnectionLostError,
    EndpointClosedError,
    EndpointError,
    EnvError,
    ErrorCode,
    HandshakeError,
    RequestTimeoutError,
    RpcError,
)
from ._grpc import Call, GrpcConnection
from ._messages import EDITION, Reply, decode_handshake_response, decode_reply

__all__ = [
    "HANDSHAKE_PATH",
    "JOIN_PATH",
    "Contract",
    "JoinState",
    "Slot",
    "Target",
    "lane_infos",
    "tls_context",
    "tls_failure",
    "transport_failure",
]

MAX_COMPLETED = 65536
"""Episode records kept for :meth:`Endpoint.pop_completed_episodes` (older ones drop)."""

AUTORESET_NAMES = {0: "UNSPECIFIED", 1: "NEXT_STEP", 2: "SAME_STEP", 3: "DISABLED"}


@dataclass(frozen=True)
class Target:
    """Where to connect, and the ``:authority`` to send."""

    host: str | None
    port: int | None
    path: str | None

    @classmethod
    def parse(cls, address: str) -> Target:
        parsed = parse_address(address)
        if isinstance(parsed, UnixAddress):
            return cls(None, None, parsed.path)
        assert isinstance(parsed, TcpAddress)
        if parsed.port == 0:
            raise ValueError(f"invalid address {address!r}: port 0 cannot be connected to")
        return cls(parsed.host, parsed.port, None)

    @property
    def authority(self) -> str:
        if self.path is not None:
            return "localhost"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"unix://{self.path}" if self.path is not None else f"tcp://{self.authority}"


def tls_context(target: Target, tls: TlsSetting) -> ssl.SSLContext | None:
    """The TLS context to connect to ``target`` with (None: plaintext); TLS is for TCP
    addresses (a unix socket is guarded by its file permissions)."""
    context = client_context(tls)
    if context is not None and target.path is not None:
        raise ValueError(f"tls= is for TCP addresses, not {target} (unix sockets are plaintext)")
    return context


def transport_failure(conn: GrpcConnection, exc: BaseException, what: str) -> str:
    """Why the connection broke, in words: a TLS error said as such, and a TLS session
    that ended (reset or EOF) before the server's first HTTP/2 frame said to be what it
    almost always is (an mTLS server closes a refused client without a TLS alert)."""
    why = describe_tls_error(exc)
    if why is None and conn.tls and not conn.heard_from_server:
        why = ABRUPT_END
    return f"{what}: TLS: {why}" if why is not None else f"{what}: {exc!r}"


def tls_failure(target: Target, exc: BaseException) -> ConnectionLostError:
    """A failed TLS handshake (or a TLS error right after it), said plainly."""
    why = describe_tls_error(exc)
    if why is None:
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
        why = (
            f"{type(cause).__name__}: {cause} (the server broke off the handshake: it does "
            "not serve TLS here, or refused this client's certificate)"
        )
    return ConnectionLostError(f"TLS handshake with {target} failed: {why}")


DEFAULT_CONNECT_TIMEOUT_SECONDS = 10.0
DEFAULT_PING_INTERVAL_SECONDS = 10.0
DEFAULT_PING_TIMEOUT_SECONDS = 20.0
DEFAULT_CLOSE_TIMEOUT_SECONDS = 5.0

OLD_CONNECTION_KEYWORDS = {
    "token": "auth_token",
    "connect_timeout": "connect_timeout_seconds",
    "ping_interval": "ping_interval_seconds",
    "ping_timeout": "ping_timeout_seconds",
    "close_timeout": "close_timeout_seconds",
}
"""The connection keywords of 0.1 (deprecated, removed in 0.2) and their new names."""


def check_timeouts(**timeouts: float) -> None:
    """Every one of the connection's timeouts must be a number > 0 (and finite)."""
    for name, value in timeouts.items():
        if not value > 0 or math.isinf(value):
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")


def no_ping_answer(interval: float, timeout: float) -> str:
    """Why a connection whose keep-alive PING went unanswered was given up."""
    return (
        f"no answer to a keep-alive PING (sent after {interval:g} s of silence) "
        f"within {timeout:g} s"
    )


def metadata(auth_token: str | None) -> list[tuple[str, str]]:
    """The ``authorization: Bearer`` header for ``auth_token`` (none for None)."""
    if auth_token is None:
        return []
    if (
        not isinstance(auth_token, str)
        or not auth_token
        or any(c in auth_token for c in "\r\n\x00")
    ):
        raise ValueError("auth_token must be a non-empty string without line breaks")
    protect_credentials(auth_token)  # hpack's DEBUG lines would print the header
    return [("authorization", f"Bearer {auth_token}")]


def request_timeout_ms(seconds: float | None) -> int:
    """The wire's ``timeout_ms`` for ``request_timeout_seconds`` (0: no deadline).

    Converted as rlmesh 0.1.0's ``RemoteEnv`` converts its ``request_timeout_seconds``
    (measured on its wire): rounded to the nanosecond, then whole milliseconds, the rest
    dropped (2.5 -> 2500, 0.0015 -> 1, 0.0019999999 -> 2). None and 0 mean no deadline.
    A positive value under one millisecond is refused: the reference would send 0, no
    deadline at all, the opposite of what was asked.
    """
    if seconds is None:
        return 0
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"request_timeout_seconds must be a number, not {type(seconds).__name__}")
    value = float(seconds)
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"request_timeout_seconds must be >= 0, got {seconds!r}")
    ms = round(Fraction(value) * 1_000_000_000) // 1_000_000
    if value and ms < 1:
        raise ValueError(
            f"request_timeout_seconds={seconds!r} is under the wire's 1 ms resolution "
            "(0 or None: no deadline)"
        )
    return int(ms)


def seconds_of_ms(ms: int | None) -> float | None:
    """The deprecated ``request_timeout_ms`` as ``request_timeout_seconds``."""
    return None if ms is None else int(ms) / 1000


# ---------------------------------------------------------------------------- contract


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


def call_failure(call: Call, what: str, *, shutting_down: bool = False) -> EndpointError:
    """Why ``call`` ended without (more) replies; ``shutting_down``: the server had sent
    a graceful GOAWAY before, so a call cut without a status was cut by its shutdown."""
    if call.status is not None and call.status != 0:
        return RpcError(call.status, call.status_message)
    why = call.lost if call.lost is not None else "the server ended the stream"
    if shutting_down:
        return ConnectionLostError(f"{what}: {SHUTTING_DOWN} ({why})")
    return ConnectionLostError(f"{what}: {why}")


SHUTTING_DOWN = "the server is shutting down (GOAWAY received)"
"""How a request cut by a server's shutdown is told (after a graceful GOAWAY)."""

_LANE_STOPPED = re.compile(r"lane \d+ (?:stopped before answering|is no longer running)")
"""What a rlmesh-trio server answers for a lane job its stop cut short (the lane wound
down before answering, or no longer takes jobs)."""


def _lanes_text(lanes: Sequence[int]) -> str:
    if not lanes:
        return "it"
    if len(lanes) == 1:
        return f"lane {lanes[0]}"
    if list(lanes) == list(range(lanes[0], lanes[0] + len(lanes))):
        return f"lanes {lanes[0]}-{lanes[-1]}"
    shown = ", ".join(str(lane) for lane in lanes[:8])
    return f"lanes {shown}" + (f", ... ({len(lanes)} lanes)" if len(lanes) > 8 else "")


def shutdown_error(slot: Slot, detail: str) -> ConnectionLostError:
    """The error of a request a shutting-down server did not answer: which lanes, what."""
    return ConnectionLostError(
        f"{SHUTTING_DOWN} before {_lanes_text(slot.lanes)} answered the {slot.verb} ({detail})"
    )


# ---------------------------------------------------------------------------- codecs


ACTION_ERRORS = (ValueError, TypeError, KeyError, IndexError)
"""What converting actions that do not fit the action space raises."""


def invalid_actions(exc: BaseException) -> EnvError:
    """Actions the client cannot encode: ``INVALID_ACTION``, recoverable, nothing sent."""
    return EnvError(
        f"actions do not fit the action space: {exc}",
        code=ErrorCode.INVALID_ACTION,
        is_recoverable=True,
    )


class Codecs:
    """The spaces' codecs and batched forms, built once per endpoint."""

    def __init__(self, contract: Contract) -> None:
        self.observation = SpaceCodec(contract.observation_space)
        self.action = SpaceCodec(contract.action_space)
        self._batch_actions: dict[int, gym.spaces.Space[Any]] = {}
        self.fast_observation = _FixedLeaf.of(contract.observation_space)
        """Set when the observation is one fixed-width leaf (Box, Discrete, MultiBinary,
        MultiDiscrete): batches are then read straight from the slab."""
        self.fast_action = _FixedLeaf.of(contract.action_space)

    def batched_action_space(self, k: int) -> gym.spaces.Space[Any]:
        space = self._batch_actions.get(k)
        if space is None:
            space = self._batch_actions[k] = batch_space(self.action.space, k)
        return space

    def encode_actions(self, actions: Any, k: int) -> list[bytes]:
        """``k`` lanes' actions (batched, leading dimension ``k``) as wire leaves."""
        if self.fast_action is not None:
            slab = self.fast_action.encode(actions, k)
            if slab is not None:
                return [slab]
        try:
            rows = list(iterate(self.batched_action_space(k), actions))
            if len(rows) != k:
                raise ValueError(f"expected actions for {k} lanes, got {len(rows)}")
            return self.action.encode_batch(rows)
        except ACTION_ERRORS as exc:
            raise invalid_actions(exc) from exc

    def encode_actions_rows(self, rows: Sequence[Any]) -> list[bytes]:
        """Lanes' actions, one per row, as wire leaves."""
        try:
            return self.action.encode_batch(rows)
        except ACTION_ERRORS as exc:
            raise invalid_actions(exc) from exc

    def encode_single_action(self, action: Any) -> list[bytes]:
        try:
            return self.action.encode(action)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise EnvError(
                f"action does not fit the action space: {exc}",
                code=ErrorCode.INVALID_ACTION,
                is_recoverable=True,
            ) from exc

    def observation_batch(self, leaves: Sequence[bytes] | None, k: int) -> Any:
        """The ``k`` lanes' observations batched as gymnasium batches them."""
        if self.fast_observation is not None:
            return self.fast_observation.decode(leaves, k)
        return self.batch(self.observations(leaves, k))

    def observations(self, leaves: Sequence[bytes] | None, k: int) -> list[Any]:
        """Each of the ``k`` lanes' observations (fresh, writable objects)."""
        if self.fast_observation is not None:
            return list(self.fast_observation.decode(leaves, k))
        try:
            values = self.observation.decode(leaves, k)
        except CodecError as exc:
            raise _malformed(f"observation does not match the contract: {exc}") from None
        return [_own(self.observation.space, v) for v in values]

    def batch(self, values: Sequence[Any]) -> Any:
        if self.fast_observation is not None:
            return np.stack(values)
        space = self.observation.space
        out: Any = create_empty_array(space, len(values))
        return concatenate(space, values, out)


class _FixedLeaf:
    """A space that is a single fixed-width wire leaf: the fast path for the common
    Box / Discrete / MultiBinary / MultiDiscrete spaces (no per-lane Python objects)."""

    __slots__ = ("binary", "out", "row_bytes", "shape", "wire")

    def __init__(
        self, wire: np.dtype[Any], out: np.dtype[Any], shape: tuple[int, ...], binary: bool
    ) -> None:
        self.wire = wire
        self.out = out
        self.shape = shape
        self.binary = binary
        self.row_bytes = int(np.prod(shape, dtype=np.int64)) * wire.itemsize

    @classmethod
    def of(cls, space: gym.spaces.Space[Any]) -> _FixedLeaf | None:
        if isinstance(space, gym.spaces.Box):
            dtype = np.dtype(space.dtype)
            return cls(dtype.newbyteorder("<"), dtype, tuple(space.shape), dtype == np.bool_)
        if isinstance(space, gym.spaces.Discrete):
            return cls(np.dtype("<i8"), np.dtype(space.dtype), (), False)
        if isinstance(space, gym.spaces.MultiDiscrete):
            return cls(np.dtype("<i8"), np.dtype(space.dtype), tuple(space.nvec.shape), False)
        if isinstance(space, gym.spaces.MultiBinary):
            return cls(np.dtype("u1"), np.dtype(space.dtype), tuple(space.shape), True)
        return None

    def decode(self, leaves: Sequence[bytes] | None, k: int) -> np.ndarray[Any, Any]:
        if leaves is None or len(leaves) != 1 or len(leaves[0]) != k * self.row_bytes:
            got = "no value" if leaves is None else f"{[len(x) for x in leaves]} leaf bytes"
            raise _malformed(f"observation does not match the contract: {got} for {k} lanes")
        array = np.frombuffer(leaves[0], dtype=self.wire).reshape(k, *self.shape)
        if self.binary:
            array = array != 0
        return array.astype(self.out)  # a copy: writable, owns its memory

    def encode(self, actions: Any, k: int) -> bytes | None:
        """The slab of ``k`` lanes' actions if they are already a plain array of the
        right shape and kind, else None (the general path then converts and checks)."""
        if not isinstance(actions, np.ndarray | list | tuple):
            return None
        array = np.asarray(actions)
        if array.shape != (k, *self.shape):
            return None
        kind = array.dtype.kind
        if self.wire.kind == "f" or self.out == np.bool_:
            exact = array.dtype == self.out  # floats and bools: exactly the space's dtype
            if not exact:
                return None
        elif not _integral(kind, array.dtype.itemsize, self.binary):
            return None
        if self.binary:
            array = array != 0
        return array.astype(self.wire, copy=False).tobytes()


def _integral(kind: str, itemsize: int, binary: bool) -> bool:
    """Integers that fit int64 (bools too for MultiBinary): encoded without checks."""
    if kind == "b":
        return binary
    return kind == "i" or (kind == "u" and itemsize < 8)


def _own(space: gym.spaces.Space[Any], value: Any) -> Any:
    """A lane's decoded value as the env would hand it: writable arrays, numpy scalars."""
    if isinstance(space, gym.spaces.Dict):
        return {key: _own(space[key], value[key]) for key in space.spaces}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(_own(s, v) for s, v in zip(space.spaces, value, strict=True))
    if isinstance(space, gym.spaces.Discrete):
        return np.int64(value)
    if isinstance(space, gym.spaces.Text):
        return value
    return np.array(value, dtype=space.dtype)


def _malformed(message: str) -> EndpointError:
    return EndpointError(f"malformed reply from the server: {message}", code=ErrorCode.INTERNAL)


def decode_frame(reply: Reply) -> np.ndarray[Any, Any] | None:
    """A render reply's PNG as an ``(H, W, 3)`` uint8 array (None: nothing rendered)."""
    if reply.frame is None:
        return None
    from PIL import Image

    try:
        with Image.open(io.BytesIO(reply.frame)) as image:
            frame: np.ndarray[Any, Any] = np.asarray(image.convert("RGB"), dtype=np.uint8).copy()
            return frame
    except Exception as exc:
        raise _malformed(f"render frame is not a readable PNG: {exc}") from None


def lane_infos(infos: dict[str, Any], k: int) -> list[dict[str, Any]]:
    """Each lane's own info map from a reply covering ``k`` lanes (SPEC §5.3)."""
    if k == 1:
        return [infos]
    lanes = infos.get("final_info")
    if not isinstance(lanes, list) or len(lanes) != k:
        raise _malformed(f"a {k}-lane reply's infos have no {k}-entry final_info list")
    return [lane if isinstance(lane, dict) else {} for lane in lanes]


def step_arrays(
    reply: Reply, k: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    rewards = np.asarray(reply.rewards, dtype=np.float64)
    if rewards.shape != (k,) or len(reply.terminated) != k or len(reply.truncated) != k:
        raise _malformed(
            f"a {k}-lane step reply has {rewards.size} rewards and masks of "
            f"{len(reply.terminated)}/{len(reply.truncated)} bytes"
        )
    terminated = np.frombuffer(reply.terminated, dtype=np.uint8) != 0
    truncated = np.frombuffer(reply.truncated, dtype=np.uint8) != 0
    return rewards, terminated, truncated


def lanes_of(env_indices: Sequence[int] | None, num_envs: int) -> list[int] | None:
    """Validate ``env_indices`` (None: the whole vector)."""
    if env_indices is None:
        return None
    lanes = [int(i) for i in np.asarray(env_indices, dtype=np.int64).reshape(-1).tolist()]
    if not lanes:
        raise ValueError("env_indices is empty")
    for lane in lanes:
        if not 0 <= lane < num_envs:
            raise ValueError(f"env_index {lane} out of range for num_envs {num_envs}")
    if len(set(lanes)) != len(lanes):
        raise ValueError(f"duplicate env_index in {lanes}")
    return lanes


def seeds_of(seeds: int | Sequence[int | None] | None, k: int) -> list[int]:
    """``None``, an int (``seed + i`` for the i-th addressed lane, as gymnasium), or
    ``k`` ints (all None = unseeded)."""
    if seeds is None:
        return []
    if isinstance(seeds, int | np.integer):
        return [int(seeds) + i for i in range(k)]
    values = list(seeds)
    if len(values) != k:
        raise ValueError(f"{len(values)} seeds for {k} lanes")
    if all(s is None for s in values):
        return []
    if any(s is None for s in values):
        raise ValueError(
            "seeds must be all ints or all None (the wire cannot seed only some lanes)"
        )
    return [int(s) for s in values]  # type: ignore[arg-type]


REPLY_GRACE = 3.0
"""Seconds past a call's ``timeout_ms`` the client waits for the server's reply (its own
``TIMEOUT`` included) before it gives up on the call itself (:class:`RequestTimeoutError`)."""


def reply_deadline(timeout_ms: int) -> float | None:
    """Seconds the client waits for the reply to a call with ``timeout_ms`` (None: no
    deadline of its own, the keep-alive PINGs still watch the connection)."""
    return timeout_ms / 1000.0 + REPLY_GRACE if timeout_ms else None


def late(verb: str, timeout_ms: int) -> RequestTimeoutError:
    return RequestTimeoutError(
        f"no reply to the {verb} within {timeout_ms}ms plus the client's {REPLY_GRACE:g} s "
        "grace (the server did not answer its own deadline); the call was given up"
    )


def timeout_of(timeout_ms: int | None) -> int:
    if timeout_ms is None:
        return 0
    value = int(timeout_ms)
    if value < 0:
        raise ValueError("timeout_ms must be >= 0")
    return value


# ---------------------------------------------------------------------------- routing


class Slot:
    """One pending request: its reply or the error it ends with, and what it asked
    (``verb``, the ``lanes`` it addressed: empty for a session request) to say so."""

    __slots__ = ("error", "lanes", "reply", "verb", "wake")

    def __init__(
        self, wake: Callable[[], None], verb: str = "request", lanes: Sequence[int] = ()
    ) -> None:
        self.reply: Reply | None = None
        self.error: BaseException | None = None
        self.wake = wake
        self.verb = verb
        self.lanes = tuple(lanes)


class JoinState:
    """The client's side of one Join stream: request ids, pending slots, failure."""

    def __init__(self, conn: GrpcConnection, join: Call, contract: Contract) -> None:
        self.conn = conn
        self.join = join
        self.contract = contract
        self.codecs = Codecs(contract)
        self.pending: dict[str, Slot] = {}
        self.failure: EndpointError | None = None
        """Set once the endpoint is unusable; new requests raise EndpointClosedError from it."""
        self.closing = False
        self.abandoned: set[str] = set()
        """Request ids given up by their callers whose replies have not come yet."""
        self._ids = itertools.count(1)
        self.completed: collections.deque[Any] = collections.deque(maxlen=MAX_COMPLETED)
        """Episodes reported by step replies, not yet popped (the most recent ones)."""

    def next_id(self) -> str:
        return f"rt-{next(self._ids)}"

    def check_open(self) -> None:
        if self.failure is not None:
            raise EndpointClosedError(f"the endpoint is closed: {self.failure}") from self.failure
        if self.closing:
            raise EndpointClosedError()

    def submit(
        self,
        payload: bytes,
        request_id: str,
        wake: Callable[[], None],
        *,
        verb: str = "request",
        lanes: Sequence[int] | None = (),
    ) -> Slot:
        """Queue a request (whole, on the Join stream) and register its slot. ``verb``
        and ``lanes`` (None: every lane; empty: a session request) name it in errors."""
        self.check_open()
        slot = Slot(wake, verb, range(self.contract.num_envs) if lanes is None else lanes)
        self.pending[request_id] = slot
        try:
            self.conn.send(self.join, payload)
        except ConnectionError as exc:
            del self.pending[request_id]
            self.fail(ConnectionLostError(str(exc)))
            raise self.failure from None  # type: ignore[misc]
        return slot

    def submit_many(self, requests: Sequence[tuple[bytes, str, Callable[[], None]]]) -> list[Slot]:
        """Queue requests back to back (``(payload, request_id, wake)`` each) and
        register their slots: all of them, or none."""
        if len(requests) == 1:
            return [self.submit(*requests[0])]
        self.check_open()
        slots = [Slot(wake) for _, _, wake in requests]
        for (_, request_id, _), slot in zip(requests, slots, strict=True):
            self.pending[request_id] = slot
        try:
            self.conn.send_many(self.join, [payload for payload, _, _ in requests])
        except (ConnectionError, ValueError) as exc:
            for _, request_id, _ in requests:
                del self.pending[request_id]
            if isinstance(exc, ValueError):
                raise
            self.fail(ConnectionLostError(str(exc)))
            raise self.failure from None  # type: ignore[misc]
        return slots

    def abandon(self, request_id: str) -> None:
        """A waiter gave up (cancelled, or past its deadline): its reply, if it comes, is
        dropped."""
        if self.pending.pop(request_id, None) is not None:
            self.abandoned.add(request_id)

    def process(self) -> None:
        """Route every reply that arrived; fail everyone if the stream or connection ended."""
        join = self.join
        while join.messages:
            data = join.messages.popleft()
            try:
                reply = decode_reply(data)
            except DecodeError as exc:
                self.fail(_malformed(f"undecodable JoinResponse: {exc}"))
                self.conn.cancel(join)
                return
            slot = self.pending.pop(reply.request_id, None)
            if slot is None:
                if reply.request_id in self.abandoned:
                    self.abandoned.discard(reply.request_id)
                    continue  # the late reply of an abandoned (cancelled) request
                if self.failure is not None:
                    continue  # pending requests were failed already
                self.fail(_malformed(f"a reply to request_id {reply.request_id!r}, never sent"))
                self.conn.cancel(join)
                return
            if reply.kind == "error":
                error = EnvError(
                    reply.error_message,
                    code=ErrorCode.of(reply.error_code),
                    is_recoverable=reply.error_recoverable,
                    request_id=reply.request_id,
                    debug_info=reply.error_debug,
                )
                if self._cut_by_shutdown(error):
                    lost = shutdown_error(slot, f"the server said: {error.message}")
                    lost.__cause__ = error
                    slot.error = lost
                    slot.wake()
                    self.fail(
                        ConnectionLostError(f"{SHUTTING_DOWN}: {error.message}"),
                        detail="the server's stop cut the requests in flight short",
                    )
                    continue
                slot.error = error
                slot.wake()
                if not error.is_recoverable:
                    self.fail(error)
                continue
            slot.reply = reply
            slot.wake()
        if join.ended or self.conn.lost is not None:
            self.fail(call_failure(join, "the Join stream ended"))

    def _cut_by_shutdown(self, error: EnvError) -> bool:
        """A rlmesh-trio server that sent a graceful GOAWAY answers the lane jobs its stop
        cut short with a fatal INTERNAL "lane <i> stopped before answering": that is
        the shutdown, not a fault of the env."""
        return (
            self.conn.shutting_down
            and not error.is_recoverable
            and error.code == ErrorCode.INTERNAL
            and _LANE_STOPPED.fullmatch(error.message) is not None
        )

    def fail(self, error: EndpointError, *, detail: str | None = None) -> None:
        """Make the endpoint unusable; every pending request fails. A connection lost
        after the server's graceful GOAWAY is told as its shutdown, to each request
        with the lanes it was waiting for (and ``detail``, else why it was lost)."""
        shutdown = isinstance(error, ConnectionLostError) and self.conn.shutting_down
        if shutdown and not error.message.startswith(SHUTTING_DOWN):
            error = ConnectionLostError(f"{SHUTTING_DOWN}: {error.message}")
        if self.failure is None:
            self.failure = error
        pending, self.pending = self.pending, {}
        for slot in pending.values():
            if slot.error is None and slot.reply is None:
                if shutdown:
                    why = error.message.removeprefix(SHUTTING_DOWN).removeprefix(": ")
                    slot.error = shutdown_error(slot, detail or why)
                elif isinstance(error, EnvError):
                    closed = EndpointClosedError(
                        f"the endpoint was closed by a fatal error: {error}"
                    )
                    closed.__cause__ = error
                    slot.error = closed
                else:
                    slot.error = error
                slot.wake()


def result_of(slot: Slot, expect: str) -> Reply:
    if slot.error is not None:
        raise slot.error
    reply = slot.reply
    assert reply is not None
    if reply.kind != expect:
        raise _malformed(f"expected a {expect} reply, got {reply.kind or 'an empty one'!r}")
    return reply


def check_options(options: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping, not {type(options).__name__}")
    return options
