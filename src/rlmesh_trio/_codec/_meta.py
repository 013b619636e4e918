"""info dicts, reset options and env metadata <-> ``MetaValue`` / ``MetaMap`` (SPEC §5).

Python -> wire follows what rlmesh 0.1.0's native metadata codec accepts, value for
value, including which exception type and text it raises for what it refuses (the
lane reports them as ``reset failed: TypeError: <str(exc)>``, SPEC §9). The conversion
of one value, in the reference's order (established by feeding values to the 0.1.0
codec; SPEC §5.1 and the ``probe_spaces_text_info`` goldens):

1. *Normalisation*: the first of ``_asdict()``, ``tolist()``, ``item()`` that the
   object has is called, once (namedtuples become dicts, numpy arrays nested lists,
   numpy scalars Python scalars, ``memoryview`` a list of ints).
2. ``None`` -> a MetaValue with no member set; ``bool`` -> ``bool``; ``bytes`` (and
   subclasses) -> ``bytes``; ``dict`` (and subclasses; keys must be ``str``) -> ``map``;
   ``list`` / ``tuple`` (and subclasses) -> ``list``.
3. ``int`` (and subclasses, e.g. ``IntEnum``) -> ``integer``; outside int64 this is an
   ``OverflowError``. Other objects with ``__index__`` -> ``integer`` when the index fits
   int64, else they go on to 4.
4. ``float`` (and subclasses) or anything with ``__float__`` (``Decimal``, ``Fraction``)
   or ``__index__`` -> ``number`` (NaN and infinities kept).
5. ``str`` (and subclasses, ``np.str_``, ``class E(str, Enum)``) -> ``text``, unless it
   cannot be encoded as UTF-8 (lone surrogates), then it goes on to 6.
6. An object with a ``value`` attribute (an ``Enum`` member) -> the conversion of that
   value, when it converts; otherwise its ``name`` if that is a ``str``.
7. Anything else -> ``TypeError("value of type 'set' is not supported in RLMesh
   metadata; ...")``.

Wire -> Python (SPEC §5.2): integer -> int, number -> float, text -> str, bool -> bool,
bytes -> bytes, list -> list, map -> dict, no member (or a missing map value) -> None.

All functions are pure and thread-safe. The hot path (exact builtin and numpy types)
is one dict lookup per value; everything else takes the general route above.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import betterproto2
import numpy as np

from .._errors import not_instance
from .._proto.rlmesh.spaces import v1 as spaces_v1

__all__ = ["from_meta_map", "from_meta_value", "to_meta_map", "to_meta_value"]

_MetaValue: Final = spaces_v1.MetaValue
_MetaList: Final = spaces_v1.MetaList
_MetaMap: Final = spaces_v1.MetaMap

_INT64_MIN: Final = -(1 << 63)
_INT64_MAX: Final = (1 << 63) - 1

#: Where the location of a refused value is collected while the error unwinds.
_PATH_KEY: Final = "_rlmesh_trio_meta_path"
#: Errors a refused value raises (UnicodeEncodeError is a ValueError: surrogate keys).
_REFUSALS: Final = (TypeError, OverflowError, ValueError)

_MISSING: Final = object()

_Encoder = Callable[[Any], spaces_v1.MetaValue]


# --------------------------------------------------------------------------- message builders

_M = TypeVar("_M", bound=betterproto2.Message)
_IMMUTABLE: Final = (type(None), bytes, str, int, float, bool)


def _builder(cls: type[_M], field: str, sample: object) -> Callable[[Any], _M]:
    """A fast equivalent of ``lambda value: cls(**{field: value})``.

    A betterproto2 message built through its dataclass ``__init__`` costs about as much
    as converting the value itself; filling a copy of a default instance's state costs
    half. The shortcut is used only if, checked here on ``sample``, it gives exactly what
    the constructor gives (same state, equal, same bytes) and shares nothing mutable;
    otherwise (a betterproto2 change) this returns the plain constructor.
    """

    def construct(value: Any) -> _M:
        return cls(**{field: value})

    template = dict(vars(cls()))
    if field not in template or not all(
        isinstance(default, _IMMUTABLE) for name, default in template.items() if name != field
    ):
        return construct
    new = object.__new__

    def build(value: Any) -> _M:
        state = template.copy()
        state[field] = value
        message: _M = new(cls)
        message.__dict__ = state
        return message

    expected, got = construct(sample), build(sample)
    if vars(got) == vars(expected) and got == expected and bytes(got) == bytes(expected):
        return build
    return construct


_meta_integer: Final = _builder(_MetaValue, "integer", -1)
_meta_number: Final = _builder(_MetaValue, "number", 0.5)
_meta_text: Final = _builder(_MetaValue, "text", "x")
_meta_bool: Final = _builder(_MetaValue, "bool", False)
_meta_bytes: Final = _builder(_MetaValue, "bytes", b"x")
_meta_list: Final = _builder(_MetaValue, "list", _MetaList(items=[_MetaValue(integer=1)]))
_meta_map: Final = _builder(_MetaValue, "map", _MetaMap(entries={"k": _MetaValue(text="v")}))
_meta_empty: Final = _builder(_MetaValue, "integer", None)  # no member set: Python None
_new_list: Final = _builder(_MetaList, "items", [_MetaValue(integer=1), _MetaValue()])
_new_map: Final = _builder(_MetaMap, "entries", {"k": _MetaValue(text="v")})


# --------------------------------------------------------------------------- errors


def _unsupported(obj: object) -> TypeError:
    return TypeError(
        f"value of type '{type(obj).__name__}' is not supported in RLMesh metadata; "
        "pass the dict through rlmesh.sanitize_metadata(...) to stringify unsupported values"
    )


def _int_overflow(value: int) -> OverflowError:
    return OverflowError(
        f"metadata integer {value} does not fit int64; RLMesh metadata integers must be in "
        "[-2**63, 2**63) -- store a larger value as a string instead"
    )


def _push_path(exc: BaseException, segment: str) -> None:
    """Record one step of the refused value's location (innermost first)."""
    vars(exc).setdefault(_PATH_KEY, []).append(segment)


