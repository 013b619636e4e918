"""The packaging facts the sessions rely on stay consistent: ranges in pyproject.toml,
their low ends in constraints/lowest.txt, CI's exact pins in constraints/ci.txt (inside
the ranges, equal to the extras' pins), the claimed Pythons, the README's statement of
the ranges, and the Dockerfile's shape that tools/check_package.py runs."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DEPENDENCIES = [Requirement(r) for r in PROJECT["dependencies"]]
PYTHONS = ("3.11", "3.12", "3.13", "3.14", "3.15")


def environment(python: str) -> dict[str, str]:
    """A marker environment: Linux CPython at ``python``."""
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_python_implementation": "CPython",
        "implementation_name": "cpython",
        "os_name": "posix",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "extra": "",
    }


def applies(marker: Marker | None, python: str) -> bool:
    return marker is None or marker.evaluate(environment(python))


def constraints(name: str) -> list[Requirement]:
    lines = (ROOT / "constraints" / name).read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def pins(requirements: list[Requirement], python: str) -> dict[str, Version]:
    """``name -> version`` of the ``==`` requirements in force at ``python`` (each once)."""
    out: dict[str, Version] = {}
    for req in requirements:
        if not applies(req.marker, python):
            continue
        name = canonicalize_name(req.name)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{req}: not an exact pin"
        assert name not in out, f"{req.name} pinned twice for Python {python}"
        out[name] = Version(spec.version)
    return out


def low_end(req: Requirement) -> Version:
    (low,) = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    return low


def extra_ranges() -> list[Requirement]:
    """The extras' requirements that are ranges, not pins (protobuf: a user's stack has
    its own; the other extras pin)."""
    return [
        req
        for group in PROJECT["optional-dependencies"].values()
        for req in map(Requirement, group)
        if not any(s.operator == "==" for s in req.specifier)
    ]


def test_every_dependency_is_a_range_with_a_low_end_that_lowest_pins() -> None:
    for python in PYTHONS:
        lowest = pins(constraints("lowest.txt"), python)
        wanted = {
            canonicalize_name(r.name): low_end(r)
            for r in [*DEPENDENCIES, *extra_ranges()]
            if applies(r.marker, python)
        }
        assert lowest == wanted, f"Python {python}"


def test_only_unicodedata2_is_exact() -> None:
    exact = [r.name for r in DEPENDENCIES if any(s.operator == "==" for s in r.specifier)]
    assert exact == ["unicodedata2"]  # its Unicode version is part of the wire answers


def test_ci_pins_lie_in_the_ranges_and_agree_with_the_extras() -> None:
    ci = constraints("ci.txt")
    groups = PROJECT["optional-dependencies"].values()
    for python in PYTHONS:
        pinned = pins(ci, python)
        for req in DEPENDENCIES:
            if applies(req.marker, python):
                version = pinned[canonicalize_name(req.name)]
                assert req.specifier.contains(version), f"{req} vs {version} (Python {python})"
        for group in groups:
            exact = [Requirement(r) for r in group if "==" in r]
            for name, version in pins(exact, python).items():
                assert pinned.get(name) == version, (
                    f"{name}: extra {version}, ci {pinned.get(name)}"
                )
        for req in extra_ranges():
            if applies(req.marker, python):
                version = pinned[canonicalize_name(req.name)]
                assert req.specifier.contains(version), f"{req} vs {version} (Python {python})"


BOUND_AT = {"grpclib": 3, "h2": 2}
"""The libraries whose internals the transport reaches into (``_transport/_connection.py``,
``_shim.py``), and the release part their upper bound sits at: h2's next minor, grpclib's
next 0.4.x (each 0.4.x release changes its internals)."""


def test_bounds_on_internals_sit_just_past_the_ci_pin() -> None:
    """Such a range admits nothing newer than the release CI tests: widening it is the
    commit that moves the pin in constraints/ci.txt (docs/decisions.md)."""
    ranges = {canonicalize_name(r.name): r.specifier for r in DEPENDENCIES}
    for python in PYTHONS:
        pinned = pins(constraints("ci.txt"), python)
        for name, part in BOUND_AT.items():
            (upper,) = [Version(s.version) for s in ranges[name] if s.operator == "<"]
            release = pinned[name].release
            after = Version(".".join(map(str, [*release[: part - 1], release[part - 1] + 1])))
            assert upper == after, f"{name}: bound <{upper}, CI pin {pinned[name]}"


def test_nox_and_build_are_pinned_in_the_dev_extra() -> None:
    dev = {canonicalize_name(Requirement(r).name) for r in PROJECT["optional-dependencies"]["dev"]}
    assert {"nox", "build"} <= dev


def test_the_claimed_pythons_start_at_requires_python() -> None:
    claimed = [
        c.rsplit(" :: ", 1)[1]
        for c in PROJECT["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    ]
    assert claimed == list(PYTHONS)
    assert PROJECT["requires-python"] == f">={claimed[0]}"


def every_requirement() -> list[tuple[str, Requirement]]:
    """Every requirement line: pyproject's dependencies and extras, both constraints files."""
    out = [("pyproject.toml", r) for r in DEPENDENCIES]
    for name, group in PROJECT["optional-dependencies"].items():
        out += [(f"pyproject.toml [{name}]", Requirement(r)) for r in group]
    for name in ("ci.txt", "lowest.txt"):
        out += [(f"constraints/{name}", r) for r in constraints(name)]
    return out


