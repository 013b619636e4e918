"""``python -m rlmesh_trio._lanechild FD PARENT_PID NAME``: a process lane's child.

Started by :class:`rlmesh_trio._lanes._process.ChildLane`, never by hand: ``FD`` is its end
of a socketpair to the server, ``NAME`` only labels the process in ``ps``.
"""

from __future__ import annotations

import socket
import sys

from ._lanes._process import child_main
from ._pipe import PipeEnd


def main(argv: list[str]) -> int:
    fd, parent_pid = int(argv[1]), int(argv[2])
    child_main(PipeEnd(socket.socket(fileno=fd)), parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