def _annotate(exc: BaseException, root: str) -> None:
    """Attach ``at $.a[0]`` as an exception note; ``str(exc)`` stays the reference text."""
    segments: list[str] = vars(exc).pop(_PATH_KEY, [])
    where = root + "".join(reversed(segments))
    exc.add_note(f"(rlmesh-trio: refused while converting the metadata value at {where})")


# --------------------------------------------------------------------------- scalars


def _from_none(_obj: None) -> spaces_v1.MetaValue:
    return _meta_empty(None)


def _from_int(obj: int) -> spaces_v1.MetaValue:
    if _INT64_MIN <= obj <= _INT64_MAX:
        return _meta_integer(obj)
    raise _int_overflow(obj)


def _from_str(obj: str) -> spaces_v1.MetaValue:
    if obj.isascii() or _utf8_ok(obj):
        return _meta_text(obj)
    # The reference cannot extract a surrogate-carrying str and reports it unsupported.
    raise _unsupported(obj)


def _from_np_bool(obj: np.bool_) -> spaces_v1.MetaValue:
    return _meta_bool(bool(obj))


def _from_np_int(obj: np.integer[Any]) -> spaces_v1.MetaValue:
    return _from_int(int(obj))


def _from_np_float(obj: np.floating[Any]) -> spaces_v1.MetaValue:
    return _meta_number(float(obj))


def _from_np_str(obj: np.str_) -> spaces_v1.MetaValue:
    return _from_str(str.__str__(obj))


def _from_np_bytes(obj: np.bytes_) -> spaces_v1.MetaValue:
    return _meta_bytes(bytes(obj))


