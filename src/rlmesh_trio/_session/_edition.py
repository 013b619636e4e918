"""Workflow editions as the reference compares and shows them (its Rust ``str::trim``
and ``{:?}``), for the configure refusal text (SPEC §7.2)."""

from __future__ import annotations

import unicodedata2  # Unicode 18 tables: Python's own unicodedata lags (3.11: Unicode 14)

__all__ = ["edition_matches", "rust_debug_str"]


def rust_debug_str(text: str) -> str:
    """``text`` as Rust's ``{:?}`` prints a str (the reference's error texts use it).

    Quotes around it; ``\\0 \\t \\r \\n \\\\ \\"`` escaped; a grapheme extender or a
    non-printable char (Unicode "Other" and "Separator" but the space, as Rust's and
    Python's definitions agree) as ``\\u{hex}``; everything else as is.
    """
    out = ['"']
    for char in text:
        escaped = _SIMPLE_ESCAPES.get(char)
        if escaped is not None:
            out.append(escaped)
        elif _printable(char) and not _grapheme_extend(char):
            out.append(char)
        else:
            out.append(f"\\u{{{ord(char):x}}}")
    out.append('"')
    return "".join(out)


_SIMPLE_ESCAPES = {"\0": "\\0", "\t": "\\t", "\r": "\\r", "\n": "\\n", "\\": "\\\\", '"': '\\"'}
# Grapheme_Extend beyond the Mn/Me categories (Unicode's DerivedCoreProperties).
_EXTEND_EXTRA = frozenset(
    [
        *(0x09BE, 0x09D7, 0x0B3E, 0x0B57, 0x0BBE, 0x0BD7, 0x0CC2, 0x0CD5, 0x0CD6, 0x0D3E),
        *(0x0D57, 0x0DCF, 0x0DDF, 0x1B35, 0x200C, 0x302E, 0x302F, 0xFF9E, 0xFF9F, 0x1133E),
        *(0x11357, 0x114B0, 0x114BD, 0x115AF, 0x11930, 0x1D165),
        *range(0x1D16E, 0x1D173),
        *range(0xE0020, 0xE0080),
    ]
)


def _grapheme_extend(char: str) -> bool:
    return unicodedata2.category(char) in ("Mn", "Me") or ord(char) in _EXTEND_EXTRA


def _printable(char: str) -> bool:
    """Not Unicode "Other" (Cc Cf Cs Co Cn) nor "Separator" (Zl Zp Zs), the space aside."""
    if char == " ":
        return True
    return unicodedata2.category(char)[0] not in "CZ"


# Rust's char::is_whitespace (Unicode White_Space), which str::trim strips.
_RUST_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"


def edition_matches(selected: str, implemented: str) -> bool:
    """The reference's test of a configure edition: empty, or -- trimmed of Unicode
    whitespace -- the implemented edition or one of its ``<edition>-...`` variants."""
    if not selected:
        return True
    trimmed = selected.strip(_RUST_WHITESPACE)
    return trimmed == implemented or trimmed.startswith(implemented + "-")
