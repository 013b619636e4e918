"""gymnasium spaces <-> SpaceSpec (SPEC §4): the goldens' specs, and facts measured on rlmesh 0.1.0."""

from __future__ import annotations

import inspect
import json
from collections import OrderedDict
from functools import cache
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from rlmesh_trio._codec import SpaceCodec, space_to_spec, spec_to_space
from rlmesh_trio._errors import UnsupportedSpaceError
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1

S = gym.spaces
GOLDENS = Path(__file__).resolve().parent / "goldens"


@cache
def golden_specs() -> dict[str, tuple[spaces_v1.SpaceSpec, str]]:
    """Every distinct action/observation SpaceSpec of a captured HandshakeResponse.

    Maps an id (``<scenario>:<which>``) to the parsed spec and the captured message hex.
    """
    found: dict[bytes, tuple[str, spaces_v1.SpaceSpec, str]] = {}
    for path in sorted(GOLDENS.glob("*.jsonl")):
        with path.open(encoding="utf-8") as stream:
            for line in stream:
                record = json.loads(line)
                if record.get("msg_type") != "env.HandshakeResponse" or "hex" not in record:
                    continue
                response = env_v1.HandshakeResponse.parse(bytes.fromhex(record["hex"]))
                contract = response.env_contract
                if contract is None or contract.spec is None:
                    continue
                for which in ("action_space", "observation_space"):
                    spec = getattr(contract.spec, which)
                    found.setdefault(bytes(spec), (f"{path.stem}:{which}", spec, record["hex"]))
    return {name: (spec, hex_) for name, spec, hex_ in found.values()}


THIRD_PARTY = ("fake_server_", "grpclib_server_")
"""Scenarios whose server is not the reference (its specs need not be canonical)."""

REFERENCE_SPECS = sorted(name for name in golden_specs() if not name.startswith(THIRD_PARTY))
THIRD_PARTY_SPECS = sorted(name for name in golden_specs() if name.startswith(THIRD_PARTY))


def test_goldens_hold_many_specs() -> None:
    # Guards the parametrisation below against silently finding nothing.
    assert len(REFERENCE_SPECS) >= 12


@pytest.mark.parametrize("name", REFERENCE_SPECS)
def test_golden_spec_round_trips_to_the_same_bytes(name: str) -> None:
    spec, captured_hex = golden_specs()[name]
    canonical = bytes(spec)
    # The re-encoded spec is the very byte string the reference put on the wire.
    assert canonical.hex() in captured_hex
    space = spec_to_space(spec)
    again = space_to_spec(space)
    assert bytes(again) == canonical
    assert spec_to_space(again) == space
    codec = SpaceCodec(space)
    assert bytes(codec.spec) == canonical


@pytest.mark.parametrize("name", THIRD_PARTY_SPECS)
def test_third_party_specs_mean_the_same_space(name: str) -> None:
    # A hand-written server sent uniform bounds [-inf, inf]; the reference would call
    # that ``unbounded``. Same space, canonical bytes differ.
    spec, _ = golden_specs()[name]
    space = spec_to_space(spec)
    canonical = space_to_spec(space)
    assert spec_to_space(canonical) == space
    assert canonical.box is not None and canonical.box.unbounded


