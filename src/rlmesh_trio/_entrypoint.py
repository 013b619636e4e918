"""``module:callable`` env factories (``--entrypoint``), for ``serve`` and ``fleet`` alike."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["load_entrypoint"]


def load_entrypoint(spec: str) -> Callable[..., Any]:
    """Import ``module`` and return its (dotted) ``callable`` attribute.

    Raises :class:`ValueError` for a spec that is not ``module:callable``,
    :class:`TypeError` when the attribute is not callable, and whatever the import or
    the attribute lookup raises.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"--entrypoint must be module:callable, got {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{spec} is not callable")
    return target  # type: ignore[no-any-return]
