"""gymnasium spaces <-> ``SpaceSpec``, and values <-> ``SpaceValue`` leaves (SPEC §3, §4).

Spaces (SPEC §4): Box (12 dtypes; ``unbounded`` / ``uniform`` / ``elementwise`` bounds),
Discrete, MultiBinary, MultiDiscrete, Text, Dict (keys sorted on the wire) and Tuple,
nested to any depth. Anything else raises :class:`UnsupportedSpaceError` naming the path.
Like the reference, a Box of shape ``()`` is served only as the whole space (no ``shape``
on the wire); inside a Dict or Tuple it is refused ("[Box] shape must be set (rank >= 1)").
Also refused: Text with ``min_length`` 0, Dict keys that are empty or not strings, and a
MultiDiscrete with a non-zero ``start`` (``MultiDiscreteSpec`` has no start; the reference
silently drops it and then misreads the values). Not expressible, so not round-tripped:
a Discrete / MultiDiscrete dtype other than int64 (the wire always says INT64) and
``MultiBinary([n])`` vs ``MultiBinary(n)`` (both come back as ``MultiBinary(n)``). A Text
with gymnasium's default (alphanumeric) charset goes out with no charset, as the
reference sends it, and an empty charset comes back as that default.

Values (SPEC §3): one leaf per fundamental space in pre-order (Dict children in sorted
key order, Tuple children by index); each leaf is the row-major ``(N, *shape)`` slab,
little-endian; Text is always ``u64 count ‖ count x u64 length ‖ UTF-8 bodies``. ``N`` is
always given by the caller, never inferred from byte lengths.

What an env receives as its action (measured on rlmesh 0.1.0's ``EnvServer`` with a
recording env, numpy backend, one and two lanes, whole and lane-scoped steps), and what
:meth:`SpaceCodec.decode_action` therefore returns:

* Box: ``numpy.ndarray`` of the Box dtype and shape, **read-only** (a view of the request
  bytes; a bool byte other than 0/1 reads as True);
* Discrete: a Python ``int`` (the raw value, ``start`` not subtracted), whatever the
  space's numpy dtype;
* MultiBinary: read-only ``uint8`` array of the space's shape, every non-zero byte
  delivered as 1;
* MultiDiscrete: read-only ``int64`` array of the nvec shape (also for an int32 nvec);
* Text: ``str``;
* Dict: a plain ``dict`` whose keys are in the wire's sorted order (also when the space
  was built from an OrderedDict in another order); Tuple: a ``tuple``.

Envs that modify their action in place must copy it first - as with the reference.
"""

from __future__ import annotations

import string
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import betterproto2
import gymnasium as gym
import numpy as np

from .._errors import ActionError, UnsupportedSpaceError, not_instance
from .._proto.rlmesh.spaces import v1 as spaces_v1
from ._conformance import ACTION, OBSERVATION, Candidate, make_candidate
from ._leaves import (
    BoxLeaf,
    DiscreteLeaf,
    Leaf,
    MultiBinaryLeaf,
    MultiDiscreteLeaf,
    TextLeaf,
)
from ._minigrid import is_mission_space, mission_text_space

__all__ = ["SpaceCodec", "space_to_spec", "spec_to_space"]

_DataType = spaces_v1.DataType

_DTYPES: Final[dict[str, _DataType]] = {
    "bool": _DataType.BOOL,
    "uint8": _DataType.UINT8,
    "uint16": _DataType.UINT16,
    "uint32": _DataType.UINT32,
    "uint64": _DataType.UINT64,
    "int8": _DataType.INT8,
    "int16": _DataType.INT16,
    "int32": _DataType.INT32,
    "int64": _DataType.INT64,
    "float16": _DataType.FLOAT16,
    "float32": _DataType.FLOAT32,
    "float64": _DataType.FLOAT64,
}
_NUMPY_DTYPES: Final[dict[_DataType, np.dtype[Any]]] = {
    wire: np.dtype(name).newbyteorder("<") for name, wire in _DTYPES.items()
}

_GYM_DEFAULT_CHARSET: Final = frozenset(string.ascii_letters + string.digits)
"""gymnasium's default Text charset; served as "no charset", like the reference."""

_ROOT: Final = "$"


# ---- gymnasium space -> SpaceSpec --------------------------------------------------------


