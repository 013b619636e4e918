"""Bench-local helpers: what more than one bench script needs, with nothing from tests/.

* CPU accounting from Linux ``/proc``: :class:`ServerUsage` / :func:`server_usage` /
  :class:`CpuMeter` (one process, all its threads: user and system CPU, voluntary context
  switches) and :func:`descendants` / :func:`tree_cpu` (the processes a process started:
  process lanes, ``AsyncVectorEnv``'s workers);
* :func:`serve_ours` / :func:`serve_reference`: a server in a subprocess on loopback, ours
  (``python -m rlmesh_trio serve``) or rlmesh 0.1.0's ``rlmesh.EnvServer`` (run by this
  module's own ``serve-ref`` command, below), each reporting its bound address on a
  ``--ready-fd`` pipe; a :class:`Served` stops with SIGTERM, then SIGKILL after a bound,
  and whatever is still running when the bench exits is killed.

Run as a script, it serves the reference: ``python bench/_common.py serve-ref --env
CartPole-v1 --num-envs 8 [--address tcp://127.0.0.1:0] [--ready-fd FD]``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW_EDITION = "2026.06"

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ---------------------------------------------------------------------------- CPU


@dataclass(frozen=True)
class ServerUsage:
    """What the server process used so far: CPU seconds (user, system) of all its threads
    (``/proc/<pid>/stat``) and voluntary context switches summed over its live threads
    (``/proc/<pid>/task/*/status``; the per-process line counts the main thread only)."""

    user: float
    sys: float
    voluntary: int

    def __sub__(self, other: ServerUsage) -> ServerUsage:
        return ServerUsage(
            self.user - other.user, self.sys - other.sys, self.voluntary - other.voluntary
        )


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    """A ``/proc/<pid>/status`` memory line in MiB (NaN if the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 on)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def server_usage(pid: int) -> ServerUsage:
    """The usage of process ``pid`` so far (Linux ``/proc``)."""
    fields = _stat_fields(pid)
    voluntary = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread exited meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                voluntary += int(line.split()[1])
    return ServerUsage(int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS, voluntary)


class CpuMeter:
    """Server usage over a block: ``with CpuMeter(pid) as m: ...; m.usage`` (and
    ``m.seconds``, user + system)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.usage = ServerUsage(0.0, 0.0, 0)

    @property
    def seconds(self) -> float:
        return self.usage.user + self.usage.sys

    def __enter__(self) -> CpuMeter:
        self._start = server_usage(self.pid)
        return self

    def __exit__(self, *exc: object) -> None:
        self.usage = server_usage(self.pid) - self._start


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (children, their children, ...), from the parent
    field of every ``/proc/<n>/stat``."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(_stat_fields(int(entry))[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        parents.setdefault(parent, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tree_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` used so far; one that exited
    meanwhile counts nothing."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = _stat_fields(pid)
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


# ---------------------------------------------------------------------------- servers

READY_TIMEOUT = 120.0
"""Seconds a server may take to report its address (imports and N envs built, on a
busy machine: process lanes start N interpreters)."""

STOP_TIMEOUT = 10.0
"""Seconds a server gets to exit after SIGTERM before it is killed."""

_LIVE: set[Served] = set()


@atexit.register
def _kill_leftovers() -> None:
    for served in list(_LIVE):
        served.kill()


@dataclass(eq=False)
class Served:
    """A server subprocess on loopback; a context manager that stops it on exit."""

    name: str
    address: str
    proc: subprocess.Popen[bytes]
    workdir: Path
    addresses: list[str] = field(default_factory=list)
    """Every endpoint's address (``serve --endpoints K``), in order; ``address`` the first."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        """What the server wrote to stdout/stderr so far."""
        try:
            return (self.workdir / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT`."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.kill()
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self.proc.wait()
        _LIVE.discard(self)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _start(name: str, command: list[str], pythonpath: str | None = None) -> Served:
    """Run ``command`` (which takes ``--ready-fd FD`` last) and return once it has written
    its bound address; ``RuntimeError`` with its log if it does not. ``pythonpath``: put
    first on the child's ``PYTHONPATH`` (serve another source tree)."""
    workdir = Path(tempfile.mkdtemp(prefix="rlt-bench-"))
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    env.setdefault("RLMESH_WORKFLOW_EDITION", WORKFLOW_EDITION)
    read_fd, write_fd = os.pipe()
    try:
        with open(workdir / "server.log", "wb") as log:
            proc = subprocess.Popen(
                [*command, "--ready-fd", str(write_fd)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                pass_fds=(write_fd,),
            )
    finally:
        os.close(write_fd)
    served = Served(name, "", proc, workdir)
    _LIVE.add(served)
    try:
        served.addresses = _read_lines(read_fd, proc)
        served.address = served.addresses[0]
    except BaseException as exc:
        text = served.log()
        served.kill()
        if isinstance(exc, Exception):
            raise RuntimeError(f"{name} did not start: {exc}\n--- its log ---\n{text}") from exc
        raise
    finally:
        os.close(read_fd)
    return served


def _read_lines(fd: int, proc: subprocess.Popen[bytes]) -> list[str]:
    """The addresses on the ready fd, one a line, up to its end (the server closes it)."""
    deadline = time.monotonic() + READY_TIMEOUT
    line = b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no address on the ready fd within {READY_TIMEOUT} s")
        readable, _, _ = select.select([fd], [], [], remaining)
        if not readable:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            if line.endswith(b"\n"):
                return line.decode().split()
            raise RuntimeError(f"the ready fd closed (exit code {proc.poll()})")
        line += chunk


def serve_ours(env_id: str, num_envs: int, *extra: str, src: str | None = None) -> Served:
    """``rlmesh-trio serve --env ENV --num-envs N`` on an ephemeral loopback port; ``extra``
    options after them (e.g. ``--lane-isolation process``). ``src``: serve the package
    found there (a source tree's ``src`` directory) instead of the installed one."""
    command = [sys.executable, "-m", "rlmesh_trio", "serve", "--env", env_id]
    command += ["--num-envs", str(num_envs), "--address", "tcp://127.0.0.1:0", *extra]
    return _start(f"rlmesh-trio serve {' '.join(command[4:])}", command, src)


def serve_reference(env_id: str, num_envs: int) -> Served:
    """rlmesh 0.1.0's ``EnvServer`` over ``num_envs`` copies of ``gymnasium.make(env_id)``,
    on an ephemeral loopback port (this module's ``serve-ref`` command)."""
    command = [sys.executable, str(Path(__file__).resolve()), "serve-ref", "--env", env_id]
    command += ["--num-envs", str(num_envs), "--address", "tcp://127.0.0.1:0"]
    return _start(f"rlmesh.EnvServer {env_id} x {num_envs}", command)


def _serve_reference(env_id: str, num_envs: int, address: str, ready_fd: int | None) -> None:
    import gymnasium as gym
    import rlmesh

    options = rlmesh.ServeOptions(workflow_edition=WORKFLOW_EDITION)
    server = rlmesh.EnvServer([gym.make(env_id) for _ in range(num_envs)], address, options=options)
    line = f"{server.address}\n".encode()
    if ready_fd is None:
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
    else:
        os.write(ready_fd, line)
        os.close(ready_fd)
    # SIGTERM (Served.stop): stop as on Ctrl-C, envs closed, rather than die.
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    server.serve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ref = commands.add_parser(
        "serve-ref", help="serve N copies of a gymnasium env with rlmesh 0.1.0"
    )
    ref.add_argument("--env", required=True, help="gymnasium id, e.g. CartPole-v1")
    ref.add_argument("--num-envs", type=int, default=1)
    ref.add_argument("--address", default="tcp://127.0.0.1:0")
    ref.add_argument("--ready-fd", type=int, default=None, help="write the address here")
    args = parser.parse_args(argv)
    _serve_reference(args.env, args.num_envs, args.address, args.ready_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
