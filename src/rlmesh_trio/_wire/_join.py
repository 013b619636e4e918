"""The per-step messages: strict JoinRequest decoding and JoinResponse encoding by hand.

Why by hand: these two messages cross the transport thread on every step, and the
transport thread is the server's bottleneck. betterproto2 0.10 spends most of
``bytes(msg)`` in a per-field ``warnings.catch_warnings()`` (which is also not
thread-safe), and its ``parse`` re-derives class metadata and silently accepts truncated
input. The messages stay betterproto2 objects (the session builds and reads them as
usual); only their wire form is produced or read here.

Encoding is byte-identical to ``bytes(msg)``. Decoding follows prost, the reference's
decoder (see :mod:`._protobuf` for the shared rules), including how repeated occurrences
combine: a repeated field concatenates, a singular message field (``step.action``,
``reset.options``) merges, the ``kind`` oneof keeps its last arm and merges repeats of
the same arm (``step{[1], leaf} step{[3], leaf}`` is one step of lanes [1, 3] with two
leaves). Unknown fields, groups included, are skipped.

Bounded work: with ``max_lanes`` given, a repeated list the session reads positionally
(``env_indices``, ``seeds``, ``episode_ids``) keeps at most ``max_lanes + 1`` items and
remembers its full length (:class:`Clipped`): no valid request has more, and every check
the session makes on a longer list is decided by its length or by its first
``max_lanes + 1`` items. Packed lists are counted and validated with numpy, without
materialising them.

The field tables below (:data:`REQUEST_FIELDS`, :data:`RESPONSE_FIELDS`) are checked
against the generated classes by the tests, so a field added to ``proto/`` cannot be
dropped here silently.
"""

from __future__ import annotations

import operator
import struct
from typing import Any

import numpy as np

from .._errors import DecodeError, MessageTooLarge
from .._proto.rlmesh.env import v1 as env_v1
from .._proto.rlmesh.spaces import v1 as spaces_v1
from ._protobuf import (
    OPAQUE,
    decode_message,
    encode_varint,
    expect_wire,
    iter_fields,
    len_prefixed,
    read_varint,
    signed64,
    text,
)

__all__ = [
    "REQUEST_FIELDS",
    "RESPONSE_FIELDS",
    "Clipped",
    "decode_join_request",
    "encode_join_response",
]

_pack_double = struct.Struct("<d").pack

REQUEST_FIELDS: dict[type[Any], dict[int, str]] = {
    env_v1.JoinRequest: {
        1: "reset",
        2: "step",
        3: "render",
        4: "close",
        5: "request_id",
        6: "configure",
    },
    env_v1.ResetRequest: {
        1: "seeds",
        2: "options",
        3: "timeout_ms",
        4: "env_indices",
        5: "episode_ids",
    },
    env_v1.StepRequest: {1: "action", 2: "timeout_ms", 3: "env_indices", 4: "episode_ids"},
    env_v1.RenderRequest: {1: "env_indices", 2: "timeout_ms"},
    spaces_v1.SpaceValue: {1: "leaves"},
}
"""Every field the hand-written decoder reads, per message (CloseEnvsRequest,
ConfigureEnvRequest and MetaMap go through the schema-driven decoder)."""

RESPONSE_FIELDS: dict[type[Any], dict[int, str]] = {
    env_v1.JoinResponse: {
        1: "reset",
        2: "step",
        3: "render",
        4: "close",
        5: "request_id",
        6: "endpoint_total_ns",
        7: "configure",
        10: "error",
        11: "decode_ns",
        12: "user_ns",
        13: "encode_ns",
        14: "lane_skew_ns",
        15: "queue_ns",
    },
    env_v1.ResetResponse: {1: "observation", 2: "infos"},
    env_v1.StepResponse: {
        1: "observation",
        2: "rewards",
        3: "terminated_mask",
        4: "truncated_mask",
        5: "infos",
        6: "completed_episodes",
        7: "env_indices",
    },
    env_v1.RenderResponse: {1: "frame", 2: "format"},
    env_v1.CloseEnvsResponse: {1: "final_episodes"},
    env_v1.ConfigureEnvResponse: {},
    env_v1.EnvError: {
        1: "code",
        2: "message",
        3: "is_recoverable",
        4: "debug_info",
        5: "interrupted_episodes",
    },
    env_v1.EpisodeMetadata: {
        1: "episode_id",
        2: "seed",
        3: "env_index",
        4: "step_count",
        5: "cumulative_reward",
        6: "terminated",
        7: "truncated",
        8: "start_timestamp_ns",
        9: "end_timestamp_ns",
        10: "final_info",
    },
    spaces_v1.SpaceValue: {1: "leaves"},
    spaces_v1.MetaMap: {1: "entries"},
    spaces_v1.MetaValue: {
        1: "integer",
        2: "number",
        3: "text",
        4: "bool",
        5: "bytes",
        6: "list",
        7: "map",
    },
    spaces_v1.MetaList: {1: "items"},
}
"""Every field the hand-written encoder writes, per message."""


