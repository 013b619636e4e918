"""Read the rlmesh 0.1.0 golden captures under ``tests/goldens`` (format: goldens/README.md).

Small helpers for any test that wants reference bytes or the reference client's view::

    from goldens_util import find_message, message_records, parse_record

    rec = find_message("mixed_codec", request_id="reset-seed-3-with-options", direction="s2c")
    response = parse_record(rec)  # -> env_v1.JoinResponse, class chosen from msg_type

Only the copies under ``tests/goldens`` are read, never ``/work/shared``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import betterproto2

from rlmesh_trio._proto.rlmesh.core import v1 as core_v1
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1

GOLDENS_DIR = Path(__file__).resolve().parent / "goldens"
DRIVER_DIR = GOLDENS_DIR / "driver"

Record = dict[str, Any]

_PACKAGES = {"env": env_v1, "core": core_v1, "spaces": spaces_v1}


def scenarios() -> list[str]:
    """Stems of every ``*.jsonl`` capture, sorted."""
    return sorted(path.stem for path in GOLDENS_DIR.glob("*.jsonl"))


@cache
def _load(scenario: str) -> tuple[Record, ...]:
    path = GOLDENS_DIR / f"{scenario}.jsonl"
    with path.open(encoding="utf-8") as stream:
        return tuple(json.loads(line) for line in stream if line.strip())


def records(scenario: str) -> Iterator[Record]:
    """Every record of one scenario, in file order (do not mutate them: they are cached)."""
    return iter(_load(scenario))


def message_records(
    scenario: str, *, msg_type: str | None = None, direction: str | None = None
) -> Iterator[Record]:
    """The ``kind == "message"`` records, optionally filtered by ``msg_type`` / ``dir``."""
    for record in _load(scenario):
        if record.get("kind") != "message":
            continue
        if msg_type is not None and record.get("msg_type") != msg_type:
            continue
        if direction is not None and record.get("dir") != direction:
            continue
        yield record


def request_id_of(record: Record) -> str | None:
    """The ``request_id`` the capture decoder saw (Join messages), else None."""
    fields = record.get("fields")
    if not isinstance(fields, dict):
        return None
    value = fields.get("5:request_id")
    return value if isinstance(value, str) else None


def find_message(scenario: str, *, request_id: str, direction: str) -> Record:
    """The first Join message of ``scenario`` with this request_id in this direction."""
    for record in message_records(scenario, direction=direction):
        if request_id_of(record) == request_id:
            return record
    raise LookupError(f"{scenario}: no {direction} message with request_id {request_id!r}")


def message_class(msg_type: str) -> type[betterproto2.Message]:
    """``"env.JoinRequest"`` -> ``env_v1.JoinRequest`` (also ``core.*`` and ``spaces.*``)."""
    package, _, name = msg_type.partition(".")
    module = _PACKAGES.get(package)
    cls = getattr(module, name, None) if module is not None else None
    if not (isinstance(cls, type) and issubclass(cls, betterproto2.Message)):
        raise LookupError(f"no generated message class for msg_type {msg_type!r}")
    return cls


def payload(record: Record) -> bytes:
    """The full protobuf payload of a message record (not for ``hex_truncated`` ones)."""
    if "hex" not in record:
        raise ValueError(f"record seq {record.get('seq')} has no full payload (hex_truncated)")
    return bytes.fromhex(record["hex"])


def parse_record(
    record: Record, cls: type[betterproto2.Message] | None = None
) -> betterproto2.Message:
    """Parse a record's payload with ``cls``, by default the class named by ``msg_type``."""
    if cls is None:
        msg_type = record.get("msg_type")
        if not msg_type:
            raise LookupError(f"record seq {record.get('seq')} has no msg_type")
        cls = message_class(msg_type)
    return cls.parse(payload(record))


@cache
def driver(name: str) -> Any:
    """The decoded ``driver/<name>.driver.json`` (the client's view of a scenario)."""
    with (DRIVER_DIR / f"{name}.driver.json").open(encoding="utf-8") as stream:
        return json.load(stream)


# --------------------------------------------------------------------------- wire helpers


