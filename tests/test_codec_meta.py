"""The metadata codec: info dicts, reset options and env metadata <-> MetaValue/MetaMap.

SPEC §5.1 (Python -> wire, with the reference's refusals word for word), §5.2 (wire ->
Python), checked against the rlmesh 0.1.0 captures: the ``probe_spaces_text_info``
"one session per awkward info value" cases, the ``mixed_codec`` reset options and info
conversions, and every MetaMap captured anywhere.
"""

from __future__ import annotations

import ast
import collections
import decimal
import enum
import fractions
import math
import types
from collections.abc import Iterator
from typing import Any

import betterproto2
import gymnasium as gym
import numpy as np
import pytest
from goldens_util import (
    driver,
    fill_missing_map_values,
    find_message,
    message_records,
    parse_record,
    scenarios,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rlmesh_trio._codec import _meta, from_meta_map, from_meta_value, to_meta_map, to_meta_value
from rlmesh_trio._proto.rlmesh.core import v1 as core_v1
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1

MV = spaces_v1.MetaValue
ML = spaces_v1.MetaList
MM = spaces_v1.MetaMap

UNSUPPORTED = (
    "value of type '{}' is not supported in RLMesh metadata; pass the dict through "
    "rlmesh.sanitize_metadata(...) to stringify unsupported values"
)
OVERFLOW = (
    "metadata integer {} does not fit int64; RLMesh metadata integers must be in "
    "[-2**63, 2**63) -- store a larger value as a string instead"
)


def wire(value: MV) -> bytes:
    return bytes(value)


def through_wire(value: MV) -> MV:
    return MV.parse(bytes(value))


def same(a: object, b: object) -> bool:
    """Deep equality that tells bool from int, int from float, and NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))  # type: ignore[arg-type]
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)  # type: ignore[attr-defined,index]
    return a == b


class Color(enum.Enum):
    RED = 1


class Mode(enum.Enum):
    NEXT = "NextStep"


class Opaque(enum.Enum):
    THING = object()


class Huge(enum.Enum):
    BIG = 2**70


class Level(enum.IntEnum):
    HIGH = 3


class Perm(enum.Flag):
    R = 1
    W = 2


class Label(str, enum.Enum):  # noqa: UP042 - the str mixin (not StrEnum) is the case here
    A = "label-a"


class Sub(str):
    pass


class IntSub(int):
    pass


class FloatSub(float):
    pass


class BytesSub(bytes):
    pass


class ListSub(list):  # type: ignore[type-arg]
    pass


class Indexable:
    def __index__(self) -> int:
        return 4


class HugeIndexable:
    def __index__(self) -> int:
        return 2**70


class Floatable:
    def __float__(self) -> float:
        return 2.5


class BadFloat:
    def __float__(self) -> float:
        raise ValueError("no")


class WithValue:
    value = 5


class WithName:
    name = "nm"


class UnconvertibleValueWithName:
    value = object()
    name = "fallback"


class SelfValue:
    @property
    def value(self) -> object:
        return self


class ToList:
    def tolist(self) -> object:
        return {"x": (1, 2)}


class IntWithToList(int):
    def tolist(self) -> object:
        return "from tolist"


class Item:
    def item(self) -> object:
        return 9


class RaisingValue:
    @property
    def value(self) -> object:
        raise RuntimeError("value property broke")


Point = collections.namedtuple("Point", "x y")


# --------------------------------------------------------------------------- Python -> wire

SCALARS: list[tuple[str, object, MV, str]] = [
    # (id, python value, MetaValue, wire hex) -- oneof members are emitted at their default
    ("false", False, MV(bool=False), "2000"),
    ("true", True, MV(bool=True), "2001"),
    ("np_bool", np.bool_(False), MV(bool=False), "2000"),
    ("zero", 0, MV(integer=0), "0800"),
    ("int", 7, MV(integer=7), "0807"),
    ("int_neg", -1, MV(integer=-1), "08ffffffffffffffffff01"),
    ("int64_min", -(2**63), MV(integer=-(2**63)), "0880808080808080808001"),
    ("int64_max", 2**63 - 1, MV(integer=2**63 - 1), "08ffffffffffffffff7f"),
    ("np_int8", np.int8(-3), MV(integer=-3), "08fdffffffffffffffff01"),
    ("np_uint64_small", np.uint64(5), MV(integer=5), "0805"),
    ("np_int64_min", np.int64(-(2**63)), MV(integer=-(2**63)), "0880808080808080808001"),
    ("enum_int", Color.RED, MV(integer=1), "0801"),
    ("int_enum", Level.HIGH, MV(integer=3), "0803"),
    ("flag", Perm.R | Perm.W, MV(integer=3), "0803"),
    ("int_subclass", IntSub(6), MV(integer=6), "0806"),
    ("index", Indexable(), MV(integer=4), "0804"),
    ("float_zero", 0.0, MV(number=0.0), "110000000000000000"),
    ("float", 2.5, MV(number=2.5), "110000000000000440"),
    ("neg_zero", -0.0, MV(number=-0.0), "110000000000000080"),
    ("inf", math.inf, MV(number=math.inf), "11000000000000f07f"),
    ("np_f16", np.float16(0.5), MV(number=0.5), "11000000000000e03f"),
    ("np_f32", np.float32(1.25), MV(number=1.25), "11000000000000f43f"),
    ("np_f64", np.float64(-5.0), MV(number=-5.0), "1100000000000014c0"),
    ("float_subclass", FloatSub(1.5), MV(number=1.5), "11000000000000f83f"),
    ("decimal", decimal.Decimal("1.5"), MV(number=1.5), "11000000000000f83f"),
    ("fraction", fractions.Fraction(1, 2), MV(number=0.5), "11000000000000e03f"),
    ("dunder_float", Floatable(), MV(number=2.5), "110000000000000440"),
    ("huge_index", HugeIndexable(), MV(number=float(2**70)), "110000000000005044"),
    ("empty_text", "", MV(text=""), "1a00"),
    ("text", "ab", MV(text="ab"), "1a026162"),
    ("text_utf8", "é", MV(text="é"), "1a02c3a9"),
    ("str_subclass", Sub("sub"), MV(text="sub"), "1a03737562"),
    ("np_str", np.str_("npstr"), MV(text="npstr"), "1a056e70737472"),
    ("str_enum", Label.A, MV(text="label-a"), "1a076c6162656c2d61"),
    ("enum_str_value", Mode.NEXT, MV(text="NextStep"), "1a084e65787453746570"),
    (
        "gym_autoreset",
        gym.vector.AutoresetMode.NEXT_STEP,
        MV(text="NextStep"),
        "1a084e65787453746570",
    ),
    ("enum_name_fallback", Opaque.THING, MV(text="THING"), "1a055448494e47"),
    ("enum_overflow_name", Huge.BIG, MV(text="BIG"), "1a03424947"),
    ("value_attr", WithValue(), MV(integer=5), "0805"),
    ("name_attr", WithName(), MV(text="nm"), "1a026e6d"),
    ("value_then_name", UnconvertibleValueWithName(), MV(text="fallback"), "1a0866616c6c6261636b"),
    ("empty_bytes", b"", MV(bytes=b""), "2a00"),
    ("bytes", b"\x00\xff", MV(bytes=b"\x00\xff"), "2a0200ff"),
    ("bytes_subclass", BytesSub(b"q"), MV(bytes=b"q"), "2a0171"),
    ("np_bytes", np.bytes_(b"ab"), MV(bytes=b"ab"), "2a026162"),
    ("item", Item(), MV(integer=9), "0809"),
    ("int_tolist_first", IntWithToList(3), MV(text="from tolist"), "1a0b66726f6d20746f6c697374"),
    ("none", None, MV(), ""),
]


@pytest.mark.parametrize(
    ("value", "expected", "hex_"), [c[1:] for c in SCALARS], ids=[c[0] for c in SCALARS]
)
def test_scalar_conversion(value: object, expected: MV, hex_: str) -> None:
    converted = to_meta_value(value)
    assert converted == expected
    assert wire(converted).hex() == hex_
    assert through_wire(converted) == expected


def test_nan_is_kept() -> None:
    for value in (math.nan, np.float32("nan"), np.float16("nan")):
        converted = to_meta_value(value)
        assert converted.number is not None
        assert math.isnan(converted.number)
        assert wire(converted) == b"\x11" + np.float64("nan").tobytes()


def test_containers() -> None:
    assert to_meta_value([1, "two", 3.0]) == MV(
        list=ML(items=[MV(integer=1), MV(text="two"), MV(number=3.0)])
    )
    assert to_meta_value((1, 2)) == to_meta_value([1, 2])
    assert to_meta_value(ListSub([1])) == to_meta_value([1])
    assert wire(to_meta_value([])) == bytes.fromhex("3200")
    assert wire(to_meta_value({})) == bytes.fromhex("3a00")
    assert to_meta_value([None, True]) == MV(list=ML(items=[MV(), MV(bool=True)]))
    assert to_meta_value({"a": {"b": [None]}}) == MV(
        map=MM(entries={"a": MV(map=MM(entries={"b": MV(list=ML(items=[MV()]))}))})
    )
    # dict subclasses, namedtuples (via _asdict), memoryview (via tolist)
    ordered = collections.OrderedDict(z=1, a=2)
    assert to_meta_value(ordered) == to_meta_value({"z": 1, "a": 2})
    assert to_meta_value(collections.defaultdict(int, a=1)) == to_meta_value({"a": 1})
    assert to_meta_value(Point(1, 2)) == to_meta_value({"x": 1, "y": 2})
    assert to_meta_value(memoryview(b"x")) == to_meta_value([120])
    assert to_meta_value(ToList()) == to_meta_value({"x": [1, 2]})
    assert to_meta_value({Sub("k"): 1, np.str_("n"): 2}) == to_meta_value({"k": 1, "n": 2})


ARRAYS: list[tuple[str, Any, object]] = [
    ("i32_2d", np.array([[1, 2], [3, 4]], dtype=np.int32), [[1, 2], [3, 4]]),
    ("bool", np.array([True, False]), [True, False]),
    ("u8", np.array([1, 2], dtype=np.uint8), [1, 2]),
    ("f16", np.array([0.5], dtype=np.float16), [0.5]),
    ("f32", np.array([1.0, 2.0], dtype=np.float32), [1.0, 2.0]),
    ("empty", np.array([]), []),
    ("empty_2d", np.zeros((0, 3)), []),
    ("scalar", np.array(3.5), 3.5),
    ("scalar_int", np.array(7, dtype=np.int16), 7),
    ("str", np.array(["a", "b"]), ["a", "b"]),
    ("bytes", np.array([b"a"]), [b"a"]),
    ("object", np.array([np.array([1, 2]), np.array([3])], dtype=object), [[1, 2], [3]]),
    ("masked", np.ma.masked_array([1, 2]), [1, 2]),
    ("record", np.zeros(1, dtype=[("a", "i4")])[0], [0]),
]


@pytest.mark.parametrize(("array", "expected"), [a[1:] for a in ARRAYS], ids=[a[0] for a in ARRAYS])
def test_numpy_arrays_become_nested_lists(array: Any, expected: object) -> None:
    converted = to_meta_value(array)
    assert converted == to_meta_value(expected)
    assert same(from_meta_value(through_wire(converted)), expected)


# --------------------------------------------------------------------------- refusals

REFUSED: list[tuple[str, object, type[Exception], str]] = [
    ("set", {1, 2}, TypeError, UNSUPPORTED.format("set")),
    ("frozenset", frozenset({1}), TypeError, UNSUPPORTED.format("frozenset")),
    ("object", object(), TypeError, UNSUPPORTED.format("object")),
    ("bytearray", bytearray(b"x"), TypeError, UNSUPPORTED.format("bytearray")),
    ("dict_keys", {"a": 1}.keys(), TypeError, UNSUPPORTED.format("dict_keys")),
    ("dict_values", {"a": 1}.values(), TypeError, UNSUPPORTED.format("dict_values")),
    ("dict_items", {"a": 1}.items(), TypeError, UNSUPPORTED.format("dict_items")),
    (
        "mappingproxy",
        types.MappingProxyType({"a": 1}),
        TypeError,
        UNSUPPORTED.format("mappingproxy"),
    ),
    ("range", range(3), TypeError, UNSUPPORTED.format("range")),
    ("complex", 1 + 2j, TypeError, UNSUPPORTED.format("complex")),
    ("np_complex", np.complex64(1), TypeError, UNSUPPORTED.format("complex")),
    ("datetime64", np.datetime64("2020-01-01"), TypeError, UNSUPPORTED.format("date")),
    ("type", int, TypeError, UNSUPPORTED.format("type")),
    ("ellipsis", ..., TypeError, UNSUPPORTED.format("ellipsis")),
    ("bad_float", BadFloat(), TypeError, UNSUPPORTED.format("BadFloat")),
    ("self_value", SelfValue(), TypeError, UNSUPPORTED.format("SelfValue")),
    ("surrogate_text", "a\ud800", TypeError, UNSUPPORTED.format("str")),
    ("object_array", np.array([object()], dtype=object), TypeError, UNSUPPORTED.format("object")),
    ("nested_object", {"a": [object()]}, TypeError, UNSUPPORTED.format("object")),
    ("int_key", {1: "x"}, TypeError, "'int' object is not an instance of 'str'"),
    ("tuple_key", {(1, 2): "x"}, TypeError, "'tuple' object is not an instance of 'str'"),
    ("nested_key", {"a": {None: 1}}, TypeError, "'None' is not an instance of 'str'"),
    ("u64_max", np.uint64(2**64 - 1), OverflowError, OVERFLOW.format(2**64 - 1)),
    ("big_int", 2**70, OverflowError, OVERFLOW.format(2**70)),
    ("big_int_subclass", IntSub(2**63), OverflowError, OVERFLOW.format(2**63)),
    ("below_int64", -(2**63) - 1, OverflowError, OVERFLOW.format(-(2**63) - 1)),
    (
        "u64_array",
        np.array([2**64 - 1], dtype=np.uint64),
        OverflowError,
        OVERFLOW.format(2**64 - 1),
    ),
    (
        "surrogate_key",
        {"a\udc00": 1},
        UnicodeEncodeError,
        "'utf-8' codec can't encode character '\\udc00' in position 1: surrogates not allowed",
    ),
]


@pytest.mark.parametrize(
    ("value", "error", "text"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_refusals_match_the_reference(value: object, error: type[Exception], text: str) -> None:
    with pytest.raises(error) as caught:
        to_meta_value(value)
    assert type(caught.value) is error  # the lane reports type(exc).__name__
    assert str(caught.value) == text
    with pytest.raises(error) as caught_in_map:
        to_meta_map({"info": value})
    assert str(caught_in_map.value) == text


def test_a_key_of_the_info_itself_is_refused_in_the_references_words() -> None:
    """The reference words a bad key as PyO3 does, at every depth (None: ``'None' is
    not...``, measured against rlmesh 0.1.0's server at depths 1 to 3, in lists and
    tuples, in step and reset infos and in metadata)."""
    with pytest.raises(TypeError) as none_key:
        to_meta_map({None: 1})
    assert str(none_key.value) == "'None' is not an instance of 'str'"
    with pytest.raises(TypeError) as int_key:
        to_meta_map({1: 1})
    assert str(int_key.value) == "'int' object is not an instance of 'str'"


def test_errors_from_the_value_itself_propagate() -> None:
    class BrokenToList:
        def tolist(self) -> object:
            raise RuntimeError("tolist broke")

    with pytest.raises(RuntimeError, match="tolist broke"):
        to_meta_value(BrokenToList())
    with pytest.raises(RuntimeError, match="value property broke"):
        to_meta_value(RaisingValue())


def test_first_bad_entry_wins() -> None:
    with pytest.raises(TypeError, match="'set'"):
        to_meta_map({"a": {1}, "b": 2**70})
    with pytest.raises(OverflowError):
        to_meta_map({"b": 2**70, "a": {1}})
    with pytest.raises(TypeError, match="'int' object"):
        to_meta_map({1: object()})  # type: ignore[dict-item]  # the key is checked first


def test_refusal_note_names_the_location() -> None:
    with pytest.raises(TypeError) as caught:
        to_meta_map({"a": {"b": [1, {2}]}})
    assert str(caught.value) == UNSUPPORTED.format("set")
    assert caught.value.__notes__ == [
        "(rlmesh-trio: refused while converting the metadata value at $.a.b[1])"
    ]
    with pytest.raises(OverflowError) as caught:
        to_meta_value([0, 2**64], path="$.info")
    assert caught.value.__notes__[-1].endswith("at $.info[1])")


def test_cycles_raise_instead_of_crashing() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(RecursionError):
        to_meta_value(loop)


def test_to_meta_map_wants_a_dict() -> None:
    with pytest.raises(TypeError) as caught:
        to_meta_map([("a", 1)])  # type: ignore[arg-type]
    assert str(caught.value) == "'list' object is not an instance of 'dict'"
    with pytest.raises(TypeError, match="'mappingproxy' object is not an instance of 'dict'"):
        to_meta_map(types.MappingProxyType({"a": 1}))
    assert to_meta_map(collections.OrderedDict(a=1)) == MM(entries={"a": MV(integer=1)})


def test_empty_map_is_fresh_and_empty_on_the_wire() -> None:
    first, second = to_meta_map({}), to_meta_map({})
    assert first == MM()
    assert bytes(first) == b""
    assert first is not second
    first.entries["x"] = MV(integer=1)
    assert second.entries == {}
    assert bytes(env_v1.StepResponse(infos=to_meta_map({}))).hex() == "2a00"


def test_fast_table_agrees_with_the_general_route() -> None:
    """Every exact type in the dispatch table converts as the reference's route would."""
    samples: list[object] = [
        None, True, 3, 2.5, "s", b"b", [1], (1,), {"a": 1},
        np.array([[1, 2]]), np.array(2.5), np.bool_(True), np.str_("x"), np.bytes_(b"y"),
    ]  # fmt: skip
    for cls in _meta._ENCODERS:
        if issubclass(cls, np.integer):
            samples.append(cls(7))
        elif issubclass(cls, np.floating):
            samples.append(cls(0.25))
    covered = {type(sample) for sample in samples}
    assert covered >= set(_meta._ENCODERS)
    for sample in samples:
        via_table = _meta._ENCODERS[type(sample)](sample)
        normalise = getattr(sample, "tolist", None)
        general = _meta._encode_plain(normalise() if callable(normalise) else sample)
        assert via_table == general, sample


def test_fast_message_builders_equal_the_constructors() -> None:
    builders = {
        "_meta_integer": ("integer", 2**62),
        "_meta_number": ("number", -1.5),
        "_meta_text": ("text", "é"),
        "_meta_bool": ("bool", True),
        "_meta_bytes": ("bytes", b"\x00"),
        "_meta_list": ("list", ML(items=[MV()])),
        "_meta_map": ("map", MM(entries={"a": MV(bool=False)})),
    }
    for name, (field, sample) in builders.items():
        build = getattr(_meta, name)
        assert build.__name__ == "build", f"{name}: fell back to the constructor"
        built, constructed = build(sample), MV(**{field: sample})
        assert built == constructed
        assert vars(built) == vars(constructed)
        assert bytes(built) == bytes(constructed)
        assert betterproto2.which_one_of(built, "kind") == (field, sample)
    assert _meta._meta_empty.__name__ == "build"
    assert _meta._meta_empty(None) == MV()
    assert bytes(_meta._meta_empty(None)) == b""
    first, second = _meta._new_list([MV(integer=1)]), _meta._new_list([])
    first.items.append(MV())
    assert second.items == []
    assert _meta._new_map({"k": MV()}) == MM(entries={"k": MV()})


def test_builder_refuses_shared_mutable_state() -> None:
    # SpaceSpec's ``shape`` default is a list that a shallow template copy would share.
    build = _meta._builder(spaces_v1.SpaceSpec, "dtype", spaces_v1.DataType.FLOAT32)
    assert build.__name__ == "construct"
    assert build(spaces_v1.DataType.UINT8) == spaces_v1.SpaceSpec(dtype=spaces_v1.DataType.UINT8)


# --------------------------------------------------------------------------- wire -> Python


def test_from_meta_value_every_kind() -> None:
    cases: list[tuple[MV | None, object]] = [
        (None, None),
        (MV(), None),
        (MV(integer=0), 0),
        (MV(integer=-(2**63)), -(2**63)),
        (MV(number=0.0), 0.0),
        (MV(text=""), ""),
        (MV(bool=False), False),
        (MV(bytes=b""), b""),
        (MV(list=ML()), []),
        (MV(map=MM()), {}),
        (MV(list=ML(items=[MV(), MV(map=MM(entries={"k": MV(text="v")}))])), [None, {"k": "v"}]),
    ]
    for value, expected in cases:
        assert same(from_meta_value(value), expected), value
        if value is not None:
            assert same(from_meta_value(through_wire(value)), expected), value


def test_from_meta_map_none_and_empty() -> None:
    assert from_meta_map(None) == {}
    assert from_meta_map(MM()) == {}
    assert from_meta_map(MM.parse(b"")) == {}


def test_empty_meta_value_in_a_map_both_wire_forms() -> None:
    """The known trap: prost omits an empty MetaValue as a map value; betterproto2 reads None."""
    explicit = MM.parse(bytes.fromhex("0a050a01761200"))  # entry {key "v", value {}}
    omitted = MM.parse(bytes.fromhex("0a030a0176"))  # entry {key "v"}: the reference's bytes
    assert explicit.entries == {"v": MV()}
    assert omitted.entries == {"v": None}
    assert bytes(explicit).hex() == "0a050a01761200"
    with pytest.raises(TypeError, match="NoneType"):
        bytes(omitted)  # betterproto2 cannot serialise what it parsed
    for parsed in (explicit, omitted):
        assert from_meta_map(parsed) == {"v": None}
        rebuilt = to_meta_map(from_meta_map(parsed))
        assert bytes(rebuilt).hex() == "0a050a01761200"
        assert MM.parse(bytes(rebuilt)) == explicit
    # {"o": {"v": None}} as prost writes it: map{entry{"o", map{entry{"v"}}}}
    nested = MV.parse(bytes.fromhex("3a0e 0a0c 0a016f 1207 3a05 0a03 0a0176"))
    assert from_meta_value(nested) == {"o": {"v": None}}
    assert bytes(to_meta_value(from_meta_value(nested))) == bytes(to_meta_value({"o": {"v": None}}))


def test_empty_meta_value_in_a_list() -> None:
    parsed = ML.parse(bytes.fromhex("0a000a022001"))
    assert parsed.items == [MV(), MV(bool=True)]
    assert bytes(parsed).hex() == "0a000a022001"
    assert from_meta_value(MV(list=parsed)) == [None, True]
    assert bytes(to_meta_value([None, True]).list).hex() == "0a000a022001"  # type: ignore[arg-type]


# --------------------------------------------------------------------------- goldens


def _from_driver_json(data: dict[str, Any]) -> MV:
    """A MetaValue from the driver's JSON view (bytes as hex, ``{}`` for None)."""
    if not data:
        return MV()
    ((kind, value),) = data.items()
    if kind == "list":
        return MV(list=ML(items=[_from_driver_json(item) for item in value.get("items", [])]))
    if kind == "map":
        return MV(map=_map_from_driver_json(value))
    if kind == "bytes":
        return MV(bytes=bytes.fromhex(value))
    return MV(**{kind: value})


def _map_from_driver_json(data: dict[str, Any]) -> MM:
    return MM(entries={k: _from_driver_json(v) for k, v in data.get("entries", {}).items()})


#: The probe_spaces_text_info info cases: the value each case name describes.
PROBE_CASES: dict[str, object] = {
    "u64_small": np.uint64(5),
    "u64_max": np.uint64(2**64 - 1),
    "big_int": 2**70,
    "i64_min": np.int64(-(2**63)),
    "f16": np.float16(0.5),
    "nan": math.nan,
    "inf": math.inf,
    "arr_bool": np.array([True, False]),
    "arr_u8": np.array([1, 2], dtype=np.uint8),
    "arr_f16": np.array([0.5], dtype=np.float16),
    "empty_arr": np.array([]),
    "scalar_arr": np.array(3.5),
    "set": {1, 2},
    "frozenset": frozenset({1, 2}),
    "obj": object(),
    "bytearray": bytearray(b"ab"),
    "int_key": {1: "x"},
    "tuple_key": {(1, 2): "x"},
    "nested_obj": {"inner": object()},
    "list_obj": [object()],
    "none": None,
    "enum": Color.RED,
    "str_subclass": Sub("sub"),
    "np_str": np.str_("npstr"),
    "dict_view": {"a": 1}.keys(),
}


def _probe_outcomes() -> Iterator[tuple[str, dict[str, Any]]]:
    for entry in driver("probe_spaces_text_info"):
        if isinstance(entry, list) and entry and entry[0] in PROBE_CASES:
            kind, body = entry[1]
            assert kind == "msg"
            yield entry[0], body


def test_every_probe_case_is_covered() -> None:
    assert {name for name, _ in _probe_outcomes()} == set(PROBE_CASES)


@pytest.mark.parametrize("case", sorted(PROBE_CASES))
def test_probe_info_case_matches_the_reference(case: str) -> None:
    body = dict(_probe_outcomes())[case]
    info = {"case": case, "value": PROBE_CASES[case]}
    if "error" in body:
        with pytest.raises((TypeError, OverflowError)) as caught:
            to_meta_map(info)
        # The lane's text: "reset failed: <ExceptionType>: <str(exc)>" (SPEC §9).
        assert (
            f"reset failed: {type(caught.value).__name__}: {caught.value}"
            == body["error"]["message"]
        )
        assert body["error"]["code"] == "ENV_ERROR_CODE_INTERNAL"
    else:
        expected = _map_from_driver_json(body["reset"]["infos"])
        assert to_meta_map(info) == expected
        assert MM.parse(bytes(to_meta_map(info))) == expected


def test_probe_reply_bytes_decode_to_the_case_value() -> None:
    """The captured reply bytes decode to the Python value (None for the omitted entry)."""
    expected: dict[str, object] = {
        "u64_small": 5, "i64_min": -(2**63), "f16": 0.5, "nan": math.nan, "inf": math.inf,
        "arr_bool": [True, False], "arr_u8": [1, 2], "arr_f16": [0.5], "empty_arr": [],
        "scalar_arr": 3.5, "none": None, "enum": 1, "str_subclass": "sub", "np_str": "npstr",
    }  # fmt: skip
    for case, value in expected.items():
        record = find_message("probe_spaces_text_info", request_id=f"info-{case}", direction="s2c")
        response = parse_record(record, env_v1.JoinResponse)
        assert isinstance(response, env_v1.JoinResponse)
        assert response.reset is not None
        assert same(from_meta_map(response.reset.infos), {"case": case, "value": value}), case


MIXED_INFO: dict[str, object] = {
    "bytes": b"\x00\x01",
    "seed_seen": 3,
    "none": None,
    "np_i64": np.int64(-3),
    "str": "s",
    "list": [1, "two", 3.0],
    "tuple": (1, 2),
    "arr_f32": np.array([1.0, 2.0], dtype=np.float32),
    "bool": True,
    "np_bool": np.bool_(True),
    "int": 7,
    "nested": {"a": 1, "b": {"c": [True, None]}},
    "float": 2.5,
    "np_f32": np.float32(1.25),
    "arr_i32_2d": np.array([[1, 2], [3, 4]], dtype=np.int32),
}


def test_mixed_codec_reset_options_decode_as_the_env_saw_them() -> None:
    request = parse_record(
        find_message("mixed_codec", request_id="reset-seed-3-with-options", direction="c2s")
    )
    reply = parse_record(
        find_message("mixed_codec", request_id="reset-seed-3-with-options", direction="s2c")
    )
    assert isinstance(request, env_v1.JoinRequest)
    assert request.reset is not None
    assert isinstance(reply, env_v1.JoinResponse)
    assert reply.reset is not None
    options = from_meta_map(request.reset.options)
    seen_text = reply.reset.infos.entries["options_seen"].text
    assert seen_text is not None
    assert same(options, ast.literal_eval(seen_text))
    assert {type(v) for v in options.values()} == {bool, float, int, list, dict, bytes, str}
    assert to_meta_map(options) == request.reset.options


def test_mixed_codec_info_conversion_matches_the_reference() -> None:
    reply = parse_record(
        find_message("mixed_codec", request_id="reset-seed-3-with-options", direction="s2c")
    )
    assert isinstance(reply, env_v1.JoinResponse)
    assert reply.reset is not None
    captured = fill_missing_map_values(reply.reset.infos)
    seen_text = reply.reset.infos.entries["options_seen"].text
    info = {**MIXED_INFO, "options_seen": seen_text}
    assert to_meta_map(info) == captured
    # ... and what the 0.1.0 client decoded from those bytes
    for entry in driver("mixed_codec"):
        if entry[0] == "msg" and entry[1].get("request_id") == "reset-seed-3-with-options":
            assert to_meta_map(info) == _map_from_driver_json(entry[1]["reset"]["infos"])
            break
    else:
        pytest.fail("reset reply not in the mixed_codec driver log")


def _captured_meta_maps() -> Iterator[tuple[str, MM]]:
    for scenario in scenarios():
        for record in message_records(scenario):
            if "hex" not in record or not record.get("msg_type") or "decode_error" in record:
                continue
            message = parse_record(record)
            where = f"{scenario}#{record['seq']}"
            if isinstance(message, env_v1.JoinRequest) and message.reset is not None:
                yield where, message.reset.options
            elif isinstance(message, env_v1.JoinResponse):
                kind, arm = betterproto2.which_one_of(message, "kind")
                if kind in ("reset", "step"):
                    yield where, arm.infos
                for episode in (
                    getattr(arm, "completed_episodes", None)
                    or getattr(arm, "final_episodes", None)
                    or []
                ):
                    if episode.final_info is not None:
                        yield where, episode.final_info
            elif isinstance(message, env_v1.HandshakeResponse):
                contract: core_v1.EnvContract | None = message.env_contract
                if contract is not None and contract.spec is not None:
                    yield where, contract.spec.metadata


def test_every_captured_meta_map_round_trips() -> None:
    count = 0
    for where, meta in _captured_meta_maps():
        if meta is None:
            continue
        python = from_meta_map(meta)
        rebuilt = to_meta_map(python)
        assert rebuilt == fill_missing_map_values(meta), where
        assert same(from_meta_map(MM.parse(bytes(rebuilt))), python), where
        count += 1
    assert count > 300


# --------------------------------------------------------------------------- properties

_text = st.text(st.characters(codec="utf-8"), max_size=8)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | _text
    | st.binary(max_size=8)
)
_json_like = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(_text, inner, max_size=4)
    ),
    max_leaves=20,
)


def _expected(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return [_expected(item) for item in value]
    if isinstance(value, dict):
        return {key: _expected(item) for key, item in value.items()}
    return value


@settings(max_examples=300, deadline=None)
@given(_json_like)
def test_round_trip_json_like(value: object) -> None:
    decoded = from_meta_value(MV.parse(bytes(to_meta_value(value))))
    assert same(decoded, _expected(value))


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(_text, _json_like, max_size=5))
def test_round_trip_maps(value: dict[str, object]) -> None:
    meta = to_meta_map(value)
    assert same(from_meta_map(MM.parse(bytes(meta))), _expected(value))


@settings(max_examples=100, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from(
            [np.bool_, np.int8, np.uint16, np.int64, np.float16, np.float32, np.float64]
        ),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
    )
)
def test_round_trip_arrays(array: Any) -> None:
    decoded = from_meta_value(MV.parse(bytes(to_meta_value(array))))
    assert same(decoded, array.tolist())