# MetaValue has a member 8 in the reference's schema, absent from SPEC.md and proto/ (the
# differential fuzz test found it): a message, so its wire form is checked.
OPAQUE[spaces_v1.MetaValue] = frozenset({8})

# --------------------------------------------------------------------------- encoding


def _meta_value(value: spaces_v1.MetaValue) -> bytes:
    if value.integer is not None:
        return b"\x08" + encode_varint(value.integer)
    if value.number is not None:
        return b"\x11" + _pack_double(value.number)
    if value.text is not None:
        return len_prefixed(b"\x1a", value.text.encode())
    if value.bool is not None:
        return b"\x20\x01" if value.bool else b"\x20\x00"
    if value.bytes is not None:
        return len_prefixed(b"\x2a", value.bytes)
    if value.list is not None:
        items = b"".join(len_prefixed(b"\x0a", _meta_value(v)) for v in value.list.items)
        return len_prefixed(b"\x32", items)
    if value.map is not None:
        return len_prefixed(b"\x3a", _meta_map(value.map))
    return b""


def _meta_map(meta: spaces_v1.MetaMap) -> bytes:
    parts = []
    for key, value in meta.entries.items():
        entry = len_prefixed(b"\x0a", key.encode())
        if value is not None:
            entry += len_prefixed(b"\x12", _meta_value(value))
        parts.append(len_prefixed(b"\x0a", entry))
    return b"".join(parts)


def encode_meta_map(meta: spaces_v1.MetaMap) -> bytes:
    """A MetaMap's protobuf bytes (what :func:`decode_message` reads back into an equal
    MetaMap): the compact form of an info map across a process lane's pipe."""
    return _meta_map(meta)


def _space_value(value: spaces_v1.SpaceValue) -> bytes:
    return b"".join(len_prefixed(b"\x0a", leaf) for leaf in value.leaves)


def _episode(ep: env_v1.EpisodeMetadata) -> bytes:
    out = bytearray()
    if ep.episode_id:
        out += len_prefixed(b"\x0a", ep.episode_id.encode())
    if ep.seed is not None:
        out += b"\x10" + encode_varint(ep.seed)
    if ep.env_index:
        out += b"\x18" + encode_varint(ep.env_index)
    if ep.step_count:
        out += b"\x20" + encode_varint(ep.step_count)
    if ep.cumulative_reward != 0.0:
        out += b"\x29" + _pack_double(ep.cumulative_reward)
    if ep.terminated:
        out += b"\x30\x01"
    if ep.truncated:
        out += b"\x38\x01"
    if ep.start_timestamp_ns:
        out += b"\x40" + encode_varint(ep.start_timestamp_ns)
    if ep.end_timestamp_ns:
        out += b"\x48" + encode_varint(ep.end_timestamp_ns)
    if ep.final_info is not None:
        out += len_prefixed(b"\x52", _meta_map(ep.final_info))
    return bytes(out)


def _episodes(tag: bytes, episodes: list[env_v1.EpisodeMetadata]) -> bytes:
    return b"".join(len_prefixed(tag, _episode(ep)) for ep in episodes)


def _packed_varints(tag: bytes, values: list[int]) -> bytes:
    return len_prefixed(tag, b"".join(encode_varint(v) for v in values))


def _error(error: env_v1.EnvError) -> bytes:
    out = bytearray()
    if error.code:
        out += b"\x08" + encode_varint(int(error.code))
    if error.message:
        out += len_prefixed(b"\x12", error.message.encode())
    if error.is_recoverable:
        out += b"\x18\x01"
    if error.debug_info:
        out += len_prefixed(b"\x22", error.debug_info.encode())
    if error.interrupted_episodes:
        out += _episodes(b"\x2a", error.interrupted_episodes)
    return bytes(out)