def space_to_spec(space: gym.spaces.Space[Any]) -> spaces_v1.SpaceSpec:
    """The wire description of ``space`` (SPEC §4).

    Raises :class:`UnsupportedSpaceError` naming the offending path.
    """
    return _to_spec(space, _ROOT)


def _to_spec(space: Any, path: str) -> spaces_v1.SpaceSpec:
    spaces = gym.spaces
    if is_mission_space(space):
        return _to_spec(mission_text_space(space), path)
    if isinstance(space, spaces.Box):
        return _box_to_spec(space, path)
    if isinstance(space, spaces.Discrete):
        return spaces_v1.SpaceSpec(
            dtype=_DataType.INT64,
            discrete=spaces_v1.DiscreteSpec(n=int(space.n), start=int(space.start)),
        )
    if isinstance(space, spaces.MultiBinary):
        return spaces_v1.SpaceSpec(
            shape=[int(d) for d in space.shape],
            dtype=_DataType.UINT8,
            multi_binary=spaces_v1.MultiBinarySpec(),
        )
    if isinstance(space, spaces.MultiDiscrete):
        if np.any(np.asarray(space.start) != 0):
            raise UnsupportedSpaceError(
                f"unsupported space at {path}: MultiDiscrete with a non-zero start "
                "(rlmesh-wire-v1 MultiDiscrete values always start at 0)"
            )
        nvec = np.asarray(space.nvec)
        return spaces_v1.SpaceSpec(
            shape=[int(d) for d in nvec.shape],
            dtype=_DataType.INT64,
            multi_discrete=spaces_v1.MultiDiscreteSpec(nvec=[int(v) for v in nvec.reshape(-1)]),
        )
    if isinstance(space, spaces.Text):
        if space.min_length <= 0:
            raise UnsupportedSpaceError(f"{path}: [Text] min_length must be > 0")
        chars = frozenset(space.character_set)
        charset = "" if chars == _GYM_DEFAULT_CHARSET else "".join(sorted(chars))
        return spaces_v1.SpaceSpec(
            dtype=_DataType.UINT8,
            text=spaces_v1.TextSpec(
                min_length=int(space.min_length),
                max_length=int(space.max_length),
                charset=charset,
            ),
        )
    if isinstance(space, spaces.Dict):
        keys = list(space.spaces)
        for key in keys:
            if not isinstance(key, str):
                raise UnsupportedSpaceError(
                    f"unsupported space at {path}: Dict key {key!r} is not a str"
                )
            if not key:
                raise UnsupportedSpaceError(f"{path}: [Dict] keys must be non-empty")
        ordered = sorted(keys)
        return spaces_v1.SpaceSpec(
            dict=spaces_v1.DictSpec(
                keys=ordered,
                spaces=[_to_spec(space.spaces[key], f"{path}.{key}") for key in ordered],
            )
        )
    if isinstance(space, spaces.Tuple):
        return spaces_v1.SpaceSpec(
            tuple=spaces_v1.TupleSpec(
                spaces=[_to_spec(child, f"{path}[{i}]") for i, child in enumerate(space.spaces)]
            )
        )
    raise UnsupportedSpaceError(
        f"unsupported space at {path}: {type(space).__name__} is not expressible in "
        "rlmesh-wire-v1 (Box, Discrete, MultiBinary, MultiDiscrete, Text, Dict, Tuple); "
        "wrap the env (gymnasium.ObservationWrapper / ActionWrapper) to map it onto those"
    )


def _box_to_spec(space: Any, path: str) -> spaces_v1.SpaceSpec:
    dtype = np.dtype(space.dtype)
    wire_dtype = _DTYPES.get(dtype.name)
    if wire_dtype is None:
        raise UnsupportedSpaceError(
            f"unsupported space at {path}: Box dtype {dtype.name} has no rlmesh-wire-v1 DataType"
        )
    shape = tuple(int(d) for d in space.shape)
    if not shape and path != _ROOT:
        raise UnsupportedSpaceError(f"{path}: [Box] shape must be set (rank >= 1)")
    le = dtype.newbyteorder("<")
    low = np.asarray(space.low).astype(le).reshape(-1)
    high = np.asarray(space.high).astype(le).reshape(-1)
    if dtype.kind == "f" and bool(np.all(low == -np.inf)) and bool(np.all(high == np.inf)):
        bounds = spaces_v1.BoxSpec(unbounded=True)
    elif low.size and bool(np.all(low == low[0])) and bool(np.all(high == high[0])):
        bounds = spaces_v1.BoxSpec(
            uniform=spaces_v1.UniformBounds(low=low[:1].tobytes(), high=high[:1].tobytes())
        )
    else:
        bounds = spaces_v1.BoxSpec(
            elementwise=spaces_v1.ElementwiseBounds(low=low.tobytes(), high=high.tobytes())
        )
    return spaces_v1.SpaceSpec(shape=list(shape), dtype=wire_dtype, box=bounds)


