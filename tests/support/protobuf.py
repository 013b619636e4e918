"""Protobuf fields written by hand: varints, tags, length-delimited fields.

Independent of the generated classes and of the package's decoder, so a test can spell
exactly the bytes it means (fields in any order, repeated, unknown, unpacked, cut
short) and check what our decoder and the reference make of them.
"""

from __future__ import annotations

VARINT, I64, LEN, SGROUP, EGROUP, I32 = range(6)
"""The wire types (protobuf's encoding guide names them so)."""

U64 = (1 << 64) - 1


def varint(value: int) -> bytes:
    """``value`` as a base-128 varint; a negative one as its 10-byte two's complement
    (how an int64 or int32 field sends it)."""
    value &= U64
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    """A field's key: its number and wire type."""
    return varint(number << 3 | wire_type)


def length_prefix(number: int, length: int) -> bytes:
    """The key and length of a length-delimited field whose ``length`` bytes follow
    separately (or never: a prefix that lies)."""
    return tag(number, LEN) + varint(length)


def field(number: int, body: bytes) -> bytes:
    """A length-delimited field: a nested message, bytes, a string or a packed list."""
    return length_prefix(number, len(body)) + body


def scalar(number: int, value: int) -> bytes:
    """A varint field (an int, a bool, an enum)."""
    return tag(number, VARINT) + varint(value)
