"""The five fundamental leaves of rlmesh-wire-v1 and their byte forms (SPEC §3).

Each leaf knows, for one position in the wire leaf order:

* the observation side (server -> client): ``convert`` one lane's env value into its
  canonical form, running the hard checks with the reference's exact messages (plain
  ``ValueError`` / ``TypeError``, SPEC §3.7.3); ``encode_one`` / ``encode_many`` that
  canonical form for one or N lanes;
* the action side (client -> server): ``parse`` an N-lane slab (length and Text-header
  checks, raising :class:`ActionError`), ``first_bad_row`` (value checks, vectorised over
  the lanes), and ``value_at`` / ``value_from_slab`` for one lane's env value;
* ``soft``: the soft conformance check of one lane's canonical value (Box, Text only).

Fixed-width leaves decode with ``np.frombuffer``: the arrays share the request's bytes
and are read-only, like the ones the reference hands to ``env.step`` (see ``_spaces``).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from .._errors import ActionError, not_instance
from ._conformance import BoxBounds, TextRules

_U64: Final = struct.Struct("<Q")
_I64: Final = struct.Struct("<q")
_HEADER_ONE: Final = _U64.pack(1)
_INT64: Final = np.dtype("<i8")
_UINT8: Final = np.dtype("u1")
_UINT64: Final = np.dtype("<u8")
_I64_MIN: Final = -(2**63)
_I64_MAX: Final = 2**63 - 1
_U64_MAX: Final = 2**64 - 1

Array = np.ndarray[Any, Any]


# ---- observation-side conversions (the reference's wording) ----------------------------


def coerce_array(value: Any, dtype: np.dtype[Any]) -> Array:
    """``value`` as an array of ``dtype``, refusing lossy integer conversions.

    Floats for an integer dtype must be integral; integers must fit the dtype. Float
    targets convert silently (overflow becomes ±inf, as a cast does); bool targets take
    any non-zero value as True.
    """
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if array.dtype == dtype:
        return array
    source = array.dtype.kind
    target = dtype.kind
    if source == "c":
        array = array.real
        source = array.dtype.kind
    if target == "f":
        with np.errstate(over="ignore", invalid="ignore"):
            return array.astype(dtype)
    if target == "b" or source == "b":
        return array.astype(dtype)
    if target in "iu":
        info = np.iinfo(dtype)
        if source == "f":
            if array.size:
                with np.errstate(invalid="ignore"):
                    if not bool(np.isfinite(array).all()) or bool((np.trunc(array) != array).any()):
                        raise ValueError(
                            f"float value supplied for integer dtype {dtype.name} is not integral"
                        )
                    # float(info.max) + 1 is exact: 2**15, 2**63, 2**64, ...
                    if (
                        float(array.min()) < float(info.min)
                        or float(array.max()) >= float(info.max) + 1
                    ):
                        raise _not_representable(dtype)
            return array.astype(dtype)
        if source in "iu":
            if (
                array.size
                and not np.can_cast(array.dtype, dtype, "safe")
                and (int(array.min()) < info.min or int(array.max()) > info.max)
            ):
                raise _not_representable(dtype)
            return array.astype(dtype)
    # Strings, objects, ...: numpy's own conversion and its own error message.
    return array.astype(dtype)


def _not_representable(dtype: np.dtype[Any]) -> ValueError:
    return ValueError(
        f"value supplied for integer dtype {dtype.name} is not representable in its range"
    )


def _discrete_int(value: Any) -> int:
    """One Discrete value as an int, the way the reference reads a Python number."""
    if isinstance(value, (np.ndarray, np.generic)):
        value = value.tolist()
    if isinstance(value, int):
        number = int(value)  # bool and IntEnum become plain ints
    else:
        if isinstance(value, float):
            real = value
        elif hasattr(type(value), "__float__") or hasattr(type(value), "__index__"):
            real = float(value)
        else:
            raise TypeError(f"must be real number, not {type(value).__name__}")
        if not real.is_integer():
            raise ValueError(f"Discrete value must be an integer, got {_format_float(real)}")
        number = int(real)
    # The reference converts to int64 with saturation (2**70 reports 2**63 - 1).
    return min(max(number, _I64_MIN), _I64_MAX)


def _format_float(value: float) -> str:
    if value != value:
        return "NaN"
    return str(np.format_float_positional(value, trim="-"))


def _text_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind == "U":
        return str(value[()])
    raise not_instance(value, "str")


def _length_error(got: int, n: int, per_lane: int) -> ActionError:
    return ActionError(f"length mismatch: slab: got {got} bytes, expected {n} lanes * {per_lane}")


# ---- the leaves --------------------------------------------------------------------------


class Leaf:
    """One fundamental leaf (abstract)."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def convert(self, value: Any) -> Any:
        raise NotImplementedError

    def encode_one(self, canonical: Any) -> bytes:
        raise NotImplementedError

    def encode_many(self, canonicals: Sequence[Any]) -> bytes:
        raise NotImplementedError

    def soft(self, canonical: Any) -> str | None:
        return None

    def parse(self, slab: bytes, n: int) -> Any:
        raise NotImplementedError

    def first_bad_row(self, parsed: Any) -> tuple[int, str] | None:
        return None

    def value_at(self, parsed: Any, row: int) -> Any:
        raise NotImplementedError

    def value_from_slab(self, slab: bytes, n: int, row: int) -> Any:
        raise NotImplementedError

    # -- the fused per-step forms (one call per leaf; same answers and texts as above)

    def convert_checked(self, value: Any, soft: bool) -> tuple[Any, str | None]:
        """:meth:`convert` and, if ``soft``, :meth:`soft` of the result, in one call."""
        canonical = self.convert(value)
        return canonical, (self.soft(canonical) if soft else None)

    def take(self, slab: bytes, n: int, row: int) -> Any:
        """Validate an ``n``-lane slab of this leaf alone (:meth:`parse`, then
        :meth:`first_bad_row`, raising :class:`ActionError`) and return lane ``row``'s
        value (:meth:`value_from_slab`)."""
        bad = self.first_bad_row(self.parse(slab, n))
        if bad is not None:
            raise ActionError(bad[1])
        return self.value_from_slab(slab, n, row)


