"""One protobuf field reader and writer, with prost's rules and wording.

The reference decodes with Rust's prost; the error texts below are prost's
(``failed to decode Protobuf message: ...``, SPEC §1.10), and so are the rules:

* a key is a varint of at most 32 bits (``invalid key value``), its field number is at
  least 1 (``invalid tag value: 0``) and its wire type one of 0-5
  (``invalid wire type value: 6``);
* unknown fields are skipped, groups (wire types 3/4) included, nested at most
  :data:`RECURSION_LIMIT` deep;
* a length past the end is ``buffer underflow``; a varint longer than 10 bytes, or whose
  10th byte is above 1, is ``invalid varint``;
* a known field with another wire type is ``invalid wire type: X (expected Y)``, except
  that repeated scalars accept both the packed and the unpacked form;
* strings must be UTF-8.

:func:`decode_message` is a strict, schema-driven decoder for any generated betterproto2
message (used for the rare unary requests); the per-step JoinRequest has a hand-written
decoder in :mod:`._join` built on the same reader.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import betterproto2

from .._errors import DecodeError

__all__ = [
    "RECURSION_LIMIT",
    "DecodeError",
    "decode_message",
    "encode_varint",
    "iter_fields",
    "len_prefixed",
    "read_varint",
    "skip_field",
    "text",
]

RECURSION_LIMIT = 100
"""prost's default nesting limit for messages and groups."""

_MAX_KEY = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
WIRE_NAMES = {
    0: "Varint",
    1: "SixtyFourBit",
    2: "LengthDelimited",
    3: "StartGroup",
    4: "EndGroup",
    5: "ThirtyTwoBit",
}

# --------------------------------------------------------------------------- writing

_SMALL = [bytes((i,)) for i in range(128)]


