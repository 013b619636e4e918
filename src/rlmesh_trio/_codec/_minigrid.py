"""MiniGrid's ``MissionSpace``, served as the ``Text`` space that holds its missions.

MiniGrid's observations carry a ``mission`` string whose space is not a gymnasium
fundamental space; rlmesh has no spec for it, so the codec serves it as a ``Text``
(``_spaces._to_spec`` asks :func:`is_mission_space` first). minigrid itself is never
imported: the space is recognised by its class's name and module.
"""

from __future__ import annotations

import itertools
from typing import Any

import gymnasium as gym

__all__ = [
    "MISSION_ENUMERATION_LIMIT",
    "MISSION_FALLBACK_CHARSET",
    "MISSION_FALLBACK_MAX_LENGTH",
    "is_mission_space",
    "mission_text_space",
]

MISSION_ENUMERATION_LIMIT = 100_000
"""At most this many mission strings are enumerated to size a MissionSpace's Text."""

MISSION_FALLBACK_CHARSET = "".join(chr(c) for c in range(0x20, 0x7F))
"""Printable ASCII: the charset of a MissionSpace whose missions cannot be enumerated."""

MISSION_FALLBACK_MAX_LENGTH = 1024


def is_mission_space(space: Any) -> bool:
    """MiniGrid's ``MissionSpace`` (or a subclass), recognised without importing minigrid."""
    return any(
        cls.__name__ == "MissionSpace" and cls.__module__.startswith("minigrid")
        for cls in type(space).__mro__
    )


def mission_text_space(space: Any) -> gym.spaces.Text:
    """The ``Text`` space a MiniGrid ``MissionSpace`` is served as (values: its strings).

    Its charset and lengths hold every mission the space can produce: they are computed
    from ``mission_func`` over every combination of ``ordered_placeholders``. A space
    whose missions cannot be enumerated (BabyAI's free-form missions, more than
    :data:`MISSION_ENUMERATION_LIMIT` combinations) gets printable ASCII and a maximum of
    :data:`MISSION_FALLBACK_MAX_LENGTH` characters.
    """
    placeholders = getattr(space, "ordered_placeholders", None)
    func = getattr(space, "mission_func", None)
    missions: list[str] | None = None
    if callable(func) and type(space).__name__ == "MissionSpace":
        combos = 1
        for options in placeholders or []:
            combos *= max(len(options), 1)
        if combos <= MISSION_ENUMERATION_LIMIT:
            try:
                missions = [str(func(*args)) for args in itertools.product(*(placeholders or []))]
            except Exception:
                missions = None
    if not missions:
        return gym.spaces.Text(
            MISSION_FALLBACK_MAX_LENGTH, min_length=1, charset=MISSION_FALLBACK_CHARSET
        )
    chars = sorted({char for mission in missions for char in mission})
    return gym.spaces.Text(
        max(len(m) for m in missions),
        min_length=max(1, min(len(m) for m in missions)),
        charset="".join(chars),
    )
