"""Every script under bench/ and examples/ still starts: each bench script answers
``--help`` (its imports and its argument parser), each example is imported (run as a
module that is not ``__main__``). A script whose import broke -- bench_fleet.py importing
``rlmesh_trio._transport.probe`` long after the probe moved -- fails here, the day it
breaks, not the day someone next runs it.

A script is skipped only when it needs an optional dependency (a package of one of
pyproject's extras, Ray, Stable-Baselines3, ..., or one such a package brings: torch) that
this environment lacks; any other missing module (ours, a required dependency's, a typo)
fails. The scripts run in subprocesses, all at once.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
BENCH = sorted(p for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))
"""The bench scripts (``bench/_*.py`` are the modules they share, imported by them)."""
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT = 120.0
"""Seconds for one script to start (every one runs at once; Ray's import is the slowest)."""

BROUGHT_BY_AN_EXTRA = {"torch": "stable-baselines3"}
"""Modules an extra's package brings (examples/cleanrl_ppo.py imports torch)."""

IMPORT_AS_MODULE = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='imported')"
MISSING = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def optional_distributions() -> set[str]:
    """The distributions an extra of pyproject.toml brings (canonical names)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = {
        canonicalize_name(Requirement(r).name)
        for group in project["optional-dependencies"].values()
        for r in group
    }
    brought = {name for name, by in BROUGHT_BY_AN_EXTRA.items() if by in named}
    return named | brought


def command(script: Path) -> list[str]:
    if script.parent.name == "bench":
        return [sys.executable, str(script), "--help"]
    return [sys.executable, "-c", IMPORT_AS_MODULE, str(script)]


@pytest.fixture(scope="module")
def started() -> Iterator[dict[Path, subprocess.Popen[str]]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    procs = {
        script: subprocess.Popen(
            command(script),
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for script in [*BENCH, *EXAMPLES]
    }
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def outcome(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still starting after {TIMEOUT} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def skip_if_optional_is_absent(err: str) -> None:
    """Skip when the failure is an optional dependency (an extra's) missing here."""
    found = MISSING.search(err)
    if found is None:
        return
    top = found.group(1).split(".")[0]
    if importlib.util.find_spec(top) is None and (
        canonicalize_name(top) in optional_distributions()
    ):
        pytest.skip(f"needs {top} (an optional dependency), not installed here")


def test_there_are_scripts_to_check() -> None:
    assert len(BENCH) >= 10 and len(EXAMPLES) >= 3


@pytest.mark.parametrize("script", BENCH, ids=[p.name for p in BENCH])
def test_bench_script_answers_help(
    started: dict[Path, subprocess.Popen[str]], script: Path
) -> None:
    code, out, err = outcome(started[script])
    if code != 0:
        skip_if_optional_is_absent(err)
    assert code == 0, err[-3000:]
    assert out.lstrip().startswith("usage:"), out[:500]


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_imports(started: dict[Path, subprocess.Popen[str]], script: Path) -> None:
    code, _, err = outcome(started[script])
    if code != 0:
        skip_if_optional_is_absent(err)
    assert code == 0, err[-3000:]
