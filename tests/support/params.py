"""pytest parameters shared by the interop, differential and error tests."""

from __future__ import annotations

import pytest

from .refserver import OURS_MISSING_REASON, ours_available

skip_without_ours = pytest.mark.skipif(not ours_available(), reason=OURS_MISSING_REASON)

SERVER_KINDS = [
    pytest.param("ref", id="ref"),
    pytest.param("ours", id="ours", marks=skip_without_ours),
]
"""Each server on its own (interop tests)."""

PEERS = [
    pytest.param("ref", id="ref-vs-ref"),
    pytest.param("ours", id="ours-vs-ref", marks=skip_without_ours),
]
"""What the reference is compared with: a second reference process (which proves the
normalisation of the comparison), or ours."""

TRANSPORTS = [pytest.param("tcp", id="tcp"), pytest.param("unix", id="unix")]