def wire_fields(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """Split one message level strictly into ``(number, wire_type, value)``.

    Unlike betterproto2's lenient parser this rejects truncated varints, truncated
    length-delimited fields, group wire types and field number 0 with ``ValueError``.
    """
    fields: list[tuple[int, int, int | bytes]] = []
    pos = 0
    end = len(data)

    def varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            if pos >= end:
                raise ValueError("truncated varint")
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7
            if shift >= 70:
                raise ValueError("varint too long")

    while pos < end:
        key = varint()
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        value: int | bytes
        if wire_type == 0:
            value = varint()
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            if pos + size > end:
                raise ValueError("truncated fixed-width field")
            value, pos = data[pos : pos + size], pos + size
        elif wire_type == 2:
            size = varint()
            if pos + size > end:
                raise ValueError("truncated length-delimited field")
            value, pos = data[pos : pos + size], pos + size
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        fields.append((number, wire_type, value))
    return fields


def fill_missing_map_values(message: betterproto2.Message) -> betterproto2.Message:
    """Replace ``None`` map values of message type by empty messages, in place, deeply.

    prost (the reference) omits a map entry's value when it is an empty message (a
    MetaValue meaning Python ``None``); betterproto2 parses such an entry as ``None``
    and then cannot serialise it ("cannot convert 'NoneType' object to bytes"). The
    filled message is the same protobuf value. Returns ``message``.
    """
    meta = type(message)._betterproto
    for name, field_meta in meta.meta_by_field_name.items():
        value = getattr(message, name)
        if value is None:
            continue
        if field_meta.proto_type == betterproto2.TYPE_MAP:
            assert field_meta.map_meta is not None
            if field_meta.map_meta[1].proto_type == betterproto2.TYPE_MESSAGE:
                value_cls = meta.cls_by_field[f"{name}.value"]
                for key, item in list(value.items()):
                    if item is None:
                        value[key] = value_cls()
                    else:
                        fill_missing_map_values(item)
        elif field_meta.proto_type == betterproto2.TYPE_MESSAGE:
            for item in value if field_meta.repeated else (value,):
                fill_missing_map_values(item)
    return message


def assert_matches_fields(
    message: betterproto2.Message, fields: dict[str, Any], where: str = ""
) -> None:
    """Check a parsed message against the capture decoder's ``fields`` view, deeply.

    Every ``"<number>:<name>"`` key must name our field of that number with the same
    name and an equal value (bytes as hex, enums by their proto name, maps as objects,
    an empty map value ``{}`` also matching an omitted one); every field we see set
    must be in ``fields``; ``"?<n>"`` keys require unknown fields on our side.
    """
    meta = type(message)._betterproto
    seen: set[str] = set()
    for key, expected in fields.items():
        if key == "_packed":
            continue
        if key.startswith("?"):
            assert message._unknown_fields, f"{where}: capture has unknown field {key}"
            continue
        number_text, _, name = key.partition(":")
        ours = meta.field_name_by_number.get(int(number_text))
        assert ours == name, f"{where}: field {number_text} is {ours!r} here, {name!r} in capture"
        seen.add(name)
        _match_value(message, name, getattr(message, name), expected, f"{where}.{name}")
    for name in meta.meta_by_field_name:
        if name in seen:
            continue
        value = getattr(message, name)
        default = meta.default_gen[name]()
        assert value is None or value == default, (
            f"{where}.{name}: set here ({value!r}), absent in capture"
        )


def _match_value(
    owner: betterproto2.Message, name: str, actual: Any, expected: Any, where: str
) -> None:
    meta = type(owner)._betterproto
    field_meta = meta.meta_by_field_name[name]
    proto_type = field_meta.proto_type
    if proto_type == betterproto2.TYPE_MAP:
        assert field_meta.map_meta is not None
        assert isinstance(expected, dict), where
        assert set(actual) == set(expected), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        value_type = field_meta.map_meta[1].proto_type
        for key, item in expected.items():
            got = actual[key]
            if value_type == betterproto2.TYPE_MESSAGE:
                if got is None:
                    assert item == {}, f"{where}[{key!r}]: omitted here, {item!r} in capture"
                else:
                    assert_matches_fields(got, item, f"{where}[{key!r}]")
            else:
                _match_scalar(field_meta.map_meta[1].proto_type, got, item, f"{where}[{key!r}]")
        return
    if field_meta.repeated:
        assert isinstance(expected, list), where
        assert len(actual) == len(expected), f"{where}: {len(actual)} items != {len(expected)}"
        for index, (got, item) in enumerate(zip(actual, expected, strict=True)):
            if proto_type == betterproto2.TYPE_MESSAGE:
                assert_matches_fields(got, item, f"{where}[{index}]")
            else:
                _match_scalar(proto_type, got, item, f"{where}[{index}]")
        return
    if proto_type == betterproto2.TYPE_MESSAGE:
        assert actual is not None, f"{where}: unset here, {expected!r} in capture"
        assert_matches_fields(actual, expected, where)
        return
    _match_scalar(proto_type, actual, expected, where)


def _match_scalar(proto_type: str, actual: Any, expected: Any, where: str) -> None:
    if proto_type == betterproto2.TYPE_BYTES:
        assert actual.hex() == expected, f"{where}: {actual.hex()} != {expected}"
    elif proto_type == betterproto2.TYPE_ENUM:
        assert actual.proto_name == expected, f"{where}: {actual.proto_name} != {expected}"
    elif proto_type in (betterproto2.TYPE_DOUBLE, betterproto2.TYPE_FLOAT):
        assert actual == expected or (math.isnan(actual) and math.isnan(expected)), (
            f"{where}: {actual!r} != {expected!r}"
        )
    else:
        if proto_type in _INT_BITS and isinstance(expected, int):
            # The capture decoder shows the raw varint (a uint32 sent as the 10-byte
            # varint of -1 reads 2**64 - 1); the field's type keeps the low bits.
            bits, signed = _INT_BITS[proto_type]
            expected &= (1 << bits) - 1
            if signed and expected >= 1 << (bits - 1):
                expected -= 1 << bits
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


_INT_BITS = {
    betterproto2.TYPE_INT32: (32, True),
    betterproto2.TYPE_INT64: (64, True),
    betterproto2.TYPE_UINT32: (32, False),
    betterproto2.TYPE_UINT64: (64, False),
}
