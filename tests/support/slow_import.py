"""An entrypoint module whose import takes long (a big env package's): it touches the file
``RLT_SLOW_IMPORT_MARKER`` names, then sleeps ``RLT_SLOW_IMPORT_SECONDS`` (default 30), so
that a test can interrupt a server that is still starting."""

from __future__ import annotations

import os
import time
from typing import Any

import gymnasium as gym

_marker = os.environ.get("RLT_SLOW_IMPORT_MARKER")
if _marker:
    with open(_marker, "w"):
        pass
time.sleep(float(os.environ.get("RLT_SLOW_IMPORT_SECONDS", "30")))


def make() -> Any:
    return gym.make("CartPole-v1")