# Measured: rlmesh.EnvServer(env) with env.observation_space = <space>, then a Handshake;
# the hex is the env_contract's observation_space as the reference sent it.
REFERENCE_SPEC_BYTES: list[tuple[str, Any, str]] = [
    ("text-default-charset", S.Text(5), "1002720408011005"),
    ("text-charset-sorted", S.Text(5, charset="cbaé"), "1002720b080110051a05616263c3a9"),
    ("text-digits", S.Text(5, charset="0123456789"), "10027210080110051a0a30313233343536373839"),
    ("box-scalar-top-level", S.Box(0, 1, (), np.float32), "100b520e120c0a040000000012040000803f"),
    ("box-scalar-int16", S.Box(0, 1, (), np.int16), "1007520a12080a02000012020100"),
    ("box-scalar-unbounded", S.Box(-np.inf, np.inf, (), np.float32), "100b52020801"),
    ("box-empty", S.Box(0, 1, (0,), np.float32), "0a0100100b52020801"),
    (
        "box-uniform-low-only",
        S.Box(np.array([0, 0], np.float32), np.array([1, 2], np.float32)),
        "0a0102100b52161a140a08000000000000000012080000803f00000040",
    ),
    ("box-f16-unbounded", S.Box(-np.inf, np.inf, (2,), np.float16), "0a0102100a52020801"),
    ("box-int8", S.Box(-5, 5, (2,), np.int8), "0a01021006520812060a01fb120105"),
    (
        "box-int64-full",
        S.Box(np.iinfo(np.int64).min, np.iinfo(np.int64).max, (1,), np.int64),
        "0a01011009521612140a0800000000000000801208ffffffffffffff7f",
    ),
    (
        "box-uint64-full",
        S.Box(0, np.iinfo(np.uint64).max, (1,), np.uint64),
        "0a01011005521612140a0800000000000000001208ffffffffffffffff",
    ),
    (
        "box-uint64-2^63",
        S.Box(0, 2**63, (1,), np.uint64),
        "0a01011005521612140a08000000000000000012080000000000000080",
    ),
    ("box-bool", S.Box(0, 1, (2,), bool), "0a01021001520812060a0100120101"),
    (
        "box-half-unbounded-elementwise",
        S.Box(np.array([0, -np.inf], np.float32), np.array([np.inf, np.inf], np.float32)),
        "0a0102100b52161a140a0800000000000080ff12080000807f0000807f",
    ),
    (
        "box-negative-zero",
        S.Box(np.float32(-0.0), np.float32(0.0), (2,), np.float32),
        "0a0102100b520e120c0a0400000080120400000000",
    ),
    ("discrete-1", S.Discrete(1), "10095a020801"),
    ("dict-empty", S.Dict({}), "a20100"),
    ("tuple-empty", S.Tuple(()), "aa0100"),
    (
        "dict-nested-sorted",
        S.Dict({"b": S.Discrete(2), "a": S.Dict({"y": S.Discrete(3), "x": S.Discrete(4)})}),
        "a201290a01610a01621219a201160a01780a0179120610095a020804120610095a020803120610095a020802",
    ),
]


@pytest.mark.parametrize(
    ("space", "expected"),
    [pytest.param(space, hex_, id=name) for name, space, hex_ in REFERENCE_SPEC_BYTES],
)
def test_space_to_spec_matches_the_reference(space: Any, expected: str) -> None:
    assert bytes(space_to_spec(space)).hex() == expected


@pytest.mark.parametrize(
    "space",
    [pytest.param(space, id=name) for name, space, _ in REFERENCE_SPEC_BYTES],
)
def test_reference_spaces_round_trip(space: Any) -> None:
    spec = space_to_spec(space)
    back = spec_to_space(spec)
    assert back == space
    assert bytes(space_to_spec(back)) == bytes(spec)


def test_spec_examples_from_the_spec_text() -> None:
    # SPEC §4.1 / §4.3 / §13.12: oneof arms are emitted even when empty or default.
    mb = space_to_spec(S.MultiBinary(3))
    assert bytes(mb).hex() == "0a010310026200"
    unbounded = space_to_spec(S.Box(-np.inf, np.inf, (2,), np.float32))
    assert bytes(unbounded.box).hex() == "0801"
    # Box(0, inf, f32): uniform low 00000000, high 0000807f.
    half = space_to_spec(S.Box(0, np.inf, (2,), np.float32)).box
    assert half is not None and half.uniform is not None
    assert (half.uniform.low.hex(), half.uniform.high.hex()) == ("00000000", "0000807f")
    # CartPole's observation space: elementwise bounds.
    cartpole = gym.make("CartPole-v1")
    try:
        bounds = space_to_spec(cartpole.observation_space).box
    finally:
        cartpole.close()
    assert bounds is not None and bounds.elementwise is not None
    assert bounds.elementwise.low.hex() == "9a9999c0000080ff5077d6be000080ff"
    assert bounds.elementwise.high.hex() == "9a9999400000807f5077d63e0000807f"
    # Discrete: INT64 whatever the gym dtype (a parameter since gymnasium 1.4), start
    # omitted when 0, negative allowed.
    if "dtype" in inspect.signature(S.Discrete).parameters:
        assert bytes(space_to_spec(S.Discrete(3, dtype=np.int32))) == bytes(
            space_to_spec(S.Discrete(3))
        )
    assert bytes(space_to_spec(S.Discrete(3, start=-1))).hex() == (
        "10095a0d080310ffffffffffffffffff01"
    )
    # MultiDiscrete: nvec flattened row-major, shape on the SpaceSpec.
    md = space_to_spec(S.MultiDiscrete([[2, 3], [4, 5]]))
    assert md.shape == [2, 2] and md.multi_discrete is not None
    assert md.multi_discrete.nvec == [2, 3, 4, 5]
    assert md.dtype == spaces_v1.DataType.INT64
    # MultiBinary 2-D keeps its shape.
    assert space_to_spec(S.MultiBinary([2, 2])).shape == [2, 2]


