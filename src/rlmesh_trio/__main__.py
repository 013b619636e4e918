"""``python -m rlmesh_trio``: the ``rlmesh-trio`` command line."""

from __future__ import annotations

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