def _len_field(tag: bytes, parts: list[bytes], size: int) -> tuple[list[bytes], int]:
    """A length-delimited field over ``parts`` (``size`` bytes in all), still in parts."""
    head = tag + encode_varint(size)
    return [head, *parts], len(head) + size


def _space_value_parts(value: spaces_v1.SpaceValue) -> tuple[list[bytes], int]:
    parts: list[bytes] = []
    size = 0
    for leaf in value.leaves:
        head = b"\x0a" + encode_varint(len(leaf))
        parts += (head, leaf)
        size += len(head) + len(leaf)
    return parts, size


_F64 = struct.Struct("<d")


def _step_parts(step: env_v1.StepResponse) -> tuple[list[bytes], int]:
    """``_step``, with the observation's leaves kept as they are (not copied)."""
    parts: list[bytes] = []
    size = 0
    if step.observation is not None:
        parts, size = _len_field(b"\x0a", *_space_value_parts(step.observation))
    rest: list[bytes] = []
    rewards = step.rewards
    if rewards:
        if len(rewards) == 1:  # one lane's step: the common case
            rest.append(b"\x12\x08" + _F64.pack(rewards[0]))
        else:
            rest.append(len_prefixed(b"\x12", struct.pack(f"<{len(rewards)}d", *rewards)))
    if step.terminated_mask:
        rest.append(len_prefixed(b"\x1a", step.terminated_mask))
    if step.truncated_mask:
        rest.append(len_prefixed(b"\x22", step.truncated_mask))
    if step.infos is not None:
        rest.append(len_prefixed(b"\x2a", _meta_map(step.infos)))
    if step.completed_episodes:
        rest.append(_episodes(b"\x32", step.completed_episodes))
    indices = step.env_indices
    if indices:
        if len(indices) == 1:
            rest.append(len_prefixed(b"\x3a", encode_varint(indices[0])))
        else:
            rest.append(_packed_varints(b"\x3a", indices))
    tail = b"".join(rest)
    parts.append(tail)
    return parts, size + len(tail)


def _reset_parts(reset: env_v1.ResetResponse) -> tuple[list[bytes], int]:
    parts: list[bytes] = []
    size = 0
    if reset.observation is not None:
        parts, size = _len_field(b"\x0a", *_space_value_parts(reset.observation))
    if reset.infos is not None:
        infos = len_prefixed(b"\x12", _meta_map(reset.infos))
        parts.append(infos)
        size += len(infos)
    return parts, size


def _render_parts(render: env_v1.RenderResponse) -> tuple[list[bytes], int]:
    parts: list[bytes] = []
    size = 0
    if render.frame is not None:
        parts, size = _len_field(b"\x0a", [render.frame], len(render.frame))
    if render.format:
        fmt = b"\x10" + encode_varint(int(render.format))
        parts.append(fmt)
        size += len(fmt)
    return parts, size


_timings = operator.attrgetter(
    "endpoint_total_ns", "decode_ns", "user_ns", "encode_ns", "lane_skew_ns", "queue_ns"
)
_TIMING_TAGS = (b"\x30", b"\x58", b"\x60", b"\x68", b"\x70", b"\x78")
"""The timing fields (SPEC §8) in field order, read in one call, and their keys."""


def _response_parts(response: env_v1.JoinResponse) -> tuple[list[bytes], int]:
    """The encoded JoinResponse as pieces to join once (big leaves are never copied
    before the final join: a 400 KB observation would otherwise be copied at every
    nesting level, each copy a fresh page-faulting allocation)."""
    head: list[bytes] = []
    if response.request_id:
        head.append(len_prefixed(b"\x2a", response.request_id.encode()))
    for tag, value in zip(_TIMING_TAGS, _timings(response), strict=True):
        if value is not None:
            head += (tag, encode_varint(value))
    body: tuple[list[bytes], int] | None = None
    if response.reset is not None:
        body = _len_field(b"\x0a", *_reset_parts(response.reset))
    elif response.step is not None:
        body = _len_field(b"\x12", *_step_parts(response.step))
    elif response.render is not None:
        body = _len_field(b"\x1a", *_render_parts(response.render))
    elif response.close is not None:
        head.append(len_prefixed(b"\x22", _episodes(b"\x0a", response.close.final_episodes)))
    elif response.configure is not None:
        head.append(b"\x3a\x00")
    elif response.error is not None:
        head.append(len_prefixed(b"\x52", _error(response.error)))
    first = b"".join(head)
    if body is None:
        return [first], len(first)
    return [first, *body[0]], len(first) + body[1]


