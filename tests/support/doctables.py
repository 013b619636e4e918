"""State tables held against the docs that draw them (the lanes', the Join's)."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import TypeVar

DOCS = Path(__file__).resolve().parent.parent.parent / "docs"

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)


def documented_transitions(doc: str, marker: str, states: type[S]) -> set[tuple[S, S]]:
    """The ``| from | to |`` rows of the table right after the line starting with
    ``marker`` in ``docs/<doc>``, as pairs of ``states`` (each cell a backquoted value)."""
    lines = (DOCS / doc).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(marker))
    rows: set[tuple[S, S]] = set()
    body = lines[start + 1 :]
    assert body[0].startswith("| from | to |"), body[0]
    assert set(body[1].replace("|", "").split()) == {"---"}, body[1]
    for line in body[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        old, new = (re.fullmatch(r"`(\w+)`", cell) for cell in cells[:2])
        assert old is not None and new is not None, line
        pair = (states(old.group(1)), states(new.group(1)))
        assert pair not in rows, f"row listed twice: {line}"
        rows.add(pair)
    return rows


def documented_table(
    doc: str, marker: str, states: type[S], events: type[E]
) -> dict[tuple[S, E], S]:
    """The ``| from | event | to |`` rows of the table right after the line starting
    with ``marker`` in ``docs/<doc>``, as ``{(state, event): state}`` (each cell a
    backquoted value)."""
    lines = (DOCS / doc).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(marker))
    table: dict[tuple[S, E], S] = {}
    body = lines[start + 1 :]
    assert body[0].startswith("| from | event | to |"), body[0]
    assert set(body[1].replace("|", "").split()) == {"---"}, body[1]
    for line in body[2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        old, event, new = (re.fullmatch(r"`(\w+)`", cell) for cell in cells[:3])
        assert old is not None and event is not None and new is not None, line
        key = (states(old.group(1)), events(event.group(1)))
        assert key not in table, f"row listed twice: {line}"
        table[key] = states(new.group(1))
    return table
