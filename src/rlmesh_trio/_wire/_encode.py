"""The JoinResponse encoder, by hand, byte-identical to betterproto2's ``bytes(msg)``.

Why by hand: a JoinResponse crosses the transport thread on every step, and the transport
thread is the server's bottleneck. betterproto2 0.10 spends most of ``bytes(msg)`` in a
per-field ``warnings.catch_warnings()`` (which is also not thread-safe). The message stays
a betterproto2 object (the session builds it as usual); only its wire form is produced
here, as a list of parts joined once (a big observation is copied once).

The field table (:data:`RESPONSE_FIELDS`) is checked against the generated classes by
the tests, so a field added to ``proto/`` cannot be dropped here silently.
"""

from __future__ import annotations

import operator
import struct
from typing import Any

from .._errors import MessageTooLarge
from .._proto.rlmesh.env import v1 as env_v1
from .._proto.rlmesh.spaces import v1 as spaces_v1
from ._protobuf import encode_varint, len_prefixed

__all__ = [
    "RESPONSE_FIELDS",
    "encode_join_response",
    "encode_join_response_framed",
    "encode_meta_map",
]

_pack_double = struct.Struct("<d").pack

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
        return len_prefixed(b"\x32", _meta_items(value.list.items))
    if value.map is not None:
        return len_prefixed(b"\x3a", _meta_map(value.map))
    return b""


def _item(value: spaces_v1.MetaValue) -> bytes:
    """``value`` as one item of a MetaList (field 1, length-prefixed)."""
    return len_prefixed(b"\x0a", _meta_value(value))


def _meta_items(items: list[spaces_v1.MetaValue]) -> bytes:
    """A MetaList's items. The two kinds a batched reply's infos are made of -- a lane's
    map, most often empty, and a done flag -- are written without the general walk (a
    MetaValue is a oneof: one of its fields is set, so the order of the checks does not
    matter)."""
    parts = []
    for item in items:
        meta = item.map
        if meta is not None and not meta.entries:
            parts.append(_EMPTY_MAP_ITEM)
            continue
        flag = item.bool
        if flag is not None:
            parts.append(_BOOL_ITEMS[flag])
            continue
        parts.append(_item(item))
    return b"".join(parts)


def _meta_map(meta: spaces_v1.MetaMap) -> bytes:
    parts = []
    for key, value in meta.entries.items():
        entry = len_prefixed(b"\x0a", key.encode())
        if value is not None:
            entry += len_prefixed(b"\x12", _meta_value(value))
        parts.append(len_prefixed(b"\x0a", entry))
    return b"".join(parts)


_EMPTY_MAP_ITEM = _item(spaces_v1.MetaValue(map=spaces_v1.MetaMap()))
_BOOL_ITEMS = (_item(spaces_v1.MetaValue(bool=False)), _item(spaces_v1.MetaValue(bool=True)))
"""The items a batched reply's infos are made of, written once by the general walk."""


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
