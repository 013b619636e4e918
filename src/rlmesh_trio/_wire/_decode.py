"""The JoinRequest decoder, by hand and strict, as prost (the reference's decoder) reads.

Why by hand: a JoinRequest crosses the transport thread on every step, and the transport
thread is the server's bottleneck; betterproto2 0.10's ``parse`` re-derives class
metadata and silently accepts truncated input. The message is still a betterproto2
object (the session reads it as usual); only its wire form is read here. The shape every
client sends for one lane's step takes a one-pass path (:func:`_plain_step`); anything
else, errors included, the general decoder.

Decoding follows prost (see :mod:`._protobuf` for the shared rules), including how
repeated occurrences combine: a repeated field concatenates, a singular message field
(``step.action``, ``reset.options``) merges, the ``kind`` oneof keeps its last arm and
merges repeats of the same arm (``step{[1], leaf} step{[3], leaf}`` is one step of lanes
[1, 3] with two leaves). Unknown fields, groups included, are skipped.

Bounded work: with ``num_envs`` given, a repeated list the session reads positionally
(``env_indices``, ``seeds``, ``episode_ids``) keeps at most ``num_envs + 1`` items and
remembers its full length (:class:`Clipped`): no valid request has more, and every check
the session makes on a longer list is decided by its length or by its first
``num_envs + 1`` items. Packed lists are counted and validated with numpy, without
materialising them.

The field table (:data:`REQUEST_FIELDS`) is checked against the generated classes by the
tests, so a field added to ``proto/`` cannot be dropped here silently.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import DecodeError
from .._proto.rlmesh.env import v1 as env_v1
from .._proto.rlmesh.spaces import v1 as spaces_v1
from ._protobuf import (
    OPAQUE,
    decode_message,
    expect_wire,
    iter_fields,
    read_varint,
    signed64,
    text,
)

__all__ = ["REQUEST_FIELDS", "Clipped", "decode_join_request"]

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

# MetaValue has a member 8 in the reference's schema, absent from SPEC.md and proto/ (the
# differential fuzz test found it): a message, so its wire form is checked.
OPAQUE[spaces_v1.MetaValue] = frozenset({8})


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
    data: bytes | bytearray, *, num_envs: int | None = None
) -> env_v1.JoinRequest:
    """Parse a JoinRequest as prost does; raise :class:`DecodeError` on malformed bytes.

    ``num_envs`` (how many lanes the endpoint serves) bounds the positional lists kept (see the
    module docstring); None keeps everything.
    """
    fast = _plain_step(data)
    if fast is not None:
        return fast
    cap = None if num_envs is None else num_envs + 1
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