def test_every_python_marker_splits_the_claimed_pythons() -> None:
    """A ``python_version`` marker true on no claimed Python (a special case for one that
    is no longer claimed) or on all of them (a marker that says nothing) is dead weight."""
    for where, req in every_requirement():
        if req.marker is None or "python_version" not in str(req.marker):
            continue
        holds = [applies(req.marker, python) for python in PYTHONS]
        assert any(holds) and not all(holds), f"{where}: {req}"


def test_no_code_branches_on_an_unclaimed_python() -> None:
    """No ``sys.version_info`` test (nor the exceptiongroup backport) for a Python below
    ``requires-python``: src/, tests/, bench/, examples/ and tools/ assume it."""
    floor = tuple(int(x) for x in PROJECT["requires-python"].removeprefix(">=").split("."))
    checks = re.compile(r"sys\.version_info\s*([<>]=?)\s*\((\d+),\s*(\d+)\)")
    for folder in ("src", "tests", "bench", "examples", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            where = path.relative_to(ROOT)
            assert "exceptiongroup" not in text or path == Path(__file__).resolve(), where
            for op, major, minor in checks.findall(text):
                # Each of <, <=, >, >= against (3, x) with x <= the floor is decided on
                # every claimed Python (3.11.7 > (3, 11) holds).
                version = (int(major), int(minor))
                assert version > floor, f"{where}: sys.version_info {op} {version}"


def test_the_readme_states_the_ranges_of_pyproject() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Installing into your own environment", 1)[1].split("\n## ", 1)[0]
    stated = re.findall(r"`([A-Za-z0-9_.-]+(?:[<>=!~]=?[0-9.]+,?)+)`", section)
    assert len(stated) >= 6
    ranges = {canonicalize_name(r.name): r.specifier for r in DEPENDENCIES}
    for item in stated:
        req = Requirement(item)
        assert ranges[canonicalize_name(req.name)] == req.specifier, item


def _check_package() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_package", ROOT / "tools/check_package.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    result: list[tuple[str, str]] = _check_package().dockerfile_instructions(
        ROOT / "deploy" / "kubernetes" / "Dockerfile"
    )
    return result


def test_the_image_installs_the_wheel_built_here_with_metrics_as_non_root(
    dockerfile: list[tuple[str, str]],
) -> None:
    words = [w for w, _ in dockerfile]
    last_from = len(words) - 1 - words[::-1].index("FROM")
    final = dockerfile[last_from:]
    runs = [a for w, a in dockerfile if w == "RUN"]
    assert runs and all(a.startswith("sh ") and "image.sh" in a for a in runs)
    assert all(not re.search(r"(^|\s)/", a) for a in runs), "RUN paths must be relative"
    assert "pip install rlmesh-trio" not in (ROOT / "deploy/kubernetes/Dockerfile").read_text()
    script = (ROOT / "deploy/kubernetes/image.sh").read_text()
    assert 'extras="${4:-metrics}"' in script and "[${extras}]" in script and "-c " in script
    (user,) = [a for w, a in final if w == "USER"]
    assert user.split(":")[0] not in ("root", "0")
    (health,) = [a for w, a in final if w == "HEALTHCHECK"]
    assert health.split("CMD ", 1)[1].startswith('["rlmesh-trio", "probe"')
    for word, args in dockerfile:  # every COPY from the build context exists in it
        if word == "COPY" and "--from=" not in args:
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), source
