"""Soft conformance checks (SPEC §3.7.2-3.7.5): what they find and how they word it.

A *soft* violation never fails a request: it becomes a :class:`Candidate`, which the
server may report in the ``rlmesh.conformance.warning`` info entry (or turn into an error
under the ``strict`` policy). Only two kinds of leaf have soft checks:

* Box: an element above ``high`` or below ``low`` (the first such flat row-major element,
  whichever side it violates; ±inf are ordinary out-of-bounds values; values exactly on a
  bound pass).
* Text: the length in characters (code points) against ``min_length`` / ``max_length``,
  checked before the charset; then the first character outside a non-empty charset.

Everything else (NaN in a Box, Discrete/MultiDiscrete ranges, sizes, types) is a *hard*
check, raised by the codec itself. The checks are the same for actions and
observations; only :attr:`Candidate.kind` differs. The value walk that decides which leaf
is looked at (wire order, stop at the first violating leaf) lives in ``_spaces``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np

ACTION: Final = "action"
"""``Candidate.kind`` of a violation found in a client's action."""

OBSERVATION: Final = "observation"
"""``Candidate.kind`` of a violation found in an env's observation."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One soft conformance violation (SPEC §3.7.1): a would-be warning entry."""

    kind: str
    """``"action"`` or ``"observation"``."""
    path: str
    """Where in the value: ``$``, ``$.key``, ``$[1]``, ``$.nest.t[0]``."""
    detail: str
    """``path + ": " + message``, e.g. ``$.box: Box value at element 0 out of bounds: above high bound``."""


def make_candidate(kind: str, path: str, message: str) -> Candidate:
    """The candidate for ``message`` found at ``path``."""
    return Candidate(kind=kind, path=path, detail=f"{path}: {message}")


class BoxBounds:
    """A Box leaf's bounds, prepared once so that checking a value is cheap.

    A side whose bound can never be crossed (``-inf`` / ``+inf`` for floats, the dtype's
    minimum / maximum for integers, ``False`` / ``True`` for bool) is not compared at all;
    a uniform bound is compared as a scalar. A uint8 Box with bounds ``[0, 255]``
    therefore costs nothing per value.
    """

    __slots__ = ("_high", "_high_scalar", "_low", "_low_scalar", "checks")

    def __init__(self, low: np.ndarray[Any, Any], high: np.ndarray[Any, Any]) -> None:
        """``low`` and ``high``: flat arrays of the leaf dtype, one entry per element."""
        self._low, self._low_scalar = _prepare_side(low, _floor_of(low.dtype))
        self._high, self._high_scalar = _prepare_side(high, _ceiling_of(high.dtype))
        self.checks = self._low is not None or self._high is not None
        """False when no value of the dtype can violate the bounds."""

    def violation(self, flat: np.ndarray[Any, Any]) -> str | None:
        """The message for the first out-of-bounds element of ``flat`` (no NaN in it), or None."""
        if not self.checks or flat.size == 0:
            return None
        low, high = self._low, self._high
        # Cheap screening first: a uniform bound needs only the extreme value.
        below_possible = low is not None and (not self._low_scalar or flat.min() < low)
        above_possible = high is not None and (not self._high_scalar or flat.max() > high)
        if not below_possible and not above_possible:
            return None
        above = flat > high if above_possible else None
        below = flat < low if below_possible else None
        if above is not None and below is not None:
            bad = above | below
        else:
            bad = above if above is not None else below
        assert bad is not None
        if not bad.any():
            return None
        index = int(np.argmax(bad))
        side = "above high bound" if above is not None and above[index] else "below low bound"
        return f"Box value at element {index} out of bounds: {side}"


def _floor_of(dtype: np.dtype[Any]) -> Any:
    if dtype.kind == "f":
        return -np.inf
    if dtype.kind == "b":
        return False
    return np.iinfo(dtype).min


def _ceiling_of(dtype: np.dtype[Any]) -> Any:
    if dtype.kind == "f":
        return np.inf
    if dtype.kind == "b":
        return True
    return np.iinfo(dtype).max


def _prepare_side(bound: np.ndarray[Any, Any], unreachable: Any) -> tuple[Any, bool]:
    """``(None, _)`` when the side never binds; ``(scalar, True)``; or ``(array, False)``."""
    if bound.size == 0 or bool(np.all(bound == unreachable)):
        return None, True
    first = bound[0]
    if bool(np.all(bound == first)):
        return first, True
    return bound, False


class TextRules:
    """A Text leaf's length limits and charset (an empty charset means any character)."""

    __slots__ = ("_charset", "max_length", "min_length")

    def __init__(self, min_length: int, max_length: int, charset: str) -> None:
        self.min_length = min_length
        self.max_length = max_length
        self._charset = frozenset(charset) if charset else None

    def violation(self, text: str) -> str | None:
        """Length (in characters) before charset; the first character outside it."""
        length = len(text)
        if length < self.min_length:
            return f"text length {length} below minimum {self.min_length}"
        if length > self.max_length:
            return f"text length {length} exceeds maximum {self.max_length}"
        charset = self._charset
        if charset is None or charset.issuperset(text):
            return None
        for char in text:
            if char not in charset:
                return f"character '{char}' not in charset"
        return None  # pragma: no cover - issuperset said otherwise
