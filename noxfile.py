"""Development sessions: ``nox -s tests | ray | tests-process | fuzz | envs | lint | typecheck |
codegen | bench``.

Every session builds its own virtualenv (``venv`` backend) with the interpreter that
runs nox, and installs exactly the pins of ``pyproject.toml``: the ``test`` extra for
tests and benchmarks, the ``dev`` extra's pins for the tools.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "ray", "lint", "typecheck"]
nox.options.error_on_external_run = True

ROOT = Path(__file__).resolve().parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")


def dev_pin(name: str) -> str:
    """The ``name==version`` requirement of the ``dev`` extra in pyproject.toml."""
    for requirement in PYPROJECT["project"]["optional-dependencies"]["dev"]:
        if requirement.split("==")[0].strip().lower() == name.lower():
            return str(requirement)
    raise LookupError(f"{name} is not pinned in the dev extra of pyproject.toml")


@nox.session
def tests(session: nox.Session) -> None:
    """Install the package with its test extra and run the pytest suite (but the Ray tests)."""
    session.install(".[test]")
    # The Ray fleet tests start Ray clusters (minutes on 2 cores): their own session.
    session.run("pytest", "-m", "not ray", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """The differential JoinRequest fuzz test, long: ``RLMESH_FUZZ_COUNT`` messages per peer
    (3000 unless set; the default suite runs 400)."""
    session.install(".[test]")
    count = os.environ.get("RLMESH_FUZZ_COUNT", "3000")
    session.run(
        "pytest",
        "tests/test_fuzz_differential.py",
        *session.posargs,
        env={"RLMESH_FUZZ_COUNT": count},
    )


@nox.session(name="tests-process")
def tests_process(session: nox.Session) -> None:
    """The interop and differential suites again, every rlmesh-trio server with process
    lanes (``--lane-isolation process``): the same answers as the reference."""
    session.install(".[test]")
    session.run(
        "pytest",
        "tests/test_interop.py",
        "tests/test_differential.py",
        "tests/test_errors_wire.py",
        *session.posargs,
        env={"RLMESH_TEST_LANE_ISOLATION": "process"},
    )


@nox.session
def envs(session: nox.Session) -> None:
    """Popular third-party envs (MiniGrid, ...) served through rlmesh's own clients."""
    session.install(".[test,envs]")
    session.run("pytest", "-m", "envs", *session.posargs)


@nox.session
def ray(session: nox.Session) -> None:
    """The fleet's tests on a local Ray (``-m ray``: one Ray per module, loopback only);
    ``tests`` leaves them out, CI (``.ci/run``) runs both."""
    session.install(".[test]")
    session.run("pytest", "-m", "ray", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the repository."""
    session.install(dev_pin("ruff"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on src/rlmesh_trio (configured in pyproject.toml)."""
    session.install("-e", ".", dev_pin("mypy"))
    session.run("mypy", *session.posargs)


@nox.session
def codegen(session: nox.Session) -> None:
    """Regenerate src/rlmesh_trio/_proto from proto/; ``-- --check`` fails on drift."""
    session.install(dev_pin("betterproto2-compiler"), dev_pin("grpcio-tools"))
    session.run("python", "tools/codegen.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Run every bench/bench_*.py (arguments after ``--`` go to each of them)."""
    session.install(".[test]")
    scripts = sorted((ROOT / "bench").glob("bench_*.py"))
    if not scripts:
        session.error("no bench/bench_*.py found")
    for script in scripts:
        session.log(f"=== {script.name}")
        session.run("python", str(script.relative_to(ROOT)), *session.posargs)


if __name__ == "__main__":
    sys.exit("run this file with nox, e.g. `nox -s tests`")