@pytest.mark.parametrize(
    ("dtype", "wire"),
    [
        (np.bool_, spaces_v1.DataType.BOOL),
        (np.uint8, spaces_v1.DataType.UINT8),
        (np.uint16, spaces_v1.DataType.UINT16),
        (np.uint32, spaces_v1.DataType.UINT32),
        (np.uint64, spaces_v1.DataType.UINT64),
        (np.int8, spaces_v1.DataType.INT8),
        (np.int16, spaces_v1.DataType.INT16),
        (np.int32, spaces_v1.DataType.INT32),
        (np.int64, spaces_v1.DataType.INT64),
        (np.float16, spaces_v1.DataType.FLOAT16),
        (np.float32, spaces_v1.DataType.FLOAT32),
        (np.float64, spaces_v1.DataType.FLOAT64),
    ],
)
def test_every_box_dtype_and_bounds_kind_round_trips(dtype: Any, wire: Any) -> None:
    dt = np.dtype(dtype)
    if dt.kind == "b":
        low_u, high_u = np.zeros(3, dt), np.ones(3, dt)
        low_e, high_e = np.array([0, 1, 0], dt), np.array([1, 1, 0], dt)
    else:
        low_u, high_u = np.full(3, 1, dt), np.full(3, 7, dt)
        low_e, high_e = np.array([0, 1, 2], dt), np.array([5, 6, 7], dt)
    candidates = [
        (S.Box(low_u, high_u, dtype=dt), "uniform"),
        (S.Box(low_e, high_e, dtype=dt), "elementwise"),
    ]
    if dt.kind == "f":
        candidates.append((S.Box(-np.inf, np.inf, (3,), dt), "unbounded"))
    for space, kind in candidates:
        spec = space_to_spec(space)
        assert spec.dtype == wire
        assert spec.shape == [3]
        assert spec.box is not None
        assert getattr(spec.box, kind) is not None, kind
        back = spec_to_space(spec)
        assert back == space
        assert back.dtype == dt
        assert bytes(space_to_spec(back)) == bytes(spec)


def test_bounds_are_exact_in_the_box_dtype() -> None:
    spec = space_to_spec(S.Box(-2, 2, (1,), np.float16))
    assert spec.box is not None and spec.box.uniform is not None
    assert (spec.box.uniform.low.hex(), spec.box.uniform.high.hex()) == ("00c0", "0040")
    elementwise = space_to_spec(
        S.Box(np.array([-1.0, 0.0]), np.array([1.0, np.inf]), dtype=np.float64)
    ).box
    assert elementwise is not None and elementwise.elementwise is not None
    assert elementwise.elementwise.low.hex() == "000000000000f0bf0000000000000000"
    assert elementwise.elementwise.high.hex() == "000000000000f03f000000000000f07f"
    big = spec_to_space(space_to_spec(S.Box(0, 2**63, (1,), np.uint64)))
    assert int(big.high[0]) == 2**63