# ---- SpaceSpec -> gymnasium space --------------------------------------------------------


def spec_to_space(spec: spaces_v1.SpaceSpec) -> gym.spaces.Space[Any]:
    """The gymnasium space a SpaceSpec describes (the inverse of :func:`space_to_spec`).

    Raises :class:`UnsupportedSpaceError` for a spec with no (or an unknown) kind, or
    with bounds that do not fit its shape and dtype.
    """
    space: gym.spaces.Space[Any] = _to_space(spec, _ROOT)
    return space


def _to_space(spec: spaces_v1.SpaceSpec, path: str) -> Any:
    spaces = gym.spaces
    kind = betterproto2.which_one_of(spec, "spec")[0]
    if kind == "box":
        dtype, shape, low, high = _box_arrays(spec, path)
        return spaces.Box(
            low=low.reshape(shape), high=high.reshape(shape), shape=shape, dtype=dtype
        )
    if kind == "discrete":
        assert spec.discrete is not None
        return spaces.Discrete(int(spec.discrete.n), start=int(spec.discrete.start))
    if kind == "multi_binary":
        shape = tuple(int(d) for d in spec.shape)
        return spaces.MultiBinary(shape[0] if len(shape) == 1 else list(shape))
    if kind == "multi_discrete":
        assert spec.multi_discrete is not None
        shape = tuple(int(d) for d in spec.shape)
        nvec = np.array(spec.multi_discrete.nvec, dtype=np.int64)
        if nvec.size != _numel(shape):
            raise _malformed(path, f"MultiDiscrete nvec has {nvec.size} entries for shape {shape}")
        return spaces.MultiDiscrete(nvec.reshape(shape))
    if kind == "text":
        text = spec.text
        assert text is not None
        if text.min_length <= 0:
            raise UnsupportedSpaceError(f"{path}: [Text] min_length must be > 0")
        if text.charset:
            return spaces.Text(text.max_length, min_length=text.min_length, charset=text.charset)
        return spaces.Text(text.max_length, min_length=text.min_length)
    if kind == "dict":
        assert spec.dict is not None
        keys, children = spec.dict.keys, spec.dict.spaces
        if len(keys) != len(children):
            raise _malformed(path, f"Dict has {len(keys)} keys but {len(children)} spaces")
        return spaces.Dict(
            {
                key: _to_space(child, f"{path}.{key}")
                for key, child in zip(keys, children, strict=True)
            }
        )
    if kind == "tuple":
        assert spec.tuple is not None
        return spaces.Tuple(
            tuple(_to_space(child, f"{path}[{i}]") for i, child in enumerate(spec.tuple.spaces))
        )
    raise UnsupportedSpaceError(f"unsupported space at {path}: SpaceSpec without a known kind")