def _utf8_ok(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --------------------------------------------------------------------------- containers


def _from_list(obj: list[Any] | tuple[Any, ...]) -> spaces_v1.MetaValue:
    return _meta_list(_new_list(_encode_items(obj)))


def _from_dict(obj: dict[Any, Any]) -> spaces_v1.MetaValue:
    return _meta_map(_new_map(_encode_entries(obj)))


def _from_ndarray(obj: np.ndarray[Any, Any]) -> spaces_v1.MetaValue:
    # ``tolist()`` is the normalisation step: its result is not normalised again.
    return _encode_plain(obj.tolist())


def _encode_items(items: list[Any] | tuple[Any, ...]) -> list[spaces_v1.MetaValue]:
    get = _ENCODERS.get
    out: list[spaces_v1.MetaValue] = []
    append = out.append
    for index, item in enumerate(items):
        try:
            encode = get(type(item))
            append(encode(item) if encode is not None else _encode_other(item))
        except _REFUSALS as exc:
            _push_path(exc, f"[{index}]")
            raise
    return out


def _encode_entries(mapping: Mapping[Any, Any]) -> dict[str, spaces_v1.MetaValue]:
    get = _ENCODERS.get
    entries: dict[str, spaces_v1.MetaValue] = {}
    for key, item in mapping.items():
        if type(key) is not str or not key.isascii():
            key = _check_key(key)
        try:
            encode = get(type(item))
            entries[key] = encode(item) if encode is not None else _encode_other(item)
        except _REFUSALS as exc:
            _push_path(exc, f".{key}")
            raise
    return entries


def _check_key(key: object) -> str:
    """A map's key: a ``str``. Refused in the reference's words at every depth (a None
    key: ``'None' is not an instance of 'str'``, an int: ``'int' object is not...``)."""
    if not isinstance(key, str):
        raise not_instance(key, "str")
    key.encode("utf-8")  # surrogates: UnicodeEncodeError, exactly as the reference
    return str.__str__(key)


# --------------------------------------------------------------------------- general route


def _encode_other(obj: object) -> spaces_v1.MetaValue:
    """Convert a value whose exact type is not in the fast table (steps 1-7)."""
    for method in ("_asdict", "tolist", "item"):
        normalise = getattr(obj, method, None)
        if callable(normalise):
            obj = normalise()
            break
    return _encode_plain(obj)


def _encode_plain(obj: object) -> spaces_v1.MetaValue:
    """Steps 2-7 for an already normalised value."""
    encode = _PLAIN_ENCODERS.get(type(obj))
    if encode is not None:
        return encode(obj)
    if isinstance(obj, bytes):
        return _meta_bytes(bytes(memoryview(obj)))
    if isinstance(obj, dict):
        return _from_dict(obj)
    if isinstance(obj, (list, tuple)):
        return _from_list(obj)
    if isinstance(obj, int):
        return _from_int(int.__index__(obj))
    cls = type(obj)
    has_index = hasattr(cls, "__index__")
    if has_index:
        try:
            index = _index(obj)
        except Exception:
            pass  # the reference then tries the value as a float
        else:
            if _INT64_MIN <= index <= _INT64_MAX:
                return _meta_integer(index)
    if isinstance(obj, float):
        return _meta_number(float.__float__(obj))
    has_float = hasattr(cls, "__float__")
    if has_float or has_index:
        try:
            number = _float(obj) if has_float else float(_index(obj))
        except Exception:
            pass
        else:
            return _meta_number(number)
    if isinstance(obj, str) and _utf8_ok(obj):
        return _meta_text(str.__str__(obj))
    value = getattr(obj, "value", _MISSING)
    if value is not _MISSING and value is not obj:
        try:
            return _encode(value)
        except Exception:
            pass  # the reference falls back to the member's name
    name = getattr(obj, "name", _MISSING)
    if isinstance(name, str) and name is not obj and _utf8_ok(name):
        return _meta_text(str.__str__(name))
    raise _unsupported(obj)


def _index(obj: Any) -> int:
    return operator.index(obj)


def _float(obj: Any) -> float:
    return float(obj)


def _encode(obj: object) -> spaces_v1.MetaValue:
    encode = _ENCODERS.get(type(obj))
    if encode is not None:
        return encode(obj)
    return _encode_other(obj)


# Exact builtin types: no normalisation method, conversion fully decided by the type.
_PLAIN_ENCODERS: Final[dict[type, _Encoder]] = {
    type(None): _from_none,
    bool: _meta_bool,
    int: _from_int,
    float: _meta_number,
    str: _from_str,
    bytes: _meta_bytes,
    list: _from_list,
    tuple: _from_list,
    dict: _from_dict,
}


def _numpy_encoders() -> dict[type, _Encoder]:
    table: dict[type, _Encoder] = {np.ndarray: _from_ndarray, np.bool_: _from_np_bool}
    for name in (
        "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "intc", "uintc", "intp", "uintp", "longlong", "ulonglong", "byte", "ubyte",
        "short", "ushort", "long", "ulong",
    ):  # fmt: skip
        cls = getattr(np, name, None)
        if isinstance(cls, type) and issubclass(cls, np.integer):
            table[cls] = _from_np_int
    for cls in (np.float16, np.float32, np.float64):
        table[cls] = _from_np_float
    table[np.str_] = _from_np_str
    table[np.bytes_] = _from_np_bytes
    return table


#: Exact type -> encoder for every value that needs no general treatment. numpy
#: scalars and arrays give what their ``tolist()`` normalisation would give.
_ENCODERS: Final[dict[type, _Encoder]] = {**_PLAIN_ENCODERS, **_numpy_encoders()}


# --------------------------------------------------------------------------- public API


def to_meta_value(obj: object, *, path: str = "$") -> spaces_v1.MetaValue:
    """Convert one Python value to a ``MetaValue`` exactly as rlmesh 0.1.0 does.

    Raises what the reference raises, with the same ``str()`` (SPEC §5.1, §9):
    ``TypeError("value of type 'set' is not supported in RLMesh metadata; pass the
    dict through rlmesh.sanitize_metadata(...) to stringify unsupported values")``,
    ``TypeError("'int' object is not an instance of 'str'")`` for a non-str dict key,
    ``OverflowError("metadata integer 18446744073709551615 does not fit int64; ...")``,
    ``UnicodeEncodeError`` for a dict key with lone surrogates. Other exceptions raised
    by the value itself (a ``tolist()`` or ``value`` property that raises) propagate.
    The refused value's location (``path`` plus ``.key`` / ``[i]``
    steps) is added as an exception note, never to the message. A reference cycle
    raises ``RecursionError`` (the reference crashes).
    """
    try:
        return _encode(obj)
    except _REFUSALS as exc:
        _annotate(exc, path)
        raise


def to_meta_map(mapping: Mapping[str, object]) -> spaces_v1.MetaMap:
    """Convert an info dict / options / metadata mapping to a ``MetaMap``.

    Like the reference, the mapping must be a ``dict`` (or a subclass), else
    ``TypeError("'list' object is not an instance of 'dict'")``; keys must be ``str``.
    Values convert as in :func:`to_meta_value` (same errors). Always returns a fresh
    ``MetaMap`` (never shared: callers may add entries); an empty dict is cheap.
    """
    if not isinstance(mapping, dict):
        raise not_instance(mapping, "dict")
    if not mapping:
        return _MetaMap()
    try:
        return _new_map(_encode_entries(mapping))
    except _REFUSALS as exc:
        _annotate(exc, "$")
        raise


def from_meta_value(value: spaces_v1.MetaValue | None) -> object:
    """Convert a ``MetaValue`` to Python (SPEC §5.2); no member set or ``None`` -> None."""
    if value is None:
        return None
    text = value.text
    if text is not None:
        return text
    integer = value.integer
    if integer is not None:
        return integer
    number = value.number
    if number is not None:
        return number
    flag = value.bool
    if flag is not None:
        return flag
    meta_list = value.list
    if meta_list is not None:
        return [from_meta_value(item) for item in meta_list.items]
    meta_map = value.map
    if meta_map is not None:
        return from_meta_map(meta_map)
    return value.bytes  # bytes, or None when no member is set


def from_meta_map(meta: spaces_v1.MetaMap | None) -> dict[str, object]:
    """Convert a ``MetaMap`` to a dict (``None`` -> ``{}``).

    A map entry whose value is absent on the wire (prost omits an empty MetaValue, and
    betterproto2 then parses it as ``None``) reads as ``None``, like an empty MetaValue.
    """
    if meta is None:
        return {}
    entries = meta.entries
    if not entries:
        return {}
    return {key: from_meta_value(value) for key, value in entries.items()}