def encode_join_response(response: env_v1.JoinResponse) -> bytes:
    """``bytes(response)``, byte for byte, without betterproto2's per-field overhead."""
    parts, _ = _response_parts(response)
    return b"".join(parts)


def encode_join_response_framed(response: env_v1.JoinResponse, limit: int) -> bytes:
    """The gRPC message of ``response``: the 5-byte prefix and
    :func:`encode_join_response`'s bytes, built with one copy of each leaf.

    Raises :class:`~rlmesh_trio._errors.MessageTooLarge` ("encoded ...") past ``limit``,
    before anything is joined.
    """
    parts, size = _response_parts(response)
    if size > limit:
        raise MessageTooLarge(size, limit, direction="encoded")
    return b"".join([b"\x00" + size.to_bytes(4, "big"), *parts])


# --------------------------------------------------------------------------- decoding


class Clipped(list):  # type: ignore[type-arg]
    """The first items of a longer repeated field; ``len()`` is the field's full length.

    Iterating (or ``list()``) gives the kept items only. Produced by the decoder when a
    list is longer than any valid request's (see the module docstring).
    """

    __slots__ = ("total",)

    def __init__(self, items: list[Any], total: int) -> None:
        super().__init__(items)
        self.total = total

    def __len__(self) -> int:
        return self.total


def _packed_count(data: Any, start: int, stop: int) -> int:
    """How many varints ``data[start:stop]`` holds; raise DecodeError if it is malformed.

    Vectorised: a varint ends at each byte below 0x80; no run of continuation bytes may
    be longer than 9, a 10-byte varint's last byte must be 0 or 1, the last byte must end
    a varint.
    """
    if start == stop:
        return 0
    raw = np.frombuffer(data, dtype=np.uint8, count=stop - start, offset=start)
    ends = np.flatnonzero(raw < 0x80)
    if len(ends) == 0 or ends[-1] != len(raw) - 1:
        raise DecodeError("invalid varint")
    runs = np.diff(ends, prepend=-1) - 1  # continuation bytes before each end
    longest = int(runs.max())
    if longest > 9 or (longest == 9 and bool((raw[ends[runs == 9]] > 1).any())):
        raise DecodeError("invalid varint")
    return len(ends)


class _List:
    """One repeated scalar field being read: its first ``cap`` items and its length."""

    __slots__ = ("cap", "items", "total")

    def __init__(self, cap: int | None) -> None:
        self.items: list[Any] = []
        self.total = 0
        self.cap = cap

    def full(self) -> bool:
        return self.cap is not None and self.total >= self.cap

    def add(self, item: Any) -> None:
        if not self.full():
            self.items.append(item)
        self.total += 1

    def add_packed(self, data: Any, start: int, stop: int, mask: int) -> None:
        """A packed run of varints, masked to ``mask`` (uint32) or read as int64 (0)."""
        pos = start
        while pos < stop and not self.full():
            item, pos = read_varint(data, pos, stop)
            self.add(item & mask if mask else signed64(item))
        if pos < stop:  # past the cap: count (and check) the rest without keeping it
            self.total += _packed_count(data, pos, stop)

    def result(self) -> list[Any]:
        if self.total > len(self.items):
            return Clipped(self.items, self.total)
        return self.items


_U32 = 0xFFFFFFFF


def _varints(field: _List, wire: int, value: int, data: Any, s: int, e: int, mask: int) -> None:
    if wire == 0:
        field.add(value & mask if mask else signed64(value))
    else:
        expect_wire(wire, 2)
        field.add_packed(data, s, e, mask)


def _strings(field: _List, wire: int, data: Any, s: int, e: int) -> None:
    expect_wire(wire, 2)
    if field.full():
        text(data, s, e)  # still checked: invalid UTF-8 fails the whole message
        field.total += 1
    else:
        field.add(text(data, s, e))


