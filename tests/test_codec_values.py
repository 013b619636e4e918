"""Values <-> leaves (SPEC §3): hand-built values, and behaviour measured on rlmesh 0.1.0.

"Measured" cases were established by serving a small env with ``rlmesh.EnvServer`` and
driving it with a raw Join client (exact action leaves in, observation leaves / error
texts / what ``env.step`` received out).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from rlmesh_trio._codec import Candidate, SpaceCodec
from rlmesh_trio._errors import ActionError
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1

S = gym.spaces
f32 = np.float32


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


def le(values: Any, dtype: Any = np.int64) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


def text_slab(*bodies: str | bytes, count: int | None = None, lengths: Any = None) -> bytes:
    raw = [b.encode() if isinstance(b, str) else b for b in bodies]
    n = len(raw) if count is None else count
    lens = [len(b) for b in raw] if lengths is None else lengths
    return struct.pack("<Q", n) + b"".join(struct.pack("<Q", x) for x in lens) + b"".join(raw)


# ---- SPEC §3.5, the worked example -------------------------------------------------------

MIXED_OBS = S.Dict(
    OrderedDict(
        [
            ("zeta", S.Box(-1, 1, (3,), f32)),
            ("alpha", S.Discrete(5, start=2)),
            ("mb", S.MultiBinary(4)),
            ("tup", S.Tuple((S.Box(0, 255, (2, 2), np.uint8), S.Discrete(3)))),
            ("md", S.MultiDiscrete([3, 4])),
            ("txt", S.Text(8, charset="abc")),
            ("elem", S.Box(np.array([-1.0, 0.0]), np.array([1.0, np.inf]), dtype=np.float64)),
            ("unb", S.Box(-np.inf, np.inf, (2,), f32)),
            ("i16", S.Box(-5, 5, (2,), np.int16)),
            ("f16", S.Box(-2, 2, (1,), np.float16)),
        ]
    )
)
MIXED_VALUE = {
    "zeta": np.array([0.5, -0.5, 0.0], f32),
    "alpha": 2,
    "mb": np.array([1, 0, 1, 0], np.int8),
    "tup": (np.array([[1, 2], [3, 4]], np.uint8), 0),
    "md": np.array([2, 0]),
    "txt": "ab",
    "elem": np.array([-0.5, 1000.0]),
    "unb": np.array([1.5, 0.0], f32),
    "i16": np.array([-3, 0], np.int16),
    "f16": np.array([0.5], np.float16),
}
MIXED_LEAVES = [
    "0200000000000000",
    "000000000000e0bf 0000000000408f40",
    "0038",
    "fdff 0000",
    "01000100",
    "0200000000000000 0000000000000000",
    "01020304",
    "0000000000000000",
    "0100000000000000 0200000000000000 6162",
    "0000c03f 00000000",
    "0000003f 000000bf 00000000",
]
MIXED_ACTION = S.Dict(
    {"buttons": S.MultiBinary(3), "fire": S.Discrete(2), "move": S.Box(-1, 1, (2,), f32)}
)


def assert_same_value(got: Any, expected: Any) -> None:
    """Structural equality; arrays must match in dtype, shape and values."""
    if isinstance(expected, dict):
        assert isinstance(got, dict)
        assert list(got) == sorted(expected)
        for key in expected:
            assert_same_value(got[key], expected[key])
    elif isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert_same_value(a, b)
    elif isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert np.array_equal(got, expected)
    else:
        assert type(got) is type(expected) and got == expected


def test_worked_example_observation() -> None:
    codec = SpaceCodec(MIXED_OBS)
    leaves = codec.encode(MIXED_VALUE)
    assert leaves == [h(x) for x in MIXED_LEAVES]
    assert codec.encode_observation(MIXED_VALUE, soft_checks=True) == (leaves, None)
    (decoded,) = codec.decode(leaves, 1)
    assert_same_value(
        decoded,
        {**MIXED_VALUE, "mb": np.array([1, 0, 1, 0], np.uint8), "md": np.array([2, 0], np.int64)},
    )


def test_worked_example_action_one_and_two_lanes() -> None:
    codec = SpaceCodec(MIXED_ACTION)
    value = {"buttons": np.array([1, 0, 1]), "fire": 1, "move": np.array([0.5, -0.25], f32)}
    leaves = codec.encode(value)
    assert leaves == [h("010001"), h("0100000000000000"), h("0000003f000080be")]
    assert bytes(spaces_v1.SpaceValue(leaves=leaves)) == h(
        "0a03010001 0a080100000000000000 0a080000003f000080be"
    )
    action, candidate = codec.decode_action(leaves, 1, 0, soft_checks=True)
    assert candidate is None
    assert_same_value(
        action,
        {"buttons": np.array([1, 0, 1], np.uint8), "fire": 1, "move": np.array([0.5, -0.25], f32)},
    )
    lanes = [
        {"buttons": [1, 0, 0], "fire": 0, "move": [0.1, 0.2]},
        {"buttons": [0, 1, 1], "fire": 1, "move": [-0.1, -0.2]},
    ]
    batch = codec.encode_batch(lanes)
    assert batch == [
        h("010000000101"),
        h("00000000000000000100000000000000"),
        h("cdcccc3dcdcc4c3ecdccccbdcdcc4cbe"),
    ]
    assert codec.join([codec.encode(v) for v in lanes]) == batch
    codec.validate_action(batch, 2)
    rows = codec.decode(batch, 2)
    for row, lane in enumerate(lanes):
        expected = {
            "buttons": np.array(lane["buttons"], np.uint8),
            "fire": lane["fire"],
            "move": np.array(lane["move"], f32),
        }
        assert_same_value(rows[row], expected)
        assert_same_value(codec.decode_action(batch, 2, row, soft_checks=False)[0], expected)


# ---- SPEC §3.3 / §3.4 --------------------------------------------------------------------


def test_text_always_carries_the_slab_header() -> None:
    codec = SpaceCodec(S.Text(8, charset="abc"))
    assert codec.encode("ab") == [h("0100000000000000 0200000000000000 6162")]
    assert codec.encode_batch(["ab", "ab"]) == [
        h("0200000000000000 0200000000000000 0200000000000000 61626162")
    ]
    assert codec.join([codec.encode("ab"), codec.encode("c")]) == [text_slab("ab", "c")]
    assert codec.encode_batch([]) == [h("0000000000000000")]
    assert codec.decode([text_slab("ab", "ca")], 2) == ["ab", "ca"]
    # Bodies are UTF-8, lengths in bytes.
    assert codec.encode("é") == [text_slab("é")]
    assert codec.decode_action([text_slab("a", "éz")], 2, 1, soft_checks=False) == ("éz", None)


def test_join_merges_multi_lane_text_parts() -> None:
    codec = SpaceCodec(S.Tuple((S.Discrete(3), S.Text(4))))
    parts = [codec.encode_batch([(0, "a"), (1, "bb")]), codec.encode((2, "ccc"))]
    assert codec.join(parts) == codec.encode_batch([(0, "a"), (1, "bb"), (2, "ccc")])


def test_discrete_start_is_not_subtracted() -> None:
    assert SpaceCodec(S.Discrete(5, start=2)).encode(2) == [h("0200000000000000")]
    assert SpaceCodec(S.Discrete(3, start=-1)).encode(-1) == [h("ffffffffffffffff")]
    assert SpaceCodec(S.Discrete(3, start=-1)).decode([h("ffffffffffffffff")], 1) == [-1]


def test_bool_box_is_one_byte_per_element() -> None:
    codec = SpaceCodec(S.Box(0, 1, (2,), bool))
    assert codec.encode(np.array([True, False])) == [h("0100")]


def test_n_is_an_input_never_derived() -> None:
    codec = SpaceCodec(S.Discrete(2))
    two_lanes = le([0, 1])
    with pytest.raises(
        ActionError, match=r"^length mismatch: slab: got 16 bytes, expected 1 lanes \* 8$"
    ):
        codec.validate_action([two_lanes], 1)
    codec.validate_action([two_lanes], 2)
    codec.validate_action([b""], 0)
    assert codec.decode([b""], 0) == []


# ---- what env.step receives (measured) ---------------------------------------------------

RECORDED_SPACE = S.Dict(
    {
        "box": S.Box(-1, 1, (3,), f32),
        "boxb": S.Box(0, 1, (2,), bool),
        "disc": S.Discrete(3, start=1),
        "mb": S.MultiBinary(3),
        "md": S.MultiDiscrete([2, 3]),
        "txt": S.Text(4, charset="abc"),
        "tup": S.Tuple((S.Box(0, 255, (2,), np.uint8), S.Discrete(2))),
        "b2": S.Box(-1, 1, (2, 2), np.float64),
    }
)
RECORDED_LEAVES = [
    le(np.zeros((2, 2)), np.float64),
    le([0.5, 0, 0], f32),
    bytes([1, 0]),
    le([2]),
    bytes([1, 2, 0]),
    le([1, 2]),
    bytes([3, 4]),
    le([1]),
    text_slab("ab"),
]


def test_decoded_action_types_match_the_reference() -> None:
    codec = SpaceCodec(RECORDED_SPACE)
    codec.validate_action(RECORDED_LEAVES, 1)
    action, candidate = codec.decode_action(RECORDED_LEAVES, 1, 0, soft_checks=True)
    assert candidate is None
    assert type(action) is dict
    assert list(action) == ["b2", "box", "boxb", "disc", "mb", "md", "tup", "txt"]
    assert_same_value(action["b2"], np.zeros((2, 2)))
    assert_same_value(action["box"], np.array([0.5, 0, 0], f32))
    assert_same_value(action["boxb"], np.array([True, False]))
    assert action["disc"] == 2 and type(action["disc"]) is int
    # MultiBinary: any non-zero byte is delivered as 1.
    assert_same_value(action["mb"], np.array([1, 1, 0], np.uint8))
    assert_same_value(action["md"], np.array([1, 2], np.int64))
    assert type(action["tup"]) is tuple
    assert_same_value(action["tup"][0], np.array([3, 4], np.uint8))
    assert action["tup"][1] == 1 and type(action["tup"][1]) is int
    assert action["txt"] == "ab" and type(action["txt"]) is str
    # The reference hands read-only arrays to env.step.
    for key in ("b2", "box", "boxb", "mb", "md"):
        assert not action[key].flags.writeable, key
    assert not action["tup"][0].flags.writeable
    assert_same_value(codec.decode(RECORDED_LEAVES, 1)[0], action)


def test_ordered_dict_actions_arrive_in_wire_order() -> None:
    codec = SpaceCodec(
        S.Dict(OrderedDict([("z", S.Discrete(3)), ("a", S.Box(0, 1, (1,), np.float16))]))
    )
    action, _ = codec.decode_action([le([0.5], np.float16), le([2])], 1, 0, soft_checks=False)
    assert list(action) == ["a", "z"]


def test_multi_dimensional_actions_keep_their_shape() -> None:
    md = SpaceCodec(S.MultiDiscrete([[2, 3], [4, 5]]))
    assert_same_value(md.decode([le([1, 2, 3, 4])], 1)[0], np.array([[1, 2], [3, 4]]))
    mb = SpaceCodec(S.MultiBinary([2, 2]))
    value, _ = mb.decode_action([bytes([0, 255, 7, 1])], 1, 0, soft_checks=True)
    assert_same_value(value, np.array([[0, 1], [1, 1]], np.uint8))
    assert not value.flags.writeable


def test_bool_box_bytes_other_than_one_read_as_true() -> None:
    codec = SpaceCodec(S.Box(0, 1, (2,), bool))
    for raw in (bytes([2, 0]), bytes([255, 1])):
        codec.validate_action([raw], 1)
        value, candidate = codec.decode_action([raw], 1, 0, soft_checks=True)
        assert candidate is None
        assert value.tolist() == [bool(b) for b in raw]
        assert value.view(np.uint8).max() <= 1
        assert codec.decode([raw], 1)[0].tolist() == value.tolist()


def test_lane_rows_of_a_two_lane_slab() -> None:
    codec = SpaceCodec(S.Box(-1, 1, (2,), f32))
    slab = le([[1, 2], [3, 4]], f32)
    first, warn0 = codec.decode_action([slab], 2, 0, soft_checks=True)
    second, warn1 = codec.decode_action([slab], 2, 1, soft_checks=True)
    assert first.tolist() == [1, 2] and second.tolist() == [3, 4]
    assert not first.flags.writeable and not second.flags.writeable
    # Element indices are per lane (lane 1's element 0 is the slab's element 2).
    assert warn0 == Candidate(
        "action", "$", "$: Box value at element 1 out of bounds: above high bound"
    )
    assert warn1 == Candidate(
        "action", "$", "$: Box value at element 0 out of bounds: above high bound"
    )


# ---- action validation (measured texts) --------------------------------------------------


@pytest.mark.parametrize(
    ("space", "leaves", "n", "message"),
    [
        pytest.param(S.Discrete(2), None, 1, "expected 1 actions, got 0", id="absent-1"),
        pytest.param(S.Discrete(2), None, 2, "expected 2 actions, got 0", id="absent-2"),
        pytest.param(
            S.Discrete(2),
            [],
            1,
            "length mismatch: got 0 leaf slabs, spec expects 1",
            id="no-leaves",
        ),
        pytest.param(
            S.Discrete(2),
            [le([0]), le([0])],
            1,
            "length mismatch: got 2 leaf slabs, spec expects 1",
            id="two-leaves",
        ),
        pytest.param(
            S.Discrete(2),
            [le([0], np.int32)],
            1,
            "length mismatch: slab: got 4 bytes, expected 1 lanes * 8",
            id="short",
        ),
        pytest.param(
            S.Discrete(2),
            [le([0])],
            2,
            "length mismatch: slab: got 8 bytes, expected 2 lanes * 8",
            id="short-2",
        ),
        pytest.param(
            S.Tuple((S.Box(0, 255, (2,), np.uint8), S.Discrete(2))),
            [le([1, 2, 3], np.uint8), le([0])],
            1,
            "length mismatch: slab: got 3 bytes, expected 1 lanes * 2",
            id="per-lane-bytes",
        ),
        pytest.param(S.Discrete(2), [le([5])], 1, "$: value 5 not in range [0, 2)", id="discrete"),
        pytest.param(S.Discrete(2), [le([0, 5])], 2, "$: value 5 not in range [0, 2)", id="lane1"),
        pytest.param(
            S.Discrete(2), [le([3, 5])], 2, "$: value 3 not in range [0, 2)", id="both-lanes"
        ),
        pytest.param(
            S.Discrete(3, start=1), [le([0])], 1, "$: value 0 not in range [1, 4)", id="start"
        ),
        pytest.param(
            S.Box(-1, 1, (2,), f32),
            [le([0, 0, np.nan, 0], f32)],
            2,
            "$: Box value at element 0 is NaN",
            id="nan-lane1-el0",
        ),
        pytest.param(
            S.Box(-1, 1, (2,), f32),
            [le([0, np.nan, 0, 0], f32)],
            2,
            "$: Box value at element 1 is NaN",
            id="nan-lane0-el1",
        ),
        pytest.param(
            S.MultiDiscrete([2, 3]),
            [le([0, 0, 1, 3])],
            2,
            "$: value[1] = 3 not in range [0, 3)",
            id="md-lane1",
        ),
        pytest.param(
            S.MultiDiscrete([2, 3]),
            [le([0, 0, 2, 0])],
            2,
            "$: value[0] = 2 not in range [0, 2)",
            id="md-lane1-el0",
        ),
        # Lengths of every leaf are checked before any value.
        pytest.param(
            S.Dict({"a": S.Box(-1, 1, (1,), f32), "b": S.Discrete(2), "c": S.Discrete(2)}),
            [le([np.nan], f32), le([0], np.int32), le([0])],
            1,
            "length mismatch: slab: got 4 bytes, expected 1 lanes * 8",
            id="length-before-nan",
        ),
        pytest.param(
            S.Dict({"a": S.Box(-1, 1, (1,), f32), "b": S.Discrete(2), "c": S.Discrete(2)}),
            [le([np.nan], f32), le([5]), le([0])],
            1,
            "$.a: Box value at element 0 is NaN",
            id="first-bad-leaf",
        ),
        pytest.param(
            S.Dict({"a": S.Box(-1, 1, (1,), f32), "b": S.Discrete(2), "c": S.Discrete(2)}),
            [le([0], f32), le([5]), b"\0"],
            1,
            "length mismatch: slab: got 1 bytes, expected 1 lanes * 8",
            id="length-of-later-leaf",
        ),
        pytest.param(
            S.Dict({"a": S.Box(-1, 1, (1,), f32), "b": S.Discrete(2), "c": S.Discrete(2)}),
            [le([0], f32), le([0])],
            1,
            "length mismatch: got 2 leaf slabs, spec expects 3",
            id="count-3",
        ),
        # Values: lane by lane, then leaf by leaf.
        pytest.param(
            S.Dict({"a": S.Discrete(2), "b": S.Discrete(2)}),
            [le([0, 5]), le([6, 0])],
            2,
            "$.b: value 6 not in range [0, 2)",
            id="row-major",
        ),
        pytest.param(
            S.Tuple((S.Box(-1, 1, (1,), f32), S.Discrete(2))),
            [le([0, np.nan], f32), le([5, 0])],
            2,
            "$[1]: value 5 not in range [0, 2)",
            id="row0-discrete-before-row1-nan",
        ),
        pytest.param(
            S.Tuple((S.Box(-1, 1, (1,), f32), S.Discrete(2))),
            [le([np.nan, 0], f32), le([5, 0])],
            2,
            "$[0]: Box value at element 0 is NaN",
            id="row0-nan-first",
        ),
    ],
)
def test_action_validation_texts(space: Any, leaves: Any, n: int, message: str) -> None:
    codec = SpaceCodec(space)
    with pytest.raises(ActionError) as info:
        codec.validate_action(leaves, n)
    assert str(info.value) == message
    with pytest.raises(ActionError):
        codec.decode(leaves, n)
    for row in range(n):  # the lane's per-step plan: the same refusal, whatever the row
        with pytest.raises(ActionError) as info:
            codec.step_action(leaves, n, row, validated=False, soft_checks=True)
        assert str(info.value) == message


TEXT = S.Text(4, charset="abc")


@pytest.mark.parametrize(
    ("leaves", "n", "message"),
    [
        pytest.param(
            [text_slab("ab", lengths=[3])],
            1,
            "length mismatch: text slab body truncated",
            id="short-body",
        ),
        pytest.param(
            [text_slab("ab") + b"x"],
            1,
            "length mismatch: trailing bytes in text slab",
            id="trailing",
        ),
        pytest.param(
            [struct.pack("<QQ", 2, 1)], 1, "length mismatch: text slab count 2 != N 1", id="count-2"
        ),
        pytest.param([b""], 1, "length mismatch: text slab header truncated", id="empty"),
        pytest.param([b"xyz"], 1, "length mismatch: text slab header truncated", id="raw"),
        pytest.param(
            [b"\1\0\0\0\0\0\0"], 1, "length mismatch: text slab header truncated", id="7-bytes"
        ),
        pytest.param(
            [struct.pack("<Q", 0)], 1, "length mismatch: text slab count 0 != N 1", id="count-0"
        ),
        pytest.param(
            [struct.pack("<Q", 2**62)],
            1,
            "length mismatch: text slab count 4611686018427387904 != N 1",
            id="huge-count",
        ),
        pytest.param(
            [text_slab("ab", lengths=[2**64 - 1])],
            1,
            "decode error: text length overflow",
            id="overflow",
        ),
        pytest.param(
            [text_slab(b"a\xff\xfeb")],
            1,
            "decode error: text payload is not valid UTF-8: invalid utf-8 sequence of 1 bytes from index 1",
            id="utf8-invalid",
        ),
        pytest.param(
            [text_slab(b"a\xc3")],
            1,
            "decode error: text payload is not valid UTF-8: incomplete utf-8 byte sequence from index 1",
            id="utf8-incomplete",
        ),
        pytest.param(
            [text_slab(b"\xed\xa0\x80")],
            1,
            "decode error: text payload is not valid UTF-8: invalid utf-8 sequence of 1 bytes from index 0",
            id="utf8-surrogate",
        ),
        pytest.param(
            [text_slab(b"\xff") + b"x"],
            1,
            "decode error: text payload is not valid UTF-8: invalid utf-8 sequence of 1 bytes from index 0",
            id="utf8-before-trailing",
        ),
        pytest.param(
            [text_slab("ab")], 2, "length mismatch: text slab count 1 != N 2", id="count-1-n-2"
        ),
        pytest.param(
            [text_slab("ab", b"\xff")],
            2,
            "decode error: text payload is not valid UTF-8: invalid utf-8 sequence of 1 bytes from index 0",
            id="utf8-index-per-string",
        ),
        pytest.param(
            [text_slab(b"\xff", "ab", lengths=[1, 5])],
            2,
            "decode error: text payload is not valid UTF-8: invalid utf-8 sequence of 1 bytes from index 0",
            id="strings-in-order",
        ),
        pytest.param(
            [struct.pack("<QQ", 2, 1)],
            2,
            "length mismatch: text slab header truncated",
            id="lengths-cut",
        ),
        pytest.param(
            [text_slab("a", "b", lengths=[2**64 - 1, 1])],
            2,
            "decode error: text length overflow",
            id="overflow-lane0",
        ),
        pytest.param(
            [text_slab("ab", "c", lengths=[2**63, 2**63 + 1])],
            2,
            "length mismatch: text slab body truncated",
            id="sum-overflows-later",
        ),
    ],
)
def test_text_action_validation_texts(leaves: Any, n: int, message: str) -> None:
    with pytest.raises(ActionError) as info:
        SpaceCodec(TEXT).validate_action(leaves, n)
    assert str(info.value) == message


def test_text_slab_errors_come_in_leaf_order() -> None:
    text_then_disc = SpaceCodec(S.Tuple((S.Text(4, charset="abc"), S.Discrete(2))))
    with pytest.raises(ActionError, match="not valid UTF-8"):
        text_then_disc.validate_action([text_slab(b"\xff"), b"\0"], 1)
    with pytest.raises(ActionError, match="text slab header truncated"):
        text_then_disc.validate_action([b"", le([5])], 1)
    disc_then_text = SpaceCodec(S.Tuple((S.Discrete(2), S.Text(4, charset="abc"))))
    # A text slab is fully read (UTF-8 included) before any value is checked.
    with pytest.raises(ActionError, match="not valid UTF-8"):
        disc_then_text.validate_action([le([5]), text_slab(b"\xff")], 1)
    with pytest.raises(ActionError, match=r"slab: got 1 bytes"):
        disc_then_text.validate_action([b"\0", text_slab(b"\xff")], 1)


def test_soft_violations_do_not_fail_validation() -> None:
    codec = SpaceCodec(
        S.Dict({"box": S.Box(-1, 1, (2,), f32), "txt": TEXT, "mb": S.MultiBinary(2)})
    )
    leaves = [le([5.0, np.inf], f32), bytes([2, 255]), text_slab("zzzzzz")]
    codec.validate_action(leaves, 1)
    value, candidate = codec.decode_action(leaves, 1, 0, soft_checks=True)
    assert candidate == Candidate(
        "action", "$.box", "$.box: Box value at element 0 out of bounds: above high bound"
    )
    assert value["mb"].tolist() == [1, 1]
    assert codec.decode_action(leaves, 1, 0, soft_checks=False)[1] is None


# ---- observation conversion (measured) ---------------------------------------------------


def encode_one(space: Any, value: Any) -> list[bytes]:
    return SpaceCodec(space).encode(value)


def encode_error(space: Any, value: Any) -> tuple[type[BaseException], str]:
    with pytest.raises(Exception) as info:
        SpaceCodec(space).encode(value)
    return type(info.value), str(info.value)


DISC = S.Discrete(3, start=1)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (2, "0200000000000000"),
        (2.0, "0200000000000000"),
        (np.array(2), "0200000000000000"),
        (True, "0100000000000000"),
        (np.float32(2), "0200000000000000"),
        (np.uint64(2), "0200000000000000"),
        (np.int64(3), "0300000000000000"),
    ],
)
def test_discrete_observation_forms(value: Any, expected: str) -> None:
    assert encode_one(DISC, value) == [h(expected)]


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (2.5, ValueError, "Discrete value must be an integer, got 2.5"),
        (np.array([2]), TypeError, "must be real number, not list"),
        ("2", TypeError, "must be real number, not str"),
        ([2], TypeError, "must be real number, not list"),
        (None, TypeError, "must be real number, not NoneType"),
        (2**70, ValueError, "$: value 9223372036854775807 not in range [1, 4)"),
        (0, ValueError, "$: value 0 not in range [1, 4)"),
        (np.int64(5), ValueError, "$: value 5 not in range [1, 4)"),
    ],
)
def test_discrete_observation_errors(value: Any, error: type, message: str) -> None:
    assert encode_error(DISC, value) == (error, message)


def test_discrete_bools_and_int_enums_are_plain_ints() -> None:
    import enum

    class Colour(enum.IntEnum):
        RED = 3

    shifted = S.Discrete(3, start=2)
    assert encode_error(shifted, True) == (ValueError, "$: value 1 not in range [2, 5)")
    assert encode_one(shifted, Colour.RED) == [le([3])]
    assert SpaceCodec(shifted).encode_batch([2, Colour.RED, np.int8(4)]) == [le([2, 3, 4])]


BOX = S.Box(-1, 1, (3,), f32)


@pytest.mark.parametrize(
    ("value", "expected", "warning"),
    [
        (
            np.array([1e300, 0, 0]),
            "0000807f0000000000000000",
            "element 0 out of bounds: above high bound",
        ),
        ([1, 0, 0], "0000803f0000000000000000", None),
        (np.array([True, False, True]), "0000803f000000000000803f", None),
        ([[0.1], [0.2], [0.3]], "cdcccc3dcdcc4c3e9a99993e", None),
        ((0.1, 0.2, 0.3), "cdcccc3dcdcc4c3e9a99993e", None),
        (np.array([1, 0, 0], np.uint64), "0000803f0000000000000000", None),
        (
            np.array([[2.0, 0.0, 0.0]]),
            "000000400000000000000000",
            "element 0 out of bounds: above high bound",
        ),
        (
            np.array([2, 0, 0], np.float16),
            "000000400000000000000000",
            "element 0 out of bounds: above high bound",
        ),
        (np.array([0, 0, 0], np.int32), "000000000000000000000000", None),
        (np.array([-1.0, 1.0, -0.0]), "000080bf0000803f00000080", None),
    ],
)
def test_float_box_observation_forms(value: Any, expected: str, warning: str | None) -> None:
    leaves, candidate = SpaceCodec(BOX).encode_observation(value, soft_checks=True)
    assert leaves == [h(expected)]
    if warning is None:
        assert candidate is None
    else:
        assert candidate == Candidate("observation", "$", f"$: Box value at {warning}")


@pytest.mark.parametrize(
    ("space", "value", "error", "message"),
    [
        (
            BOX,
            0.5,
            ValueError,
            "invalid box value: data is 4 bytes but shape and dtype require exactly 12",
        ),
        (
            BOX,
            np.zeros(2, f32),
            ValueError,
            "invalid box value: data is 8 bytes but shape and dtype require exactly 12",
        ),
        (BOX, np.array([np.nan, 0, 0]), ValueError, "$: Box value at element 0 is NaN"),
        (BOX, np.array([0, 0, np.nan], np.float16), ValueError, "$: Box value at element 2 is NaN"),
        (BOX, "abc", ValueError, "could not convert string to float: np.str_('abc')"),
        (
            BOX,
            [[1, 2], [3]],
            ValueError,
            "setting an array element with a sequence. The requested array has an inhomogeneous "
            "shape after 1 dimensions. The detected shape was (2,) + inhomogeneous part.",
        ),
    ],
)
def test_box_observation_errors(space: Any, value: Any, error: type, message: str) -> None:
    assert encode_error(space, value) == (error, message)


I16 = S.Box(-5, 5, (2,), np.int16)
NOT_INTEGRAL_I16 = "float value supplied for integer dtype int16 is not integral"
NOT_REPR_I16 = "value supplied for integer dtype int16 is not representable in its range"


@pytest.mark.parametrize(
    ("value", "outcome"),
    [
        (np.array([70000, 0]), NOT_REPR_I16),
        (np.array([1e10, 0.0]), NOT_REPR_I16),
        (np.array([np.nan, 0.0]), NOT_INTEGRAL_I16),
        (np.array([np.inf, 0.0]), NOT_INTEGRAL_I16),
        ([1.5, 0], NOT_INTEGRAL_I16),
        (np.array([6.5, 0, 0]), NOT_INTEGRAL_I16),  # conversion before the size check
        (np.array([2**63, 0], np.uint64), NOT_REPR_I16),
        ([1, 0], "01000000"),
        (np.array([True, False]), "01000000"),
        (np.array([2, 0], np.float16), "02000000"),
        (np.array([-0.0, 0.0]), "00000000"),
        (np.array([-128, 0], np.int8), "80ff0000"),
        (np.array([6.0, 0.0]), "06000000"),
    ],
)
def test_integer_box_observation_conversions(value: Any, outcome: str) -> None:
    if outcome.startswith(("float", "value")):
        assert encode_error(I16, value) == (ValueError, outcome)
    else:
        assert encode_one(I16, value) == [h(outcome)]


def test_other_integer_and_bool_box_conversions() -> None:
    u8 = S.Box(0, 255, (2,), np.uint8)
    repr_u8 = (
        ValueError,
        "value supplied for integer dtype uint8 is not representable in its range",
    )
    assert encode_error(u8, np.array([256, 0])) == repr_u8
    assert encode_error(u8, [-1, 0]) == repr_u8
    assert encode_one(u8, [255.0, 0.0]) == [h("ff00")]
    assert encode_one(u8, [True, False]) == [h("0100")]
    u64 = S.Box(0, 2**63, (1,), np.uint64)
    assert encode_one(u64, [2**63 + 1]) == [h("0100000000000080")]
    assert encode_one(u64, [1e19]) == [h("0000e8890423c78a")]
    assert encode_error(u64, np.array([-1])) == (
        ValueError,
        "value supplied for integer dtype uint64 is not representable in its range",
    )
    boolean = S.Box(0, 1, (2,), bool)
    for value in (np.array([2, 0], np.uint8), [1, 0], [1.0, 0.0], [0.5, 0.0], np.array([-1, 0])):
        assert encode_one(boolean, value) == [h("0100")]
    f16 = S.Box(-1, 1, (2,), np.float16)
    assert encode_one(f16, [0.1, 0.2]) == [h("662e6632")]
    assert encode_one(f16, [1, 0]) == [h("003c0000")]
    assert SpaceCodec(f16).encode_observation(np.array([1e5, 0.0]), soft_checks=True) == (
        [h("007c0000")],
        Candidate("observation", "$", "$: Box value at element 0 out of bounds: above high bound"),
    )


MB = S.MultiBinary(3)


def test_multi_binary_observation_conversions() -> None:
    assert encode_one(MB, [1, 0, 2]) == [h("010001")]
    assert encode_one(MB, np.array([[1, 0, 1]])) == [h("010001")]
    assert encode_one(MB, [True, False, True]) == [h("010001")]
    assert encode_one(MB, [2.0, 0, 0]) == [h("010000")]
    assert encode_one(MB, np.array([1, 0, 1], np.int64)) == [h("010001")]
    assert encode_error(MB, [1.0, 0.0, 0.5]) == (
        ValueError,
        "float value supplied for integer dtype uint8 is not integral",
    )
    assert encode_error(MB, [256, 0, 0]) == (
        ValueError,
        "value supplied for integer dtype uint8 is not representable in its range",
    )
    assert encode_error(MB, np.array([0, -1, 0], np.int8)) == (
        ValueError,
        "value supplied for integer dtype uint8 is not representable in its range",
    )
    assert encode_error(MB, 1) == (ValueError, "$: MultiBinary size mismatch: expected 3, got 1")
    two_d = S.MultiBinary((2, 2))
    assert encode_one(two_d, [1, 0, 1, 0]) == [h("01000100")]
    assert encode_error(two_d, [1, 0, 1]) == (
        ValueError,
        "$: MultiBinary size mismatch: expected 4, got 3",
    )


MD = S.MultiDiscrete([2, 3])


def test_multi_discrete_observation_conversions() -> None:
    expected = [h("0100000000000000 0200000000000000")]
    for value in (
        [1, 2],
        [1.0, 2.0],
        np.array([[1, 2]]),
        np.array([1, 2], np.int32),
        np.array([1, 2], np.uint64),
    ):
        assert encode_one(MD, value) == expected
    assert encode_error(MD, [1.5, 2.0]) == (
        ValueError,
        "float value supplied for integer dtype int64 is not integral",
    )
    assert encode_error(MD, np.array([2**64 - 1, 0], np.uint64)) == (
        ValueError,
        "value supplied for integer dtype int64 is not representable in its range",
    )
    assert encode_error(MD, [2, 0]) == (ValueError, "$: value[0] = 2 not in range [0, 2)")
    assert encode_error(MD, [0, -1]) == (ValueError, "$: value[1] = -1 not in range [0, 3)")
    assert encode_error(MD, [0, 0, 0]) == (
        ValueError,
        "$: MultiDiscrete size mismatch: expected 2, got 3",
    )
    two_d = S.MultiDiscrete([[2, 3], [4, 5]])
    assert encode_one(two_d, [[1, 2], [3, 4]]) == encode_one(two_d, [1, 2, 3, 4])
    assert encode_error(two_d, [[1, 2], [4, 4]]) == (
        ValueError,
        "$: value[2] = 4 not in range [0, 4)",
    )


def test_text_observation_conversions() -> None:
    expected = [text_slab("ab")]
    for value in ("ab", np.str_("ab"), np.array("ab"), type("Sub", (str,), {})("ab")):
        assert encode_one(TEXT, value) == expected
    assert encode_error(TEXT, 7) == (TypeError, "'int' object is not an instance of 'str'")
    assert encode_error(TEXT, b"ab") == (TypeError, "'bytes' object is not an instance of 'str'")
    assert encode_error(TEXT, ["a"]) == (TypeError, "'list' object is not an instance of 'str'")
    assert encode_error(TEXT, None) == (TypeError, "'None' is not an instance of 'str'")


def test_container_observation_forms_and_errors() -> None:
    pair = S.Tuple((S.Discrete(2), S.Discrete(3)))
    assert encode_one(pair, (1, 2)) == encode_one(pair, [1, 2]) == [le([1]), le([2])]
    assert encode_error(pair, (1, 2, 0)) == (ValueError, "Tuple space expected 2 items, got 3")
    assert encode_error(pair, 5) == (TypeError, "'int' object is not an instance of 'tuple'")
    ab = S.Dict({"a": S.Discrete(2), "b": S.Discrete(3)})
    assert encode_one(ab, {"a": 1, "b": 2}) == [le([1]), le([2])]
    assert encode_one(ab, OrderedDict([("b", 2), ("a", 1)])) == [le([1]), le([2])]
    assert encode_one(ab, {"a": 1, "b": 2, "c": 3, 3: 4}) == [le([1]), le([2])]
    missing = encode_error(ab, {"a": 1, "x": 2})
    assert missing == (KeyError, "\"missing dict key 'b'\"")
    assert encode_error(ab, (1, 2)) == (TypeError, "'tuple' object is not an instance of 'dict'")


def test_hard_errors_follow_wire_order_and_beat_soft_checks() -> None:
    codec = SpaceCodec(S.Dict({"box": BOX, "disc": DISC, "md": MD}))
    value = {"box": [2.0, 0, 0], "disc": 9, "md": [5, 5]}
    with pytest.raises(ValueError, match=r"^\$\.disc: value 9 not in range \[1, 4\)$"):
        codec.encode_observation(value, soft_checks=True)
    with pytest.raises(ValueError, match=r"^\$\.disc"):
        codec.check_observation(value)


# ---- soft checks -------------------------------------------------------------------------


def soft(space: Any, value: Any) -> str | None:
    candidate = SpaceCodec(space).check_observation(value)
    return None if candidate is None else candidate.detail


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        ([2, -2, 0], "$: Box value at element 0 out of bounds: above high bound"),
        ([0, -2, 2], "$: Box value at element 1 out of bounds: below low bound"),
        ([0, 0, 2], "$: Box value at element 2 out of bounds: above high bound"),
        ([-2, 0, 0], "$: Box value at element 0 out of bounds: below low bound"),
        ([np.inf, 0, 0], "$: Box value at element 0 out of bounds: above high bound"),
        ([0, -np.inf, 0], "$: Box value at element 1 out of bounds: below low bound"),
        ([2, 2, 2], "$: Box value at element 0 out of bounds: above high bound"),
        ([-1.0, 1.0, -0.0], None),
        ([0.0, 0.0, 0.0], None),
    ],
)
def test_box_soft_checks(value: Any, detail: str | None) -> None:
    assert soft(BOX, value) == detail


def test_box_soft_checks_other_shapes_and_bounds() -> None:
    box2d = S.Box(0, 1, (2, 2), f32)
    assert soft(box2d, [[0.5, -1], [0.5, 2]]) == (
        "$: Box value at element 1 out of bounds: below low bound"
    )
    elementwise = S.Box(np.array([0.0, -1.0]), np.array([1.0, 2.0]), dtype=np.float64)
    assert (
        soft(elementwise, [0.5, 2.5]) == "$: Box value at element 1 out of bounds: above high bound"
    )
    assert (
        soft(elementwise, [-0.5, 0]) == "$: Box value at element 0 out of bounds: below low bound"
    )
    assert soft(elementwise, [1.0, -1.0]) is None
    assert soft(I16, [6, 0]) == "$: Box value at element 0 out of bounds: above high bound"
    assert soft(I16, [0, -6]) == "$: Box value at element 1 out of bounds: below low bound"
    half = S.Box(0, np.inf, (2,), f32)
    assert soft(half, [np.inf, 0]) is None
    assert soft(half, [0, -np.inf]) == "$: Box value at element 1 out of bounds: below low bound"
    unbounded = S.Box(-np.inf, np.inf, (2,), f32)
    assert soft(unbounded, [np.inf, -np.inf]) is None
    # A full-range uint8 Box can never violate; a narrower one can.
    assert soft(S.Box(0, 255, (2,), np.uint8), [0, 255]) is None
    assert soft(S.Box(1, 254, (2,), np.uint8), [0, 255]) == (
        "$: Box value at element 0 out of bounds: below low bound"
    )
    assert soft(S.Box(0, 1, (2,), bool), [True, False]) is None
    assert soft(S.Box(0, 1, (2,), np.float16), [0.5, 1.5]) == (
        "$: Box value at element 1 out of bounds: above high bound"
    )
    assert soft(S.Box(0, 2**63, (1,), np.uint64), [2**63 + 1]) == (
        "$: Box value at element 0 out of bounds: above high bound"
    )


TEXT2 = S.Text(4, min_length=2, charset="abc")


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        ("abd", "$: character 'd' not in charset"),
        ("a", "$: text length 1 below minimum 2"),
        ("abcab", "$: text length 5 exceeds maximum 4"),
        ("dz", "$: character 'd' not in charset"),
        ("", "$: text length 0 below minimum 2"),
        ("abcad", "$: text length 5 exceeds maximum 4"),
        ("d", "$: text length 1 below minimum 2"),
        ("ééé", "$: character 'é' not in charset"),
        ("é", "$: text length 1 below minimum 2"),
        ("abca", None),
    ],
)
def test_text_soft_checks(value: str, detail: str | None) -> None:
    assert soft(TEXT2, value) == detail


def test_text_with_default_charset_checks_only_lengths() -> None:
    assert soft(S.Text(5), "é!") is None
    assert soft(S.Text(5), "abcdefg") == "$: text length 7 exceeds maximum 5"


CONF = S.Dict(
    {
        "box": BOX,
        "boxe": S.Box(np.array([0.0, -1.0]), np.array([1.0, 2.0]), dtype=np.float64),
        "txt": TEXT2,
        "nest": S.Dict(
            {
                "inner": S.Box(0, 1, (1,), f32),
                "t": S.Tuple((S.Text(3, charset="xy"), S.MultiDiscrete([4]))),
            }
        ),
        "pair": S.Tuple((S.Box(0, 1, (2,), f32), S.Discrete(2))),
    }
)
CONF_CLEAN = {
    "box": [0.0, 0.0, 0.0],
    "boxe": [0.5, 0.0],
    "txt": "ab",
    "nest": {"inner": [0.5], "t": ("x", [0])},
    "pair": ([0.5, 0.5], 0),
}


@pytest.mark.parametrize(
    ("changes", "path", "message"),
    [
        ({}, None, None),
        (
            {"box": [2, 0, 0], "txt": "zzzzz"},
            "$.box",
            "Box value at element 0 out of bounds: above high bound",
        ),
        (
            {"boxe": [0.5, 3.0], "txt": "zzzzz"},
            "$.boxe",
            "Box value at element 1 out of bounds: above high bound",
        ),
        (
            {"txt": "abcab", "nest": {"inner": [2.0], "t": ("x", [0])}},
            "$.nest.inner",
            "Box value at element 0 out of bounds: above high bound",
        ),
        (
            {"nest": {"inner": [0.5], "t": ("z", [0])}},
            "$.nest.t[0]",
            "character 'z' not in charset",
        ),
        (
            {"pair": ([1.5, 0.5], 0)},
            "$.pair[0]",
            "Box value at element 0 out of bounds: above high bound",
        ),
        (
            {"txt": "a", "pair": ([1.5, 0.5], 0)},
            "$.pair[0]",
            "Box value at element 0 out of bounds: above high bound",
        ),
        ({"txt": "a"}, "$.txt", "text length 1 below minimum 2"),
    ],
)
def test_first_violating_leaf_in_wire_order(
    changes: dict[str, Any], path: str | None, message: str | None
) -> None:
    codec = SpaceCodec(CONF)
    assert codec.leaf_paths == (
        "$.box",
        "$.boxe",
        "$.nest.inner",
        "$.nest.t[0]",
        "$.nest.t[1]",
        "$.pair[0]",
        "$.pair[1]",
        "$.txt",
    )
    value = {**CONF_CLEAN, **changes}
    expected = None if path is None else Candidate("observation", path, f"{path}: {message}")
    assert codec.encode_observation(value, soft_checks=True)[1] == expected
    assert codec.check_observation(value) == expected
    action = codec.check_action(value)
    assert action == (None if path is None else Candidate("action", path, f"{path}: {message}"))
    assert codec.encode_observation(value, soft_checks=False)[1] is None


def test_ordered_dict_is_walked_in_sorted_key_order() -> None:
    space = S.Dict(OrderedDict([("z", S.Box(0, 1, (1,), f32)), ("a", S.Box(0, 1, (1,), f32))]))
    candidate = SpaceCodec(space).check_observation({"z": [2.0], "a": [2.0]})
    assert candidate == Candidate(
        "observation", "$.a", "$.a: Box value at element 0 out of bounds: above high bound"
    )


def test_observation_batch_round_trip() -> None:
    codec = SpaceCodec(CONF)
    values = [CONF_CLEAN, {**CONF_CLEAN, "txt": "ca", "pair": ([0.25, 1.0], 1)}]
    batch = codec.encode_batch(values)
    assert batch == codec.join([codec.encode(v) for v in values])
    decoded = codec.decode(batch, 2)
    assert decoded[1]["txt"] == "ca" and decoded[1]["pair"][1] == 1
    assert decoded[1]["pair"][0].tolist() == [0.25, 1.0]
    assert codec.encode_batch(decoded) == batch


_PLAN_SPACES = [
    S.Discrete(5, start=-2),
    S.Box(np.array([-1.0, -np.inf, 0.0], f32), np.array([1.0, np.inf, 0.5], f32), dtype=f32),
    S.Box(-2.0, 2.0, (2, 3), np.float64),
    S.Box(0, 10, (4,), np.int32),
    S.Box(0, 1, (3,), np.bool_),
    S.Box(-1.0, 1.0, (100,), f32),  # more than SMALL_BOX elements: numpy's checks
    S.MultiBinary(4),
    S.MultiDiscrete([3, 4]),
    S.Text(4, charset="abc"),
]


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """What a call returns, or its exception's type and text (for comparing two paths)."""
    try:
        return ("value", fn(*args, **kwargs))
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(type(a) is type(b) and a == b)


