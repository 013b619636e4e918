"""Both drivers' request shaping and reply reading: actions encoded and observations
decoded for the contract's spaces (:class:`Codecs`), frames, batched infos, lane and
seed lists, and the client's own deadline past a call's ``timeout_ms``."""

from __future__ import annotations

import io
import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from .._codec import SpaceCodec
from .._errors import CodecError
from ._contract import Contract
from ._errors import (
    EndpointError,
    EnvError,
    ErrorCode,
    RequestTimeoutError,
)
from ._messages import Reply

__all__ = [
    "ACTION_ERRORS",
    "REPLY_GRACE",
    "Codecs",
    "decode_frame",
    "expand_seeds",
    "invalid_actions",
    "lane_infos",
    "lanes_of",
    "late",
    "reply_deadline",
    "request_seeds",
    "step_arrays",
    "timeout_of",
    "wire_seed",
]

ACTION_ERRORS = (ValueError, TypeError, KeyError, IndexError)
"""What converting actions that do not fit the action space raises."""


def invalid_actions(exc: BaseException) -> EnvError:
    """Actions the client cannot encode: ``INVALID_ACTION``, recoverable, nothing sent."""
    what = f"no key {exc}" if isinstance(exc, KeyError) else str(exc)
    return EnvError(
        f"actions do not fit the action space: {what}",
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
        fast = self.fast_observation
        if fast is not None:
            rows = fast.decode(leaves, k)
            if fast.shape == () and not fast.scalar:  # a Box of shape (): 0-d arrays
                return [np.array(row) for row in rows]
            return list(rows)
        try:
            values = self.observation.decode(leaves, k)
        except CodecError as exc:
            raise malformed(f"observation does not match the contract: {exc}") from None
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

    __slots__ = ("binary", "out", "row_bytes", "scalar", "shape", "wire")

    def __init__(
        self,
        wire: np.dtype[Any],
        out: np.dtype[Any],
        shape: tuple[int, ...],
        binary: bool,
        *,
        scalar: bool = False,
    ) -> None:
        self.wire = wire
        self.out = out
        self.shape = shape
        self.binary = binary
        self.scalar = scalar
        """A lane's value is a numpy scalar (Discrete), not an array (even of shape ())."""
        self.row_bytes = int(np.prod(shape, dtype=np.int64)) * wire.itemsize

    @classmethod
    def of(cls, space: gym.spaces.Space[Any]) -> _FixedLeaf | None:
        if isinstance(space, gym.spaces.Box):
            dtype = np.dtype(space.dtype)
            return cls(dtype.newbyteorder("<"), dtype, tuple(space.shape), dtype == np.bool_)
        if isinstance(space, gym.spaces.Discrete):
            return cls(np.dtype("<i8"), np.dtype(space.dtype), (), False, scalar=True)
        if isinstance(space, gym.spaces.MultiDiscrete):
            return cls(np.dtype("<i8"), np.dtype(space.dtype), tuple(space.nvec.shape), False)
        if isinstance(space, gym.spaces.MultiBinary):
            return cls(np.dtype("u1"), np.dtype(space.dtype), tuple(space.shape), True)
        return None

    def decode(self, leaves: Sequence[bytes] | None, k: int) -> np.ndarray[Any, Any]:
        if leaves is None or len(leaves) != 1 or len(leaves[0]) != k * self.row_bytes:
            got = "no value" if leaves is None else f"{[len(x) for x in leaves]} leaf bytes"
            raise malformed(f"observation does not match the contract: {got} for {k} lanes")
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
        elif not np.can_cast(array.dtype, self.wire) and array.size:
            # A narrower integer Box (int8 actions given as int64): values the wire
            # dtype cannot hold go the general path, which refuses them (no wrap-around).
            limits = np.iinfo(self.wire)
            if array.min() < limits.min or array.max() > limits.max:
                return None
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


def malformed(message: str) -> EndpointError:
    return EndpointError(f"malformed reply from the server: {message}", code=ErrorCode.INTERNAL)


def decode_frame(reply: Reply) -> np.ndarray[Any, Any] | None:
    """A render reply's PNG as a uint8 array of its own shape, as rlmesh's client gives
    it: ``(H, W, 3)`` for RGB, ``(H, W, 4)`` for RGBA, ``(H, W)`` for gray; other PNG
    modes as RGB (None: nothing rendered)."""
    if reply.frame is None:
        return None
    from PIL import Image

    try:
        with Image.open(io.BytesIO(reply.frame)) as image:
            decoded = image if image.mode in ("RGB", "RGBA", "L") else image.convert("RGB")
            frame: np.ndarray[Any, Any] = np.asarray(decoded, dtype=np.uint8).copy()
            return frame
    except Exception as exc:
        raise malformed(f"render frame is not a readable PNG: {exc}") from None


def lane_infos(infos: dict[str, Any], k: int) -> list[dict[str, Any]]:
    """Each lane's own info map from a reply covering ``k`` lanes (SPEC §5.3). No infos
    at all is no lane's (a server sends none when no lane's env gave one)."""
    if k == 1:
        return [infos]
    if not infos:
        return [{} for _ in range(k)]
    lanes = infos.get("final_info")
    if not isinstance(lanes, list) or len(lanes) != k:
        raise malformed(f"a {k}-lane reply's infos have no {k}-entry final_info list")
    return [lane if isinstance(lane, dict) else {} for lane in lanes]


def step_arrays(
    reply: Reply, k: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    rewards = np.asarray(reply.rewards, dtype=np.float64)
    if rewards.shape != (k,) or len(reply.terminated) != k or len(reply.truncated) != k:
        raise malformed(
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


SEED_BOUND = 2**63
"""Seeds cross as int64 (SPEC §4): ``-SEED_BOUND <= seed < SEED_BOUND``."""


def wire_seed(seed: Any) -> int:
    """``seed`` as the int the wire carries: TypeError for a non-integer, ValueError for
    one it cannot carry (sent as it is, 2**64 would reach the env as 0, 2**63 as -2**63)."""
    value = operator.index(seed)
    if not -SEED_BOUND <= value < SEED_BOUND:
        raise ValueError(
            f"seed {value} does not fit the protocol's int64 seeds (-2**63 <= seed < 2**63)"
        )
    return value


def _lanes_mismatch(got: int, want: int) -> str:
    return f"{got} seeds for {want} lanes"


def expand_seeds(
    seed: int | Sequence[int | None] | None,
    offsets: Sequence[int],
    mismatch: Callable[[int, int], str] = _lanes_mismatch,
    *,
    some_unseeded: bool = True,
) -> list[int | None]:
    """One seed per addressed lane, each one the wire can carry (:func:`wire_seed`):
    ``None`` for every lane, an int (``seed + offset``, one offset per lane), or a
    sequence as long as ``offsets`` (else ValueError worded by ``mismatch(got, want)``).
    ``some_unseeded=False``: a sequence mixing None and seeds is a ValueError (checked
    before the seeds themselves)."""
    if seed is None:
        return [None] * len(offsets)
    if isinstance(seed, int | np.integer):
        return [wire_seed(int(seed) + offset) for offset in offsets]
    values = list(seed)
    if len(values) != len(offsets):
        raise ValueError(mismatch(len(values), len(offsets)))
    if not some_unseeded and any(s is None for s in values) and any(s is not None for s in values):
        raise ValueError(
            "seeds must be all ints or all None (the wire cannot seed only some lanes)"
        )
    return [None if s is None else wire_seed(s) for s in values]


def request_seeds(seeds: int | Sequence[int | None] | None, k: int) -> list[int]:
    """One request's ``seeds`` field for ``k`` addressed lanes (``[]``: unseeded) from
    ``None``, an int (``seed + i`` for the i-th addressed lane, as gymnasium), or ``k``
    ints (all None = unseeded). (A vector's per-lane seeds are
    :func:`._autoreset.seeds_of`'s.)"""
    values = expand_seeds(seeds, range(k), some_unseeded=False)
    if any(s is None for s in values):
        return []  # all of them
    return cast("list[int]", values)


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
