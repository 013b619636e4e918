"""Wall and CPU time of the training runs, for the session's summary (conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Timing:
    trainer: str
    envs: str
    wall_seconds: float
    cpu_seconds: float
    """This process's CPU time (the trainer's; an env in another process not counted)."""


TIMINGS: list[Timing] = []


def timed(trainer: str, envs: str, run: Callable[[], T]) -> T:
    """``run()``, its wall and CPU time recorded for the session's summary."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    TIMINGS.append(Timing(trainer, envs, time.perf_counter() - wall, time.process_time() - cpu))
    return result
