"""The public surface, pinned: every public module, what it exports, and how it shows it.

For each public module: ``__all__`` is sorted and has no duplicates; every name in it
exists; every public attribute of the module (no leading underscore, not a submodule, not
an imported helper) is listed; each exported class and function names the public module
as its ``__module__`` (reprs, tracebacks and ``help()`` show the path a user imports) and
carries a docstring; no two public modules export different objects under one name.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import pickle
import types
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(60)

PUBLIC_MODULES = ("rlmesh_trio", "rlmesh_trio.client", "rlmesh_trio.fleet", "rlmesh_trio.fleet.ray")

ALLOWED_EXTRA = {"rlmesh_trio": {"annotations", "TYPE_CHECKING", "Any"}}
"""Module attributes that are not exports (imports a module needs for itself)."""


def load(name: str) -> types.ModuleType:
    if name == "rlmesh_trio.fleet.ray":
        pytest.importorskip("ray")
    return importlib.import_module(name)


def exported(module: types.ModuleType) -> dict[str, Any]:
    return {name: getattr(module, name) for name in module.__all__}


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_is_sorted_unique_and_complete(name: str) -> None:
    module = load(name)
    names = list(module.__all__)
    assert names == sorted(names), "keep __all__ sorted"
    assert len(set(names)) == len(names)
    for export in names:
        assert hasattr(module, export), f"{name}.__all__ lists {export}, which is missing"
    public = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_")
        and not isinstance(value, types.ModuleType)
        and attr not in ALLOWED_EXTRA.get(name, set())
        # typing helpers and the like imported for annotations: not defined by us
        and (getattr(value, "__module__", name) or "").startswith("rlmesh_trio")
    }
    assert public - set(names) == set(), f"public but not in {name}.__all__"


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_exports_show_their_public_path_and_a_docstring(name: str) -> None:
    module = load(name)
    assert (module.__doc__ or "").strip(), f"{name} has no docstring"
    for export, value in exported(module).items():
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        assert value.__module__ == name, f"{name}.{export}.__module__ is {value.__module__}"
        assert (value.__doc__ or "").strip(), f"{name}.{export} has no docstring"
        if inspect.isclass(value) and not isinstance(value, enum.EnumMeta):
            assert repr(value) == f"<class '{name}.{value.__qualname__}'>"


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_exported_classes_pickle_by_their_public_path(name: str) -> None:
    module = load(name)
    for value in exported(module).values():
        if inspect.isclass(value) or inspect.isfunction(value):
            assert pickle.loads(pickle.dumps(value)) is value


def test_no_public_name_means_two_things() -> None:
    seen: dict[str, tuple[str, Any]] = {}
    for name in PUBLIC_MODULES:
        try:
            module = load(name)
        except pytest.skip.Exception:
            continue
        for export, value in exported(module).items():
            if export == "__version__":
                continue
            if export in seen:
                other, earlier = seen[export]
                assert earlier is value, f"{name}.{export} and {other}.{export} differ"
            seen[export] = (name, value)


def test_every_error_shares_the_package_root() -> None:
    from rlmesh_trio import RlmeshTrioError

    for name in PUBLIC_MODULES:
        try:
            module = load(name)
        except pytest.skip.Exception:
            continue
        for export, value in exported(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException):
                assert issubclass(value, RlmeshTrioError), f"{name}.{export}"