def encode_varint(value: int) -> bytes:
    """Base-128 varint of ``value`` (negative ints as their 64-bit two's complement)."""
    value &= _MASK64
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def len_prefixed(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field: ``tag``, the varint length of ``body``, ``body``."""
    n = len(body)
    return tag + (_SMALL[n] if n < 128 else encode_varint(n)) + body


# --------------------------------------------------------------------------- reading


def read_varint(data: bytes | bytearray, pos: int, end: int) -> tuple[int, int]:
    """Decode one varint at ``pos``; return ``(value, position after it)``."""
    if pos < end:
        byte = data[pos]
        if byte < 0x80:
            return byte, pos + 1
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise DecodeError("invalid varint")
        byte = data[pos]
        pos += 1
        if shift == 63 and byte > 1:
            raise DecodeError("invalid varint")
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise DecodeError("invalid varint")


def read_key(data: bytes | bytearray, pos: int, end: int) -> tuple[int, int, int]:
    """Decode a field key; return ``(field number, wire type, position after it)``."""
    key, pos = read_varint(data, pos, end)
    if key > _MAX_KEY:
        raise DecodeError(f"invalid key value: {key}")
    wire = key & 7
    if wire > 5:
        raise DecodeError(f"invalid wire type value: {wire}")
    number = key >> 3
    if number == 0:
        raise DecodeError("invalid tag value: 0")
    return number, wire, pos


def skip_field(
    data: bytes | bytearray, pos: int, end: int, wire: int, number: int, depth: int = 0
) -> int:
    """Skip one field's value (an unknown field); return the position after it."""
    if depth >= RECURSION_LIMIT:
        raise DecodeError("recursion limit reached")
    if wire == 0:
        return read_varint(data, pos, end)[1]
    if wire == 2:
        length, pos = read_varint(data, pos, end)
    elif wire == 1:
        length = 8
    elif wire == 5:
        length = 4
    elif wire == 3:
        while True:
            inner, inner_wire, pos = read_key(data, pos, end)
            if inner_wire == 4:
                if inner != number:
                    raise DecodeError("unexpected end group tag")
                return pos
            pos = skip_field(data, pos, end, inner_wire, inner, depth + 1)
    else:
        raise DecodeError("unexpected end group tag")
    if length > end - pos:
        raise DecodeError("buffer underflow")
    return pos + length


def iter_fields(
    data: bytes | bytearray,
    start: int,
    end: int,
    depth: int = 0,
    maps: frozenset[int] = frozenset(),
) -> Iterator[tuple[int, int, int, int, int]]:
    """Yield ``(number, wire, value, start, stop)`` for each field of ``data[start:end]``.

    ``value`` is the varint of a wire-type-0 field (else 0); ``start:stop`` is the payload
    of a length-delimited or fixed-size field. Groups are yielded with wire type 3 and
    their whole extent as the payload (callers treat them as unknown fields).

    ``maps`` are the numbers of map fields: prost's generated code reads a map entry as
    length-delimited whatever the key's wire type says, so these are always read so
    (and yielded with wire type 2).
    """
    pos = start
    number = 0
    try:
        while pos < end:
            key = data[pos]
            if key < 0x80:  # one-byte key: fields 1-15, the common case
                number, wire = key >> 3, key & 7
                if wire > 5:
                    raise DecodeError(f"invalid wire type value: {wire}")
                if number == 0:
                    raise DecodeError("invalid tag value: 0")
                pos += 1
            else:
                number, wire, pos = read_key(data, pos, end)
            if maps and number in maps:
                wire = 2
            if wire == 2:
                length = data[pos] if pos < end else 0x80
                if length < 0x80:
                    pos += 1
                else:
                    length, pos = _value_varint(data, pos, end, number)
                stop = pos + length
                if stop > end:
                    raise _field_error(DecodeError("buffer underflow"), number)
                yield number, 2, 0, pos, stop
                pos = stop
            elif wire == 0:
                value, pos = _value_varint(data, pos, end, number)
                yield number, 0, value, 0, 0
            elif wire == 1 or wire == 5:
                stop = pos + (8 if wire == 1 else 4)
                if stop > end:
                    raise _field_error(DecodeError("buffer underflow"), number)
                yield number, wire, 0, pos, stop
                pos = stop
            else:
                try:
                    stop = skip_field(data, pos, end, wire, number, depth)
                except DecodeError as exc:
                    raise _field_error(exc, number) from None
                yield number, wire, 0, pos, stop
                pos = stop
    except IndexError:  # pragma: no cover - every index above is checked against end
        raise DecodeError("buffer underflow") from None


def _value_varint(data: Any, pos: int, end: int, number: int) -> tuple[int, int]:
    try:
        return read_varint(data, pos, end)
    except DecodeError as exc:
        raise _field_error(exc, number) from None


def _field_error(exc: DecodeError, number: int) -> DecodeError:
    exc.field = number  # the value of this field was unreadable: see field_error()
    return exc


def field_error(exc: DecodeError, cls: type[Any], names: dict[int, str]) -> None:
    """Name the field whose value :func:`iter_fields` could not read, as prost does."""
    number = exc.field
    exc.field = None
    if number is not None and number in names:
        exc.stack.append((cls.__name__, names[number]))


def expect_wire(wire: int, wanted: int) -> None:
    """A known field must come with its own wire type."""
    if wire != wanted:
        raise DecodeError(f"invalid wire type: {WIRE_NAMES[wire]} (expected {WIRE_NAMES[wanted]})")


def text(data: bytes | bytearray, start: int, stop: int) -> str:
    """A string field's payload, which must be UTF-8."""
    try:
        return str(data[start:stop], "utf-8")
    except UnicodeDecodeError:
        raise DecodeError("invalid string value: data is not UTF-8 encoded") from None


def signed64(value: int) -> int:
    """A varint read as int64 (two's complement)."""
    return value - (1 << 64) if value >= (1 << 63) else value


# --------------------------------------------------------------------------- schema-driven


_FIXED32 = {
    betterproto2.TYPE_FLOAT: "<f",
    betterproto2.TYPE_FIXED32: "<I",
    betterproto2.TYPE_SFIXED32: "<i",
}
_FIXED64 = {
    betterproto2.TYPE_DOUBLE: "<d",
    betterproto2.TYPE_FIXED64: "<Q",
    betterproto2.TYPE_SFIXED64: "<q",
}
_LEN = frozenset({betterproto2.TYPE_STRING, betterproto2.TYPE_BYTES})
_NESTED = frozenset({betterproto2.TYPE_MESSAGE, betterproto2.TYPE_MAP})


@dataclass(frozen=True)
class _Field:
    name: str
    proto_type: str
    wire: int  # wire type of one element
    repeated: bool
    packable: bool  # a repeated scalar: the packed (length-delimited) form is accepted too
    message: type[betterproto2.Message] | None  # nested message
    map_meta: Any
    map_value: type[betterproto2.Message] | None  # a map's message-typed value class
    group: str | None  # the oneof this field belongs to


_SCHEMAS: dict[type[betterproto2.Message], dict[int, _Field]] = {}

OPAQUE: dict[type[betterproto2.Message], frozenset[int]] = {}
"""Field numbers the reference's schema has and ours does not, per message, known to be
message-typed: they must be length-delimited and hold a well-formed message (checked,
then skipped), as the reference's decoder requires."""


def schema(cls: type[betterproto2.Message]) -> dict[int, _Field]:
    """Field number -> field facts of a generated message class (cached)."""
    fields = _SCHEMAS.get(cls)
    if fields is None:
        meta = cast(Any, cls)._betterproto
        fields = {}
        for name, field in meta.meta_by_field_name.items():
            nested: type[betterproto2.Message] | None = None
            value_cls: type[betterproto2.Message] | None = None
            if field.proto_type in _NESTED:
                wire = 2
                if field.proto_type == betterproto2.TYPE_MESSAGE:
                    nested = field.unwrap() if field.unwrap else meta.cls_by_field[name]
                elif field.map_meta[1].proto_type == betterproto2.TYPE_MESSAGE:
                    value_cls = meta.cls_by_field[f"{name}.value"]
            elif field.proto_type in _LEN:
                wire = 2
            elif field.proto_type in _FIXED32:
                wire = 5
            elif field.proto_type in _FIXED64:
                wire = 1
            else:
                wire = 0
            repeated = bool(field.repeated)
            fields[field.number] = _Field(
                name,
                field.proto_type,
                wire,
                repeated,
                repeated and wire != 2,
                nested,
                field.map_meta,
                value_cls,
                field.group,
            )
        _SCHEMAS[cls] = fields
    return fields


def _scalar(proto_type: str, wire: int, value: int, data: Any, start: int, stop: int) -> Any:
    if wire == 0:
        if proto_type == betterproto2.TYPE_BOOL:
            return value != 0
        if proto_type in (betterproto2.TYPE_INT64,):
            return signed64(value)
        if proto_type in (betterproto2.TYPE_INT32, betterproto2.TYPE_ENUM):
            value &= 0xFFFFFFFF
            return value - (1 << 32) if value >= (1 << 31) else value
        if proto_type == betterproto2.TYPE_UINT32:
            return value & 0xFFFFFFFF
        if proto_type == betterproto2.TYPE_SINT32 or proto_type == betterproto2.TYPE_SINT64:
            return (value >> 1) ^ -(value & 1)
        return value
    if wire == 5:
        return struct.unpack_from(_FIXED32[proto_type], data, start)[0]
    if wire == 1:
        return struct.unpack_from(_FIXED64[proto_type], data, start)[0]
    if proto_type == betterproto2.TYPE_STRING:
        return text(data, start, stop)
    return bytes(data[start:stop])


def _map_entry(field: _Field, data: Any, start: int, stop: int, depth: int) -> tuple[Any, Any]:
    key_meta, value_meta = field.map_meta
    key: Any = _default(key_meta.proto_type)
    value: Any = None
    parts: list[tuple[int, int]] = []  # a message value given several times merges
    for number, wire, raw, s, e in iter_fields(data, start, stop, depth):
        meta = key_meta if number == 1 else value_meta if number == 2 else None
        if meta is None:
            continue
        if number == 2 and field.map_value is not None:
            expect_wire(wire, 2)
            parts.append((s, e))
            continue
        wanted = (
            2
            if meta.proto_type in _LEN
            else 5
            if meta.proto_type in _FIXED32
            else (1 if meta.proto_type in _FIXED64 else 0)
        )
        expect_wire(wire, wanted)
        parsed = _scalar(meta.proto_type, wire, raw, data, s, e)
        if number == 1:
            key = parsed
        else:
            value = parsed
    if field.map_value is not None:
        value = field.map_value(**_decode_parts(field.map_value, data, parts, depth + 1))
    elif value is None:
        value = _default(value_meta.proto_type)
    return key, value


def _decode_parts(
    cls: type[betterproto2.Message], data: Any, parts: list[tuple[int, int]], depth: int
) -> dict[str, Any]:
    """The occurrences of one message field, merged (decoded as their concatenation)."""
    if len(parts) == 1:
        return _decode(cls, data, parts[0][0], parts[0][1], depth)
    joined = b"".join(bytes(data[s:e]) for s, e in parts)
    return _decode(cls, joined, 0, len(joined), depth)


def _default(proto_type: str) -> Any:
    if proto_type == betterproto2.TYPE_STRING:
        return ""
    if proto_type == betterproto2.TYPE_BYTES:
        return b""
    if proto_type == betterproto2.TYPE_BOOL:
        return False
    if proto_type in _FIXED32 or proto_type in _FIXED64:
        return 0.0 if proto_type in (betterproto2.TYPE_FLOAT, betterproto2.TYPE_DOUBLE) else 0
    return 0


def _decode(
    cls: type[betterproto2.Message], data: Any, start: int, stop: int, depth: int
) -> dict[str, Any]:
    """The field values of one message, merged as protobuf specifies."""
    if depth > RECURSION_LIMIT:
        raise DecodeError("recursion limit reached")
    fields = schema(cls)
    values: dict[str, Any] = {}
    nested: dict[str, list[tuple[int, int]]] = {}  # message fields: the slices to merge
    try:
        _fields_into(cls, fields, values, nested, data, start, stop, depth)
    except DecodeError as exc:
        field_error(exc, cls, {n: f.name for n, f in fields.items()})
        raise
    for name, slices in nested.items():
        message = next(f.message for f in fields.values() if f.name == name)
        assert message is not None
        try:
            values[name] = message(**_decode_parts(message, data, slices, depth + 1))
        except DecodeError as exc:
            exc.stack.append((cls.__name__, name))
            raise
    return values


def _fields_into(
    cls: type[betterproto2.Message],
    fields: dict[int, _Field],
    values: dict[str, Any],
    nested: dict[str, list[tuple[int, int]]],
    data: Any,
    start: int,
    stop: int,
    depth: int,
) -> None:
    maps = _map_numbers(cls, fields)
    for number, wire, raw, s, e in iter_fields(data, start, stop, depth, maps):
        field = fields.get(number)
        if field is None:
            if number in OPAQUE.get(cls, ()):
                expect_wire(wire, 2)
                for _ in iter_fields(data, s, e, depth + 1):
                    pass
            continue
        if field.group is not None:  # a oneof keeps its last member (merging repeats)
            for other in fields.values():
                if other.group == field.group and other.name != field.name:
                    values.pop(other.name, None)
                    nested.pop(other.name, None)
        try:
            if field.message is not None:
                expect_wire(wire, 2)
                if field.repeated:
                    values.setdefault(field.name, []).append(
                        field.message(**_decode(field.message, data, s, e, depth + 1))
                    )
                else:
                    nested.setdefault(field.name, []).append((s, e))
            elif field.map_meta is not None:
                expect_wire(wire, 2)
                key, value = _map_entry(field, data, s, e, depth + 1)
                values.setdefault(field.name, {})[key] = value
            elif field.packable and wire == 2:
                items = values.setdefault(field.name, [])
                pos = s
                while pos < e:
                    if field.wire == 0:
                        item, pos = read_varint(data, pos, e)
                        items.append(_scalar(field.proto_type, 0, item, data, 0, 0))
                    else:
                        size = 4 if field.wire == 5 else 8
                        if size > e - pos:
                            raise DecodeError("buffer underflow")
                        items.append(
                            _scalar(field.proto_type, field.wire, 0, data, pos, pos + size)
                        )
                        pos += size
            else:
                expect_wire(wire, field.wire)
                value = _scalar(field.proto_type, wire, raw, data, s, e)
                if field.repeated:
                    values.setdefault(field.name, []).append(value)
                else:
                    values[field.name] = value
        except DecodeError as exc:
            exc.stack.append((cls.__name__, field.name))
            raise


_MAPS: dict[type[betterproto2.Message], frozenset[int]] = {}


def _map_numbers(cls: type[betterproto2.Message], fields: dict[int, _Field]) -> frozenset[int]:
    numbers = _MAPS.get(cls)
    if numbers is None:
        numbers = _MAPS[cls] = frozenset(n for n, f in fields.items() if f.map_meta is not None)
    return numbers


_M = TypeVar("_M", bound=betterproto2.Message)


def decode_message(cls: type[_M], data: bytes | bytearray) -> _M:
    """Decode ``data`` as ``cls`` strictly; raise :class:`DecodeError` for malformed input.

    One pass over the bytes; the result equals ``cls.parse(data)`` for well-formed input
    (occurrences of a singular message field merge, as protobuf specifies).
    """
    return cls(**_decode(cls, data, 0, len(data), 0))