def test_dict_keys_are_sorted_even_from_an_ordered_dict() -> None:
    space = S.Dict(OrderedDict([("zeta", S.Discrete(2)), ("alpha", S.Discrete(3))]))
    spec = space_to_spec(space)
    assert spec.dict is not None
    assert spec.dict.keys == ["alpha", "zeta"]
    assert [child.discrete.n for child in spec.dict.spaces if child.discrete] == [3, 2]
    assert SpaceCodec(space).leaf_paths == ("$.alpha", "$.zeta")


def test_text_charset_default_and_back() -> None:
    default = space_to_spec(S.Text(5))
    assert default.text is not None and default.text.charset == ""
    back = spec_to_space(default)
    assert back == S.Text(5)
    custom = spec_to_space(space_to_spec(S.Text(4, min_length=2, charset="cab")))
    assert custom == S.Text(4, min_length=2, charset="abc")


def test_nested_spaces_round_trip() -> None:
    space = S.Dict(
        {
            "pos": S.Box(-1, 1, (2, 3), np.float32),
            "inner": S.Tuple(
                (
                    S.Dict({"t": S.Text(3, charset="xy"), "md": S.MultiDiscrete([4, 2])}),
                    S.MultiBinary([2, 2]),
                    S.Discrete(5, start=-2),
                )
            ),
        }
    )
    spec = space_to_spec(space)
    assert spec_to_space(spec) == space
    assert SpaceCodec(space).leaf_paths == (
        "$.inner[0].md",
        "$.inner[0].t",
        "$.inner[1]",
        "$.inner[2]",
        "$.pos",
    )


# Refusals: the first two texts are the reference's EnvServer construction errors.
@pytest.mark.parametrize(
    ("space", "message"),
    [
        pytest.param(S.Text(5, min_length=0), "$: [Text] min_length must be > 0", id="text-min0"),
        pytest.param(
            S.Dict({"a": S.Box(0, 1, (), np.float32)}),
            "$.a: [Box] shape must be set (rank >= 1)",
            id="nested-scalar-box",
        ),
        pytest.param(
            S.Tuple((S.Box(0, 1, (), np.float32),)),
            "$[0]: [Box] shape must be set (rank >= 1)",
            id="tuple-scalar-box",
        ),
        pytest.param(
            S.Dict({"": S.Discrete(2), "b": S.Discrete(2)}),
            "$: [Dict] keys must be non-empty",
            id="empty-key",
        ),
        pytest.param(
            S.Dict({"pos": S.Graph(S.Box(0, 1, (2,)), None)}),
            "unsupported space at $.pos: Graph",
            id="graph",
        ),
        pytest.param(
            S.Tuple((S.Discrete(2), S.Sequence(S.Discrete(2)))),
            "unsupported space at $[1]: Sequence",
            id="sequence",
        ),
        pytest.param(
            S.OneOf((S.Discrete(2), S.Discrete(3))), "unsupported space at $: OneOf", id="oneof"
        ),
        pytest.param(
            S.Dict({"md": S.MultiDiscrete([3, 4], start=[1, 2])}),
            "unsupported space at $.md: MultiDiscrete with a non-zero start",
            id="multidiscrete-start",
        ),
        pytest.param(
            S.Dict({1: S.Discrete(2)}),
            "unsupported space at $: Dict key 1 is not a str",
            id="int-key",
        ),
    ],
)
def test_unsupported_spaces_are_refused_with_their_path(space: Any, message: str) -> None:
    with pytest.raises(UnsupportedSpaceError) as info:
        space_to_spec(space)
    assert str(info.value).startswith(message)
    with pytest.raises(UnsupportedSpaceError):
        SpaceCodec(space)


