"""What every benchmark sets up first: ``import _support`` before anything of ``support``.

The benchmarks start servers, speak the wire and serve envs exactly as the interop tests
do -- one launcher (``support.refserver``), one raw client (``support.wire``), the same
test envs -- so they use the test suite's harness itself, not a copy of it that would
drift. This module is the one place that says so. It loads ``tests/support`` under its
own name, ``support``, from its files, without putting ``tests/`` on ``sys.path`` (where
``conftest``, ``goldens_util`` and every test module would shadow what they are named
after); server subprocesses find the same package through the ``PYTHONPATH`` that
``support.refserver`` gives them. It also pins the workflow edition the rlmesh 0.1.0
clients ask for, as the test suite's servers expect it.

Loading ``support`` does not import ``rlmesh_trio``: a script that chooses which copy of
the package to run (``bench_hostile.py --ours``) imports ``support.wire`` afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "support"
"""The test suite's harness package."""

WORKFLOW_EDITION = "2026.06"


def load_harness() -> ModuleType:
    """``tests/support`` as the package ``support`` (loaded once; its modules on demand)."""
    loaded = sys.modules.get("support")
    if loaded is not None:
        if Path(loaded.__file__ or "").resolve().parent != HARNESS:
            raise ImportError(f"another package named support is loaded: {loaded.__file__}")
        return loaded
    spec = importlib.util.spec_from_file_location(
        "support", HARNESS / "__init__.py", submodule_search_locations=[str(HARNESS)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"no test harness at {HARNESS}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["support"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["support"]
        raise
    return module


os.environ.setdefault("RLMESH_WORKFLOW_EDITION", WORKFLOW_EDITION)
load_harness()
