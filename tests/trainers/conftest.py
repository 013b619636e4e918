"""The trainers' runs (``nox -s trainers``): torch made deterministic for them, and each
training run's wall and CPU time printed at the end of the session (docs/bench.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from timings import TIMINGS


@pytest.fixture(scope="module")
def deterministic_torch() -> Iterator[Any]:
    """torch on one thread with deterministic algorithms, for the module's runs."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield torch
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TIMINGS:
        return
    terminalreporter.section("training runs (wall / this process's CPU)")
    terminalreporter.write_line(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for t in TIMINGS:
        terminalreporter.write_line(
            f"{t.trainer:<8} {t.envs:<40} {t.wall_seconds:7.1f} s  {t.cpu_seconds:7.1f} s"
        )
