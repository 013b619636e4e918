"""Old public names kept working for one release, each with a ``DeprecationWarning``.

Three shapes of rename, one helper each:

* a keyword argument -- :func:`renamed_kwargs` wraps the callable (a function, a method,
  ``__init__``, an ``async def`` or an async context manager factory) and maps the old
  keyword onto the new one, optionally converting the value (``request_timeout_ms`` ->
  ``request_timeout_seconds`` divides by 1000);
* an attribute of a record -- :func:`renamed_attribute` is a read-only property under the
  old name that reads the new one;
* a module-level name -- :func:`module_getattr` builds the module's ``__getattr__``.

Passing both the old and the new keyword is a ``TypeError``, as a repeated keyword is.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

REMOVAL = "0.2"
"""The release the deprecated names go away in."""

Rename = str | tuple[str, Callable[[Any], Any]]
"""The new keyword, or the new keyword and how an old value converts to it."""


def warn(old: str, new: str, *, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{old} is deprecated and will be removed in rlmesh-trio {REMOVAL}; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_kwargs(**renames: Rename) -> Callable[[F], F]:
    """Accept ``old=value`` for each ``old=new`` (or ``old=(new, convert)``) given."""
    table: dict[str, tuple[str, Callable[[Any], Any] | None]] = {
        old: (spec, None) if isinstance(spec, str) else spec for old, spec in renames.items()
    }

    def decorate(func: F) -> F:
        where = func.__qualname__.removesuffix(".__init__")

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not table.keys().isdisjoint(kwargs):
                for old in [name for name in kwargs if name in table]:
                    new, convert = table[old]
                    if new in kwargs:
                        raise TypeError(f"{where}() got both {old}= and {new}=; pass {new}=")
                    value = kwargs.pop(old)
                    if convert is not None and value is not None:
                        value = convert(value)
                    kwargs[new] = value
                    warn(f"{where}({old}=)", f"{new}=")
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def renamed_attribute(new: str, *, owner: str, old: str) -> property:
    """A read-only property ``owner.old`` that warns and returns ``self.<new>``."""

    def get(self: object) -> Any:
        warn(f"{owner}.{old}", f"{owner}.{new}")
        return getattr(self, new)

    return property(get, doc=f"Deprecated: use :attr:`{new}`.")


def module_getattr(module: str, renames: Mapping[str, tuple[str, Callable[[], Any]]]) -> Any:
    """A module ``__getattr__`` serving ``old`` as ``renames[old] = (new, load)``."""

    def __getattr__(name: str) -> Any:
        if name in renames:
            new, load = renames[name]
            warn(f"{module}.{name}", new)
            return load()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