SMALL_BOX: Final = 64
"""A Box of at most this many elements checks its values element by element in Python
(one ``tolist``): cheaper than the handful of numpy reductions a bigger one takes."""


class ArrayLeaf(Leaf):
    """A fixed-width leaf: ``numel`` elements of ``dtype`` per lane."""

    __slots__ = ("dtype", "numel", "row_bytes", "shape")

    def __init__(self, path: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
        super().__init__(path)
        self.dtype = dtype
        self.shape = shape
        self.numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        self.row_bytes = self.numel * dtype.itemsize

    def encode_one(self, canonical: Any) -> bytes:
        array: Array = canonical
        return array.tobytes()

    def encode_many(self, canonicals: Sequence[Any]) -> bytes:
        return b"".join([array.tobytes() for array in canonicals])

    def parse(self, slab: bytes, n: int) -> Array:
        if len(slab) != n * self.row_bytes:
            raise _length_error(len(slab), n, self.row_bytes)
        return np.frombuffer(slab, dtype=self.dtype).reshape(n, self.numel)

    def value_at(self, parsed: Any, row: int) -> Any:
        array: Array = parsed[row]
        return array.reshape(self.shape)

    def value_from_slab(self, slab: bytes, n: int, row: int) -> Any:
        array = np.frombuffer(slab, dtype=self.dtype, count=self.numel, offset=row * self.row_bytes)
        return array.reshape(self.shape)


class BoxLeaf(ArrayLeaf):
    __slots__ = ("_bounds", "_is_bool", "_is_float", "_small")

    def __init__(
        self, path: str, dtype: np.dtype[Any], shape: tuple[int, ...], low: Array, high: Array
    ) -> None:
        super().__init__(path, dtype, shape)
        self._bounds = BoxBounds(low, high)
        self._is_float = dtype.kind == "f"
        self._is_bool = dtype.kind == "b"
        # (low, high) per element as Python numbers (exact: widening), for small Boxes.
        self._small: list[tuple[Any, Any]] | None = (
            list(zip(low.tolist(), high.tolist(), strict=True))
            if 0 < self.numel <= SMALL_BOX
            else None
        )

    def _sized(self, value: Any) -> Array:
        """``value`` as an array of the Box dtype, its size checked (not its values)."""
        array = (
            value
            if isinstance(value, np.ndarray) and value.dtype == self.dtype
            else coerce_array(value, self.dtype)
        )
        if array.size != self.numel:
            raise ValueError(
                f"invalid box value: data is {array.size * self.dtype.itemsize} bytes "
                f"but shape and dtype require exactly {self.row_bytes}"
            )
        return array

    def convert_checked(self, value: Any, soft: bool) -> tuple[Array, str | None]:
        small = self._small
        if small is None:
            return super().convert_checked(value, soft)
        array = self._sized(value)
        items = array.reshape(-1).tolist()
        if self._is_float:
            for index, item in enumerate(items):
                if item != item:
                    raise ValueError(f"{self.path}: Box value at element {index} is NaN")
        if soft and self._bounds.checks:
            # BoxBounds.violation's answer: the first element out on either side; above
            # wins when both hold (low > high).
            for index, (item, (low, high)) in enumerate(zip(items, small, strict=True)):
                if item > high:
                    return array, f"Box value at element {index} out of bounds: above high bound"
                if item < low:
                    return array, f"Box value at element {index} out of bounds: below low bound"
        return array, None

    def convert(self, value: Any) -> Array:
        array = self._sized(value)
        if self._is_float and self.numel and np.isnan(array.min()):
            index = int(np.argmax(np.isnan(array.reshape(-1))))
            raise ValueError(f"{self.path}: Box value at element {index} is NaN")
        return array

    def soft(self, canonical: Any) -> str | None:
        if not self._bounds.checks:
            return None
        array: Array = canonical
        return self._bounds.violation(array.reshape(-1))

    def parse(self, slab: bytes, n: int) -> Array:
        parsed = super().parse(slab, n)
        if self._is_bool:
            parsed = _normalise_bool(slab, parsed)
        return parsed

    def first_bad_row(self, parsed: Any) -> tuple[int, str] | None:
        array: Array = parsed
        if not self._is_float or array.size == 0 or not np.isnan(array.min()):
            return None
        nan = np.isnan(array)
        row = int(np.argmax(nan.any(axis=1)))
        index = int(np.argmax(nan[row]))
        return row, f"{self.path}: Box value at element {index} is NaN"

    def value_from_slab(self, slab: bytes, n: int, row: int) -> Any:
        array = np.frombuffer(slab, dtype=self.dtype, count=self.numel, offset=row * self.row_bytes)
        if self._is_bool:
            array = _normalise_bool(slab[row * self.row_bytes : (row + 1) * self.row_bytes], array)
        return array.reshape(self.shape)


def _normalise_bool(raw: bytes, array: Array) -> Array:
    """Bytes other than 0/1 in a bool slab read as True (a clean, read-only array)."""
    if array.size and np.frombuffer(raw, dtype=_UINT8).max() > 1:
        array = array.view(_UINT8) != 0
        array.flags.writeable = False
    return array


class DiscreteLeaf(Leaf):
    __slots__ = ("_end", "_range", "start")

    def __init__(self, path: str, n: int, start: int) -> None:
        super().__init__(path)
        self.start = start
        self._end = start + n
        self._range = f"[{start}, {start + n})"

    def convert(self, value: Any) -> int:
        number = _discrete_int(value)
        if not self.start <= number < self._end:
            raise ValueError(f"{self.path}: value {number} not in range {self._range}")
        return number

    def encode_one(self, canonical: Any) -> bytes:
        return _I64.pack(canonical)

    def encode_many(self, canonicals: Sequence[Any]) -> bytes:
        return np.array(canonicals, dtype=_INT64).tobytes()

    def parse(self, slab: bytes, n: int) -> Array:
        if len(slab) != n * 8:
            raise _length_error(len(slab), n, 8)
        return np.frombuffer(slab, dtype=_INT64)

    def first_bad_row(self, parsed: Any) -> tuple[int, str] | None:
        array: Array = parsed
        if array.size == 0:
            return None
        if array.size == 1:  # the common one-lane case: numpy reductions cost ~µs each
            number = int(array[0])
            if self.start <= number < self._end:
                return None
            return 0, f"{self.path}: value {number} not in range {self._range}"
        bad = (array < self.start) | (array >= self._end)
        if not bad.any():
            return None
        row = int(np.argmax(bad))
        return row, f"{self.path}: value {int(array[row])} not in range {self._range}"

    def value_at(self, parsed: Any, row: int) -> int:
        return int(parsed[row])

    def value_from_slab(self, slab: bytes, n: int, row: int) -> int:
        return int(_I64.unpack_from(slab, row * 8)[0])

    def take(self, slab: bytes, n: int, row: int) -> int:
        if n != 1:
            number: int = super().take(slab, n, row)
            return number
        if len(slab) != 8:
            raise _length_error(len(slab), 1, 8)
        number = _I64.unpack(slab)[0]
        if not self.start <= number < self._end:
            raise ActionError(f"{self.path}: value {number} not in range {self._range}")
        return number


class MultiBinaryLeaf(ArrayLeaf):
    """uint8 per element; non-zero means 1, on the wire and in actions (SPEC §3.7.3)."""

    __slots__ = ()

    def __init__(self, path: str, shape: tuple[int, ...]) -> None:
        super().__init__(path, _UINT8, shape)

    def convert(self, value: Any) -> Array:
        array = (
            value
            if isinstance(value, np.ndarray) and value.dtype == _UINT8
            else coerce_array(value, _UINT8)
        )
        if array.size != self.numel:
            raise ValueError(
                f"{self.path}: MultiBinary size mismatch: expected {self.numel}, got {array.size}"
            )
        return _binary(array)

    def value_at(self, parsed: Any, row: int) -> Any:
        return _binary(parsed[row]).reshape(self.shape)

    def value_from_slab(self, slab: bytes, n: int, row: int) -> Any:
        array = np.frombuffer(slab, dtype=_UINT8, count=self.numel, offset=row * self.row_bytes)
        return _binary(array).reshape(self.shape)


def _binary(array: Array) -> Array:
    if array.size and array.max() > 1:
        array = (array != 0).view(_UINT8)
        array.flags.writeable = False
    return array


class MultiDiscreteLeaf(ArrayLeaf):
    __slots__ = ("_nvec",)

    def __init__(self, path: str, shape: tuple[int, ...], nvec: Sequence[int]) -> None:
        super().__init__(path, _INT64, shape)
        self._nvec = np.array(nvec, dtype=_INT64)

    def convert(self, value: Any) -> Array:
        array = (
            value
            if isinstance(value, np.ndarray) and value.dtype == _INT64
            else coerce_array(value, _INT64)
        )
        if array.size != self.numel:
            raise ValueError(
                f"{self.path}: MultiDiscrete size mismatch: expected {self.numel}, got {array.size}"
            )
        flat = array.reshape(-1)
        bad = (flat < 0) | (flat >= self._nvec)
        if bad.any():
            index = int(np.argmax(bad))
            raise ValueError(self._range_message(index, int(flat[index])))
        return array

    def first_bad_row(self, parsed: Any) -> tuple[int, str] | None:
        array: Array = parsed
        if array.size == 0:
            return None
        bad = (array < 0) | (array >= self._nvec)
        if not bad.any():
            return None
        row = int(np.argmax(bad.any(axis=1)))
        index = int(np.argmax(bad[row]))
        return row, self._range_message(index, int(array[row, index]))

    def _range_message(self, index: int, value: int) -> str:
        return f"{self.path}: value[{index}] = {value} not in range [0, {int(self._nvec[index])})"


class TextLeaf(Leaf):
    """``u64 count ‖ count x u64 byte length ‖ UTF-8 bodies``, always (SPEC §3.4)."""

    __slots__ = ("_rules",)

    def __init__(self, path: str, min_length: int, max_length: int, charset: str) -> None:
        super().__init__(path)
        self._rules = TextRules(min_length, max_length, charset)

    def convert(self, value: Any) -> str:
        return _text_str(value)

    def encode_one(self, canonical: Any) -> bytes:
        body = canonical.encode("utf-8")
        return b"".join((_HEADER_ONE, _U64.pack(len(body)), body))

    def encode_many(self, canonicals: Sequence[Any]) -> bytes:
        bodies = [text.encode("utf-8") for text in canonicals]
        lengths = np.array([len(body) for body in bodies], dtype=_UINT64)
        return b"".join((_U64.pack(len(bodies)), lengths.tobytes(), *bodies))

    def soft(self, canonical: Any) -> str | None:
        return self._rules.violation(canonical)

    def parse(self, slab: bytes, n: int) -> list[str]:
        size = len(slab)
        if size < 8:
            raise ActionError("length mismatch: text slab header truncated")
        count = _U64.unpack_from(slab, 0)[0]
        if count != n:
            raise ActionError(f"length mismatch: text slab count {count} != N {n}")
        offset = 8 + 8 * n
        if size < offset:
            raise ActionError("length mismatch: text slab header truncated")
        texts: list[str] = []
        view = memoryview(slab)
        for length in np.frombuffer(slab, dtype=_UINT64, count=n, offset=8).tolist():
            end = offset + length
            if end > _U64_MAX:
                raise ActionError("decode error: text length overflow")
            if end > size:
                raise ActionError("length mismatch: text slab body truncated")
            texts.append(_decode_utf8(view[offset:end]))
            offset = end
        if offset != size:
            raise ActionError("length mismatch: trailing bytes in text slab")
        return texts

    def value_at(self, parsed: Any, row: int) -> str:
        texts: list[str] = parsed
        return texts[row]

    def value_from_slab(self, slab: bytes, n: int, row: int) -> str:
        lengths = np.frombuffer(slab, dtype=_UINT64, count=n, offset=8)
        start = 8 + 8 * n + int(lengths[:row].sum())
        return str(slab[start : start + int(lengths[row])], "utf-8")


def _decode_utf8(data: memoryview) -> str:
    """Decode, wording a failure like the reference (Rust's ``Utf8Error``)."""
    try:
        return str(data, "utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data":
            tail = f"incomplete utf-8 byte sequence from index {exc.start}"
        else:
            tail = f"invalid utf-8 sequence of {exc.end - exc.start} bytes from index {exc.start}"
        raise ActionError(f"decode error: text payload is not valid UTF-8: {tail}") from None
