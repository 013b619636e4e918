"""An env that writes to its own lane's pipe, for the process-lane pipe tests.

A process lane's child talks to the server over a socketpair whose fd it got in argv
(``python -m rlmesh_trio._lanechild FD PARENT_PID NAME``); env code in the child can write
to it like any code can. ``PipeLiarEnv``'s action picks what its step writes there before
it returns as usual (the child then sends its real answer after those bytes):
:data:`HONEST` nothing, :data:`LIE` a length prefix of :data:`LIE_BYTES` (1 GiB, over the
pipe's cap), :data:`GARBAGE` a well-framed message that does not unpickle,
:data:`STALL` a length under the cap for bytes that never come. Observation: ``[t, pid]``
(the process the env lives in). A module-level factory, so it pickles into a lane's
process.
"""

from __future__ import annotations

import os
import stat
import struct
import sys
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

HONEST, LIE, GARBAGE, STALL = 0, 1, 2, 3
LIE_BYTES = 1 << 30
"""The length :data:`LIE` announces: 1 GiB (the server allocated it at once, once)."""
STALL_BYTES = 200 << 20
"""The length :data:`STALL` announces: 200 MiB, under the cap; the child sends only its
real answer (a few hundred bytes) after it and then waits for the next job."""
GARBAGE_BODY = b"\xffnot a pickle"


def lane_socket_fd() -> int:
    """The fd of this process's end of its lane's socketpair (only in a lane's child)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is None or spec.name != "rlmesh_trio._lanechild":
        raise RuntimeError("not in a process lane's child (python -m rlmesh_trio._lanechild)")
    fd = int(sys.argv[1])
    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        raise RuntimeError(f"fd {fd} of a lane's child is not a socket")
    return fd


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class PipeLiarEnv(gym.Env[np.ndarray, int]):
    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0.0, 2.0**24, (2,), np.float32)
        self.action_space = spaces.Discrete(4)
        self.t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        action = int(action)
        if action == LIE:
            write_all(lane_socket_fd(), struct.pack("!I", LIE_BYTES))
        elif action == GARBAGE:
            write_all(lane_socket_fd(), struct.pack("!I", len(GARBAGE_BODY)) + GARBAGE_BODY)
        elif action == STALL:
            write_all(lane_socket_fd(), struct.pack("!I", STALL_BYTES))
        self.t += 1
        return self._obs(), 1.0, False, False, {}

    def _obs(self) -> np.ndarray:
        return np.array([self.t, os.getpid()], np.float32)


def make_pipe_liar() -> PipeLiarEnv:
    return PipeLiarEnv()