def _box_arrays(
    spec: spaces_v1.SpaceSpec, path: str
) -> tuple[np.dtype[Any], tuple[int, ...], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Dtype, shape and flat little-endian low/high of a Box spec."""
    box = spec.box
    assert box is not None
    dtype = _NUMPY_DTYPES.get(spec.dtype)
    if dtype is None:
        raise UnsupportedSpaceError(
            f"unsupported space at {path}: Box with data type {spec.dtype!r}"
        )
    shape = tuple(int(d) for d in spec.shape)
    numel = _numel(shape)
    bounds = betterproto2.which_one_of(box, "bounds")[0]
    if bounds == "uniform":
        assert box.uniform is not None
        low = _scalars(box.uniform.low, dtype, 1, path, "uniform low")
        high = _scalars(box.uniform.high, dtype, 1, path, "uniform high")
        return dtype, shape, np.repeat(low, numel), np.repeat(high, numel)
    if bounds == "elementwise":
        assert box.elementwise is not None
        low = _scalars(box.elementwise.low, dtype, numel, path, "elementwise low")
        high = _scalars(box.elementwise.high, dtype, numel, path, "elementwise high")
        return dtype, shape, low, high
    # ``unbounded`` (or no bounds at all): the widest range the dtype has.
    if dtype.kind == "f":
        return dtype, shape, np.full(numel, -np.inf, dtype), np.full(numel, np.inf, dtype)
    if dtype.kind == "b":
        return dtype, shape, np.zeros(numel, dtype), np.ones(numel, dtype)
    info = np.iinfo(dtype)
    return dtype, shape, np.full(numel, info.min, dtype), np.full(numel, info.max, dtype)


def _scalars(
    data: bytes, dtype: np.dtype[Any], count: int, path: str, what: str
) -> np.ndarray[Any, Any]:
    if len(data) != count * dtype.itemsize:
        raise _malformed(path, f"Box {what} is {len(data)} bytes, expected {count} x {dtype.name}")
    scalars: np.ndarray[Any, Any] = np.frombuffer(data, dtype=dtype).copy()
    return scalars


def _malformed(path: str, what: str) -> UnsupportedSpaceError:
    return UnsupportedSpaceError(f"unsupported space at {path}: malformed SpaceSpec: {what}")


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


# ---- the compiled plan: a tree of containers over the leaves in wire order ---------------


class _LeafNode:
    __slots__ = ("leaf",)

    def __init__(self, leaf: Leaf) -> None:
        self.leaf = leaf

    def gather(self, value: Any, out: list[Any]) -> None:
        out.append(self.leaf.convert(value))

    def assemble(self, values: Iterator[Any]) -> Any:
        return next(values)


class _DictNode:
    __slots__ = ("children", "items")

    def __init__(self, keys: Sequence[str], children: Sequence[_Node]) -> None:
        self.children = list(children)
        self.items = list(zip(keys, children, strict=True))

    def gather(self, value: Any, out: list[Any]) -> None:
        if not isinstance(value, Mapping):
            raise not_instance(value, "dict")
        for key, child in self.items:
            try:
                item = value[key]
            except KeyError:
                raise KeyError(f"missing dict key {key!r}") from None
            child.gather(item, out)

    def assemble(self, values: Iterator[Any]) -> dict[str, Any]:
        return {key: child.assemble(values) for key, child in self.items}


class _TupleNode:
    __slots__ = ("children",)

    def __init__(self, children: Sequence[_Node]) -> None:
        self.children = list(children)

    def gather(self, value: Any, out: list[Any]) -> None:
        if not isinstance(value, (tuple, list)):
            raise not_instance(value, "tuple")
        if len(value) != len(self.children):
            raise ValueError(f"Tuple space expected {len(self.children)} items, got {len(value)}")
        for child, item in zip(self.children, value, strict=True):
            child.gather(item, out)

    def assemble(self, values: Iterator[Any]) -> tuple[Any, ...]:
        return tuple(child.assemble(values) for child in self.children)


_Node = _LeafNode | _DictNode | _TupleNode


def _compile(spec: spaces_v1.SpaceSpec, path: str, leaves: list[Leaf]) -> _Node:
    """The plan of ``spec``; appends its leaves to ``leaves`` in wire order."""
    kind = betterproto2.which_one_of(spec, "spec")[0]
    leaf: Leaf
    if kind == "box":
        dtype, shape, low, high = _box_arrays(spec, path)
        leaf = BoxLeaf(path, dtype, shape, low, high)
    elif kind == "discrete":
        assert spec.discrete is not None
        leaf = DiscreteLeaf(path, int(spec.discrete.n), int(spec.discrete.start))
    elif kind == "multi_binary":
        leaf = MultiBinaryLeaf(path, tuple(int(d) for d in spec.shape))
    elif kind == "multi_discrete":
        assert spec.multi_discrete is not None
        leaf = MultiDiscreteLeaf(
            path, tuple(int(d) for d in spec.shape), [int(v) for v in spec.multi_discrete.nvec]
        )
    elif kind == "text":
        text = spec.text
        assert text is not None
        leaf = TextLeaf(path, int(text.min_length), int(text.max_length), text.charset)
    elif kind == "dict":
        assert spec.dict is not None
        keys = list(spec.dict.keys)
        return _DictNode(
            keys,
            [
                _compile(child, f"{path}.{key}", leaves)
                for key, child in zip(keys, spec.dict.spaces, strict=True)
            ],
        )
    elif kind == "tuple":
        assert spec.tuple is not None
        return _TupleNode(
            [_compile(child, f"{path}[{i}]", leaves) for i, child in enumerate(spec.tuple.spaces)]
        )
    else:
        raise UnsupportedSpaceError(f"unsupported space at {path}: SpaceSpec without a known kind")
    leaves.append(leaf)
    return _LeafNode(leaf)


# ---- the codec ---------------------------------------------------------------------------


class SpaceCodec:
    """Values of one space to and from their wire leaves, with the reference's checks.

    Built once per space (the plan is compiled from the wire spec, so the bounds and
    rules checked are exactly the advertised ones); immutable afterwards and safe to use
    from any number of threads.

    Errors: observation encoding raises plain ``ValueError`` / ``TypeError`` (and
    ``KeyError`` for a Dict key the value lacks) whose text is the reference's; action
    validation raises :class:`ActionError` whose text is the reference's INVALID_ACTION
    message (SPEC §3.4, §3.6, §9).
    """

    __slots__ = ("_leaves", "_root", "_single", "num_leaves", "space", "spec")

    def __init__(self, space: gym.spaces.Space[Any]) -> None:
        """Compile ``space``; raises :class:`UnsupportedSpaceError` naming the bad path."""
        self.space = space
        self.spec = space_to_spec(space)
        leaves: list[Leaf] = []
        self._root = _compile(self.spec, _ROOT, leaves)
        self._leaves = tuple(leaves)
        self.num_leaves = len(leaves)
        # The per-step plan of a space that is one leaf (a Box, a Discrete, ...: most
        # envs): no tree walk, no per-leaf lists; the leaf's fused calls do it all.
        self._single: Leaf | None = self._root.leaf if isinstance(self._root, _LeafNode) else None

    @classmethod
    def from_spec(cls, spec: spaces_v1.SpaceSpec) -> SpaceCodec:
        """The codec of the space a (e.g. received) SpaceSpec describes."""
        return cls(spec_to_space(spec))

    @property
    def leaf_paths(self) -> tuple[str, ...]:
        """The path of every leaf, in wire order."""
        return tuple(leaf.path for leaf in self._leaves)

    # ---- observations (server -> client) -------------------------------------------------

    def _convert(self, value: Any) -> list[Any]:
        canonical: list[Any] = []
        self._root.gather(value, canonical)
        return canonical

    def _soft(self, canonical: Sequence[Any], kind: str) -> Candidate | None:
        for leaf, item in zip(self._leaves, canonical, strict=True):
            message = leaf.soft(item)
            if message is not None:
                return make_candidate(kind, leaf.path, message)
        return None

    def encode(self, value: Any) -> list[bytes]:
        """One lane's value as one-lane leaves (a Text leaf carries its count-1 header)."""
        canonical = self._convert(value)
        return [leaf.encode_one(item) for leaf, item in zip(self._leaves, canonical, strict=True)]

    def encode_observation(
        self, value: Any, *, soft_checks: bool
    ) -> tuple[list[bytes], Candidate | None]:
        """:meth:`encode`, plus the first soft violation (kind ``observation``) if asked."""
        single = self._single
        if single is not None:
            item, message = single.convert_checked(value, soft_checks)
            found = None if message is None else make_candidate(OBSERVATION, single.path, message)
            return [single.encode_one(item)], found
        canonical = self._convert(value)
        leaves = [leaf.encode_one(item) for leaf, item in zip(self._leaves, canonical, strict=True)]
        candidate = self._soft(canonical, OBSERVATION) if soft_checks else None
        return leaves, candidate

    def encode_batch(self, values: Sequence[Any]) -> list[bytes]:
        """N lanes' values (in lane order) as N-lane leaves."""
        rows = [self._convert(value) for value in values]
        return [leaf.encode_many([row[i] for row in rows]) for i, leaf in enumerate(self._leaves)]

    def join(self, rows: Sequence[Sequence[bytes]]) -> list[bytes]:
        """Concatenate k lanes' leaves (each from :meth:`encode`) into k-lane leaves.

        Fixed-width slabs are concatenated; Text slabs get one merged header.
        """
        joined: list[bytes] = []
        for i, leaf in enumerate(self._leaves):
            parts = [row[i] for row in rows]
            if isinstance(leaf, TextLeaf):
                joined.append(_join_text(parts))
            else:
                joined.append(b"".join(parts))
        return joined

    def check_observation(self, value: Any) -> Candidate | None:
        """Only the soft checks of an observation (hard-check failures still raise)."""
        return self._soft(self._convert(value), OBSERVATION)

    def check_action(self, value: Any) -> Candidate | None:
        """Only the soft checks of an env-side action value (hard-check failures raise)."""
        return self._soft(self._convert(value), ACTION)

    # ---- actions (client -> server) ------------------------------------------------------

    def _parse(self, leaves: Sequence[bytes] | None, n: int) -> list[Any]:
        if leaves is None:
            raise ActionError(f"expected {n} actions, got 0")
        if len(leaves) != self.num_leaves:
            raise ActionError(
                f"length mismatch: got {len(leaves)} leaf slabs, spec expects {self.num_leaves}"
            )
        parsed = [leaf.parse(slab, n) for leaf, slab in zip(self._leaves, leaves, strict=True)]
        # Value checks report the first bad lane; within a lane, the first bad leaf.
        worst: tuple[int, str] | None = None
        for leaf, item in zip(self._leaves, parsed, strict=True):
            bad = leaf.first_bad_row(item)
            if bad is not None and (worst is None or bad[0] < worst[0]):
                worst = bad
        if worst is not None:
            raise ActionError(worst[1])
        return parsed

    def validate_action(self, leaves: Sequence[bytes] | None, n: int) -> None:
        """All hard checks of an ``n``-lane action; raises :class:`ActionError`.

        ``leaves`` is ``StepRequest.action.leaves``, or None when the request carries no
        ``action`` at all ("expected N actions, got 0"; an action with no leaves is a
        leaf-count mismatch instead). Order, as the reference: leaf count; every slab's
        length (and Text header / UTF-8) in leaf order; then values lane by lane.
        """
        self._parse(leaves, n)

    def decode_action(
        self, leaves: Sequence[bytes], n: int, row: int, *, soft_checks: bool
    ) -> tuple[Any, Candidate | None]:
        """Lane ``row``'s env value of an ``n``-lane action that passed :meth:`validate_action`.

        Returns the value (types in the module docstring) and, if asked, its first soft
        violation (kind ``action``). Reads only that lane's bytes.
        """
        values = [
            leaf.value_from_slab(slab, n, row)
            for leaf, slab in zip(self._leaves, leaves, strict=True)
        ]
        candidate = self._soft(values, ACTION) if soft_checks else None
        return self._root.assemble(iter(values)), candidate

    def step_action(
        self,
        leaves: Sequence[bytes] | None,
        n: int,
        row: int,
        *,
        validated: bool,
        soft_checks: bool,
    ) -> tuple[Any, Candidate | None]:
        """A lane's step action: :meth:`validate_action` unless ``validated``, then
        :meth:`decode_action` -- the same answers and errors, in one call per step."""
        single = self._single
        if single is None or validated:
            if not validated:
                self._parse(leaves, n)
            assert leaves is not None
            return self.decode_action(leaves, n, row, soft_checks=soft_checks)
        if leaves is None:
            raise ActionError(f"expected {n} actions, got 0")
        if len(leaves) != 1:
            raise ActionError(f"length mismatch: got {len(leaves)} leaf slabs, spec expects 1")
        value = single.take(leaves[0], n, row)
        if soft_checks:
            message = single.soft(value)
            if message is not None:
                return value, make_candidate(ACTION, single.path, message)
        return value, None

    def decode(self, leaves: Sequence[bytes] | None, n: int) -> list[Any]:
        """Validate an ``n``-lane value and return every lane's value, in lane order."""
        parsed = self._parse(leaves, n)
        return [
            self._root.assemble(
                leaf.value_at(item, row) for leaf, item in zip(self._leaves, parsed, strict=True)
            )
            for row in range(n)
        ]


def _join_text(parts: Sequence[bytes]) -> bytes:
    """Merge Text slabs (each ``count ‖ lengths ‖ bodies``) into one slab."""
    counts = [int.from_bytes(part[:8], "little") for part in parts]
    headers = [part[8 : 8 + 8 * count] for part, count in zip(parts, counts, strict=True)]
    bodies = [part[8 + 8 * count :] for part, count in zip(parts, counts, strict=True)]
    return b"".join((sum(counts).to_bytes(8, "little"), *headers, *bodies))