def _merged(data: Any, slices: list[tuple[int, int]]) -> tuple[Any, int, int]:
    """One occurrence: decode it in place; several: decode their concatenation."""
    if len(slices) == 1:
        s, e = slices[0]
        return data, s, e
    joined = b"".join(_bytes(data, s, e) for s, e in slices)
    return joined, 0, len(joined)


def _bytes(data: Any, start: int, stop: int) -> bytes:
    """A bytes field's payload: a copy out of a small message, a read-only view into a
    big one's buffer (a bytearray: see the transport's ``read_message``), so that a
    near-limit action costs one copy of its bytes, not two. The codec reads leaves
    through the buffer protocol only."""
    if type(data) is bytes:
        return data[start:stop]
    view: Any = memoryview(data).toreadonly()[start:stop]
    return view  # type: ignore[no-any-return]


def _space_value_of(data: Any, slices: list[tuple[int, int]]) -> spaces_v1.SpaceValue:
    """``action`` given once or several times: the occurrences merge (leaves concatenate)."""
    leaves = []
    for start, stop in slices:
        for number, wire, _v, s, e in iter_fields(data, start, stop):
            if number == 1:
                expect_wire(wire, 2)
                leaves.append(_bytes(data, s, e))
    return spaces_v1.SpaceValue(leaves=leaves)


def _decode_step(data: Any, start: int, end: int, cap: int | None) -> env_v1.StepRequest:
    actions: list[tuple[int, int]] = []
    timeout = 0
    indices = _List(cap)
    ids = _List(cap)
    for number, wire, value, s, e in iter_fields(data, start, end):
        if number == 1:
            expect_wire(wire, 2)
            actions.append((s, e))
        elif number == 2:
            expect_wire(wire, 0)
            timeout = value
        elif number == 3:
            _varints(indices, wire, value, data, s, e, _U32)
        elif number == 4:
            _strings(ids, wire, data, s, e)
    return env_v1.StepRequest(
        action=_space_value_of(data, actions) if actions else None,
        timeout_ms=timeout,
        env_indices=indices.result(),
        episode_ids=ids.result(),
    )


def _decode_reset(data: Any, start: int, end: int, cap: int | None) -> env_v1.ResetRequest:
    seeds = _List(cap)
    options: list[tuple[int, int]] = []
    timeout = 0
    indices = _List(cap)
    ids = _List(cap)
    for number, wire, value, s, e in iter_fields(data, start, end):
        if number == 1:
            _varints(seeds, wire, value, data, s, e, 0)
        elif number == 2:
            expect_wire(wire, 2)
            options.append((s, e))
        elif number == 3:
            expect_wire(wire, 0)
            timeout = value
        elif number == 4:
            _varints(indices, wire, value, data, s, e, _U32)
        elif number == 5:
            _strings(ids, wire, data, s, e)
    meta = None
    if options:
        d, s, e = _merged(data, options)
        meta = decode_message(spaces_v1.MetaMap, d[s:e])
    return env_v1.ResetRequest(
        seeds=seeds.result(),
        options=meta,
        timeout_ms=timeout,
        env_indices=indices.result(),
        episode_ids=ids.result(),
    )


def _decode_render(data: Any, start: int, end: int, cap: int | None) -> env_v1.RenderRequest:
    indices = _List(cap)
    timeout = 0
    for number, wire, value, s, e in iter_fields(data, start, end):
        if number == 1:
            _varints(indices, wire, value, data, s, e, _U32)
        elif number == 2:
            expect_wire(wire, 0)
            timeout = value
    return env_v1.RenderRequest(env_indices=indices.result(), timeout_ms=timeout)


def _decode_close(data: Any, start: int, end: int, cap: int | None) -> Any:
    return decode_message(env_v1.CloseEnvsRequest, data[start:end])


def _decode_configure(data: Any, start: int, end: int, cap: int | None) -> Any:
    return decode_message(env_v1.ConfigureEnvRequest, data[start:end])


_ARMS: dict[int, tuple[str, Any]] = {
    1: ("reset", _decode_reset),
    2: ("step", _decode_step),
    3: ("render", _decode_render),
    4: ("close", _decode_close),
    6: ("configure", _decode_configure),
}