def _unwrapped(result: Any) -> Any:
    """A Tuple((space,)) codec's answer as the bare space's: the value out of its tuple,
    the candidate's path ``$[0]`` read as ``$``."""
    if result[0] == "error":
        return result[0], result[1], result[2].replace("$[0]", "$")
    value, candidate = result[1]
    if isinstance(value, tuple):
        value = value[0]
    elif isinstance(value, list):
        value = value
    if candidate is not None:
        candidate = (candidate.kind, candidate.detail.replace("$[0]", "$"))
    return "value", (value, candidate)


def _plain(result: Any) -> Any:
    if result[0] == "error":
        return result
    value, candidate = result[1]
    if candidate is not None:
        candidate = (candidate.kind, candidate.detail)
    return "value", (value, candidate)


@pytest.mark.parametrize("space", _PLAN_SPACES, ids=lambda s: repr(s)[:40])
def test_the_step_plan_answers_as_the_generic_tree(space: Any) -> None:
    """A one-leaf space's per-step plan (``step_action``, ``encode_observation``) gives
    the answers and error texts of the generic tree walk (the same space inside a Tuple),
    for good, out-of-bounds and malformed values."""
    plan, tree = SpaceCodec(space), SpaceCodec(S.Tuple((space,)))
    space.seed(7)
    rng = np.random.default_rng(7)
    observations: list[Any] = [space.sample() for _ in range(20)]
    if isinstance(space, S.Box):
        for _ in range(10):  # out of bounds, NaN (floats), wrong sizes and types
            bad = (rng.normal(size=space.shape) * 10).astype(space.dtype)
            observations.append(bad)
        if space.dtype.kind == "f":
            nan = np.zeros(space.shape, space.dtype)
            nan.reshape(-1)[-1] = np.nan
            observations.append(nan)
        observations += [np.zeros(7, space.dtype), np.zeros(space.shape, np.float64), "x"]
    observations += [None, 3.5, [1, 2]]
    for value in observations:
        got = _plain(_outcome(plan.encode_observation, value, soft_checks=True))
        want = _unwrapped(_outcome(tree.encode_observation, (value,), soft_checks=True))
        assert _same(got, want), (value, got, want)
    slabs: list[tuple[bytes, int]] = []
    for n in (1, 2, 3):
        for _ in range(5):
            good = plan.encode_batch([space.sample() for _ in range(n)])[0]
            noisy = bytes(rng.integers(0, 256, size=len(good), dtype=np.uint8))
            slabs += [(good, n), (noisy, n), (good[:-1], n), (good + b"\0", n)]
    slabs += [(b"", 1), (b"\xff" * 8, 1)]
    for slab, n in slabs:
        for row in range(n):
            got = _plain(
                _outcome(plan.step_action, [slab], n, row, validated=False, soft_checks=True)
            )
            want = _unwrapped(_outcome(_tree_step, tree, [slab], n, row))
            assert _same(got, want), (slab, n, row, got, want)
    for leaves in (None, [], [b"", b""]):
        got = _outcome(plan.step_action, leaves, 1, 0, validated=False, soft_checks=True)
        want = _outcome(_tree_step, plan, leaves, 1, 0)
        assert got[0] == want[0] == "error" and got[1:] == want[1:]


def _tree_step(codec: SpaceCodec, leaves: Any, n: int, row: int) -> Any:
    codec.validate_action(leaves, n)
    return codec.decode_action(leaves, n, row, soft_checks=True)
