"""``python -m rlmesh_trio._recordchild FD PARENT_PID NAME``: the dataset's storage child.

Started by :class:`rlmesh_trio._record._child.StorageChild`, never by hand: ``FD`` is its
end of a socketpair to the server, ``NAME`` only labels the process in ``ps``.
"""

from __future__ import annotations

import socket
import sys

from ._pipe import PipeEnd
from ._record._child import TRUSTED_CAP, storage_child_main


def main(argv: list[str]) -> int:
    fd, parent_pid = int(argv[1]), int(argv[2])
    storage_child_main(PipeEnd(socket.socket(fileno=fd), TRUSTED_CAP, trusted=True), parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