def test_box_with_unsupported_dtype_is_refused() -> None:
    space = S.Box(0, 1, (2,), np.float32)
    space.dtype = np.dtype(np.complex64)  # gymnasium itself refuses to build one
    with pytest.raises(
        UnsupportedSpaceError, match=r"^unsupported space at \$: Box dtype complex64"
    ):
        space_to_spec(space)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param(spaces_v1.SpaceSpec(), "SpaceSpec without a known kind", id="no-kind"),
        pytest.param(
            spaces_v1.SpaceSpec(
                shape=[2],
                dtype=spaces_v1.DataType.FLOAT32,
                box=spaces_v1.BoxSpec(uniform=spaces_v1.UniformBounds(low=b"\0", high=b"\0")),
            ),
            "malformed SpaceSpec: Box uniform low is 1 bytes",
            id="short-uniform",
        ),
        pytest.param(
            spaces_v1.SpaceSpec(
                shape=[2],
                dtype=spaces_v1.DataType.UNSPECIFIED,
                box=spaces_v1.BoxSpec(unbounded=True),
            ),
            "Box with data type",
            id="box-without-dtype",
        ),
        pytest.param(
            spaces_v1.SpaceSpec(dict=spaces_v1.DictSpec(keys=["a", "b"], spaces=[])),
            "malformed SpaceSpec: Dict has 2 keys but 0 spaces",
            id="dict-keys-vs-spaces",
        ),
        pytest.param(
            spaces_v1.SpaceSpec(
                shape=[3],
                dtype=spaces_v1.DataType.INT64,
                multi_discrete=spaces_v1.MultiDiscreteSpec(nvec=[2, 2]),
            ),
            "malformed SpaceSpec: MultiDiscrete nvec has 2 entries",
            id="nvec-vs-shape",
        ),
    ],
)
def test_spec_to_space_refuses_malformed_specs(spec: spaces_v1.SpaceSpec, message: str) -> None:
    with pytest.raises(UnsupportedSpaceError, match="unsupported space at \\$") as info:
        spec_to_space(spec)
    assert message in str(info.value)


def test_unbounded_integer_spec_becomes_the_dtype_range() -> None:
    spec = spaces_v1.SpaceSpec(
        shape=[2], dtype=spaces_v1.DataType.INT16, box=spaces_v1.BoxSpec(unbounded=True)
    )
    space = spec_to_space(spec)
    assert space.low.tolist() == [-32768, -32768]
    assert space.high.tolist() == [32767, 32767]


def test_codec_from_spec() -> None:
    spec = space_to_spec(S.Tuple((S.Discrete(3), S.Text(4, charset="ab"))))
    codec = SpaceCodec.from_spec(spec)
    assert bytes(codec.spec) == bytes(spec)
    assert codec.num_leaves == 2


class _FakeMissionSpace(gym.spaces.Space[str]):
    """Shaped like minigrid.core.mission.MissionSpace (recognised by name and module)."""

    def __init__(self, func: Any, placeholders: list[list[str]] | None) -> None:
        super().__init__()
        self.mission_func = func
        self.ordered_placeholders = placeholders


_FakeMissionSpace.__name__ = "MissionSpace"
_FakeMissionSpace.__module__ = "minigrid.core.mission"


def test_a_minigrid_mission_space_is_served_as_text_holding_every_mission() -> None:
    from rlmesh_trio._codec._minigrid import MISSION_FALLBACK_MAX_LENGTH, mission_text_space

    space = _FakeMissionSpace(
        lambda color, obj: f"pick up the {color} {obj}",
        [["red", "green"], ["ball", "key"]],
    )
    spec = space_to_spec(space)
    assert spec.text is not None
    missions = [f"pick up the {c} {o}" for c in ("red", "green") for o in ("ball", "key")]
    assert spec.text.min_length == min(map(len, missions))
    assert spec.text.max_length == max(map(len, missions))
    assert set(spec.text.charset) == set("".join(missions))
    codec = SpaceCodec(gym.spaces.Dict({"mission": space}))
    assert codec.encode({"mission": "pick up the red key"})
    fixed = mission_text_space(_FakeMissionSpace(lambda: "get to the goal", None))
    assert (fixed.min_length, fixed.max_length) == (15, 15)
    free = mission_text_space(_FakeMissionSpace(None, None))  # not enumerable: printable ASCII
    assert free.max_length == MISSION_FALLBACK_MAX_LENGTH and "~" in free.character_set


def test_an_unsupported_space_names_its_path_and_suggests_a_wrapper() -> None:
    class Odd(gym.spaces.Space[Any]):
        pass

    with pytest.raises(UnsupportedSpaceError, match=r"at \$\.x: Odd .*wrap the env"):
        space_to_spec(gym.spaces.Dict({"x": Odd()}))
