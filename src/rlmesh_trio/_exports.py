"""Public names show their public path: ``rlmesh_trio.client.Endpoint``, not the private
module that defines it (in reprs, tracebacks, ``help()`` and the docs).

Each public package calls :func:`publish` at the end of its ``__init__``; pickling by
reference keeps working, because every name published this way is an attribute of the
module it now names.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

PACKAGE = "rlmesh_trio"


def publish(module: str, namespace: Mapping[str, Any], names: Iterable[str] | None = None) -> None:
    """Set ``__module__`` of the classes and functions in ``names`` (default: the
    module's ``__all__``) defined inside this package to ``module``."""
    for name in namespace["__all__"] if names is None else names:
        if name in namespace:
            fix(namespace[name], module)


def fix(obj: Any, module: str) -> None:
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return
    if not getattr(obj, "__module__", "").startswith(f"{PACKAGE}."):
        return
    obj.__module__ = module
    if inspect.isclass(obj):
        for member in vars(obj).values():
            target = member.fget if isinstance(member, property) else member
            if inspect.isfunction(target) and target.__module__.startswith(f"{PACKAGE}."):
                target.__module__ = module