def _length(data: Any, pos: int, end: int) -> tuple[int, int]:
    """A length-delimited field's payload ``(start, stop)`` after its key at ``pos - 1``;
    raises (DecodeError, IndexError) past ``end``: the caller then takes the general
    decoder, which gives the error its words."""
    length = data[pos]
    if length < 0x80:
        pos += 1
    else:
        length, pos = read_varint(data, pos, end)
    stop = pos + length
    if stop > end:
        raise DecodeError("buffer underflow")
    return pos, stop


def _plain_step(data: Any) -> env_v1.JoinRequest | None:
    """The everyday request -- a plain step, as rlmesh's and our clients send it --
    decoded in one pass without the general reader's generators and lists; None for
    anything else (the general decoder then decides, errors included).

    Taken: a JoinRequest of a ``step`` and at most one ``request_id``, each once; the step
    of an ``action`` (its ``leaves`` only), at most one ``timeout_ms``, at most one lane in
    ``env_indices`` (packed or not; none: a whole-vector step, rlmesh.run's at N = 1) and
    at most one ``episode_ids``, each field once. With
    every field present at most once, order does not change what prost decodes, so the
    result is the general decoder's (a test compares the two on random requests).
    """
    try:
        end = len(data)
        step: tuple[int, int] | None = None
        rid: tuple[int, int] | None = None
        pos = 0
        while pos < end:
            key = data[pos]
            if key == 0x12 and step is None:
                step = _length(data, pos + 1, end)
                pos = step[1]
            elif key == 0x2A and rid is None:
                rid = _length(data, pos + 1, end)
                pos = rid[1]
            else:
                return None
        if step is None:
            return None
        action: tuple[int, int] | None = None
        timeout: int | None = None
        lane: int | None = None
        episode: tuple[int, int] | None = None
        pos, stop = step
        while pos < stop:
            key = data[pos]
            if key == 0x0A and action is None:
                action = _length(data, pos + 1, stop)
                pos = action[1]
            elif key == 0x10 and timeout is None:
                timeout, pos = read_varint(data, pos + 1, stop)
            elif key == 0x1A and lane is None:
                s, pos = _length(data, pos + 1, stop)
                lane, after = read_varint(data, s, pos)
                if after != pos:
                    return None
                lane &= _U32
            elif key == 0x18 and lane is None:
                lane, pos = read_varint(data, pos + 1, stop)
                lane &= _U32
            elif key == 0x22 and episode is None:
                episode = _length(data, pos + 1, stop)
                pos = episode[1]
            else:
                return None
        if action is None:
            return None
        leaves = []
        pos, stop = action
        while pos < stop:
            if data[pos] != 0x0A:
                return None
            s, pos = _length(data, pos + 1, stop)
            leaves.append(_bytes(data, s, pos))
        return env_v1.JoinRequest(
            request_id=text(data, *rid) if rid is not None else "",
            step=env_v1.StepRequest(
                action=spaces_v1.SpaceValue(leaves=leaves),
                timeout_ms=timeout or 0,
                env_indices=[lane] if lane is not None else [],
                episode_ids=[text(data, *episode)] if episode is not None else [],
            ),
        )
    except (DecodeError, IndexError):
        return None


def decode_join_request(
    data: bytes | bytearray, *, max_lanes: int | None = None
) -> env_v1.JoinRequest:
    """Parse a JoinRequest as prost does; raise :class:`DecodeError` on malformed bytes.

    ``max_lanes`` (the endpoint's ``num_envs``) bounds the positional lists kept (see the
    module docstring); None keeps everything.
    """
    fast = _plain_step(data)
    if fast is not None:
        return fast
    cap = None if max_lanes is None else max_lanes + 1
    request_id = ""
    arm = 0
    slices: list[tuple[int, int]] = []
    for number, wire, _value, s, e in iter_fields(data, 0, len(data)):
        if number == 5:
            expect_wire(wire, 2)
            request_id = text(data, s, e)
        elif number in _ARMS:
            expect_wire(wire, 2)
            if number != arm:
                if arm:  # replaced by another arm: still decoded (and so checked), as prost does
                    _, replaced = _ARMS[arm]
                    replaced(*_merged(data, slices), cap)
                arm, slices = number, []
            slices.append((s, e))
    if not arm:
        return env_v1.JoinRequest(request_id=request_id)
    name, decode = _ARMS[arm]
    d, s, e = _merged(data, slices)
    return env_v1.JoinRequest(request_id=request_id, **{name: decode(d, s, e, cap)})
