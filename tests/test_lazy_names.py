"""A module that serves names lazily (a module ``__getattr__``) lists them in its
``__dir__`` too, so ``dir()``, completion and ``help()`` see what ``getattr`` finds;
listing them imports nothing. Deprecated names (``_deprecation.module_getattr``) stay
out of ``dir()``: they work, and are not advertised."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import rlmesh_trio

ROOT = Path(rlmesh_trio.__file__).parent


def _lazy_modules() -> list[str]:
    """Modules with a ``def __getattr__`` of their own at module level."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.append(".".join(["rlmesh_trio", *parts]))
    return found


def test_the_scan_finds_the_lazy_modules() -> None:
    assert {"rlmesh_trio", "rlmesh_trio._lanes"} <= set(_lazy_modules())


@pytest.mark.parametrize("name", _lazy_modules())
def test_a_lazy_module_lists_what_it_serves(name: str) -> None:
    module = importlib.import_module(name)
    assert "__dir__" in vars(module), f"{name} has a lazy __getattr__ and no __dir__"
    listed = dir(module)
    assert listed == sorted(listed)
    for attr in listed:
        getattr(module, attr)  # every name listed is there
    assert set(getattr(module, "__all__", ())) <= set(listed)


def test_the_package_lists_the_server_without_importing_it() -> None:
    code = (
        "import sys, rlmesh_trio, rlmesh_trio._lanes as lanes\n"
        "assert {'serve_env', 'ServerInfo'} <= set(dir(rlmesh_trio))\n"
        "assert {'LaneEngine', 'LaneState', 'LaneStatus'} <= set(dir(lanes))\n"
        "assert 'rlmesh_trio._serve' not in sys.modules\n"
        "assert 'rlmesh_trio._lanes._engine' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_deprecated_names_work_and_are_not_listed() -> None:
    import rlmesh_trio.fleet as fleet

    assert "Endpoint" not in dir(fleet)
    with pytest.warns(DeprecationWarning, match="EndpointStatus"):
        assert fleet.Endpoint is fleet.EndpointStatus  # type: ignore[attr-defined]
