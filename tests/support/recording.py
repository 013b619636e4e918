"""What the recording tests share: the skip for envs whose ``rgb_array`` frames need
pygame, and a private Minari root per test."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

__all__ = ["NEEDS_PYGAME", "private_minari_root"]

NEEDS_PYGAME = pytest.mark.skipif(
    importlib.util.find_spec("pygame") is None,
    reason="rgb_array rendering of classic-control envs needs pygame (not installed)",
)


def private_minari_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point Minari (``MINARI_DATASETS_PATH``) at a fresh directory under ``tmp_path``
    and return it, so that no test reads or writes the user's datasets."""
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root
