"""Property tests: random nested spaces (depth <= 3, every leaf kind and dtype), sampled values."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmesh_trio._codec import SpaceCodec, space_to_spec, spec_to_space
from rlmesh_trio._errors import ActionError

S = gym.spaces

DTYPES = [
    np.dtype(name)
    for name in (
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
]
CHARSETS = [None, "ab", "xyz", "abcé", "0123456789", "a€z"]
KEYS = st.text(alphabet="abcdz_", min_size=1, max_size=3)
SETTINGS = settings(max_examples=120, deadline=None, database=None)


@st.composite
def box_spaces(draw: st.DrawFn) -> Any:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    numel = int(np.prod(shape))
    if dtype.kind == "b":
        return S.Box(np.zeros(shape, dtype), np.ones(shape, dtype), dtype=dtype)
    elementwise = draw(st.booleans())
    count = numel if elementwise else 1
    if dtype.kind == "f":
        kind = draw(st.sampled_from(["bounded", "unbounded", "low-only", "high-only"]))
        if kind == "unbounded":
            return S.Box(-np.inf, np.inf, shape, dtype)
        lows = np.array(draw(st.lists(st.integers(-20, 20), min_size=count, max_size=count)), dtype)
        widths = np.array(draw(st.lists(st.integers(0, 20), min_size=count, max_size=count)), dtype)
        low, high = lows / dtype.type(4), (lows + widths) / dtype.type(4)
        if kind == "low-only":
            high = np.full(count, np.inf, dtype)
        elif kind == "high-only":
            low = np.full(count, -np.inf, dtype)
    else:
        info = np.iinfo(dtype)
        floor = max(int(info.min), -100)
        lows_i = draw(st.lists(st.integers(floor, 100), min_size=count, max_size=count))
        widths_i = draw(st.lists(st.integers(0, 50), min_size=count, max_size=count))
        low = np.array(lows_i, dtype)
        tops = [min(a + b, int(info.max)) for a, b in zip(lows_i, widths_i, strict=True)]
        high = np.array(tops, dtype)
    low = np.broadcast_to(low, (numel,)).reshape(shape).astype(dtype)
    high = np.broadcast_to(high, (numel,)).reshape(shape).astype(dtype)
    return S.Box(low, high, shape, dtype)


@st.composite
def leaf_spaces(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["box", "discrete", "multi_binary", "multi_discrete", "text"]))
    if kind == "box":
        return draw(box_spaces())
    if kind == "discrete":
        return S.Discrete(draw(st.integers(1, 6)), start=draw(st.integers(-3, 3)))
    if kind == "multi_binary":
        if draw(st.booleans()):
            return S.MultiBinary(draw(st.integers(1, 5)))
        return S.MultiBinary(draw(st.lists(st.integers(1, 3), min_size=2, max_size=2)))
    if kind == "multi_discrete":
        nvec = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
        if len(nvec) == 4 and draw(st.booleans()):
            return S.MultiDiscrete(np.array(nvec).reshape(2, 2))
        return S.MultiDiscrete(nvec)
    max_length = draw(st.integers(1, 6))
    min_length = draw(st.integers(1, max_length))
    charset = draw(st.sampled_from(CHARSETS))
    if charset is None:
        return S.Text(max_length, min_length=min_length)
    return S.Text(max_length, min_length=min_length, charset=charset)


def spaces(depth: int) -> st.SearchStrategy[Any]:
    if depth == 0:
        return leaf_spaces()
    child = spaces(depth - 1)
    return st.one_of(
        leaf_spaces(),
        st.dictionaries(KEYS, child, max_size=3).map(S.Dict),
        st.lists(child, max_size=3).map(lambda items: S.Tuple(tuple(items))),
    )


def assert_decoded(decoded: Any, sample: Any, space: Any) -> None:
    """``decoded`` is ``sample`` in the codec's canonical types."""
    if isinstance(space, S.Dict):
        assert type(decoded) is dict
        assert list(decoded) == sorted(space.spaces)
        for key, child in space.spaces.items():
            assert_decoded(decoded[key], sample[key], child)
    elif isinstance(space, S.Tuple):
        assert type(decoded) is tuple and len(decoded) == len(space.spaces)
        for got, item, child in zip(decoded, sample, space.spaces, strict=True):
            assert_decoded(got, item, child)
    elif isinstance(space, S.Discrete):
        assert type(decoded) is int and decoded == int(sample)
    elif isinstance(space, S.Text):
        assert type(decoded) is str and decoded == sample
    else:
        expected_dtype = {S.MultiBinary: np.uint8, S.MultiDiscrete: np.int64}.get(
            type(space), space.dtype
        )
        assert isinstance(decoded, np.ndarray)
        assert decoded.dtype == expected_dtype
        assert decoded.shape == space.shape
        assert not decoded.flags.writeable
        assert np.array_equal(decoded, np.asarray(sample, dtype=expected_dtype))


@SETTINGS
@given(space=spaces(3))
def test_spec_round_trip(space: Any) -> None:
    spec = space_to_spec(space)
    back = spec_to_space(spec)
    assert back == space
    assert bytes(space_to_spec(back)) == bytes(spec)


@SETTINGS
@given(space=spaces(3), lanes=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_sampled_values_round_trip(space: Any, lanes: int, seed: int) -> None:
    space.seed(seed)
    values = [space.sample() for _ in range(lanes)]
    codec = SpaceCodec(space)
    batch = codec.encode_batch(values)
    assert len(batch) == codec.num_leaves
    assert codec.join([codec.encode(value) for value in values]) == batch
    codec.validate_action(batch, lanes)
    decoded = codec.decode(batch, lanes)
    assert len(decoded) == lanes
    for row, (got, value) in enumerate(zip(decoded, values, strict=True)):
        assert_decoded(got, value, space)
        action, candidate = codec.decode_action(batch, lanes, row, soft_checks=True)
        assert candidate is None
        assert_decoded(action, value, space)
        # Values drawn from the space conform to it.
        assert codec.check_observation(value) is None
        leaves, warning = codec.encode_observation(value, soft_checks=True)
        assert warning is None
        assert leaves == codec.encode(got)
    assert codec.encode_batch(decoded) == batch
    if codec.num_leaves:
        # N is an input: the same slabs read as another lane count are refused.
        with pytest.raises(ActionError, match=r"^length mismatch"):
            codec.validate_action(batch, lanes + 1)
