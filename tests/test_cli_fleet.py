"""``rlmesh-trio fleet`` as a user runs it: the README's command, no ``--bind``, no
``--ray-address``, no Ray variable; ``--json`` read by a program that leaves early.

The command starts its own local Ray (as it does for a user), so these tests need no
Ray of the session's.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from rlmesh_trio.client import probe

pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

BOUND = 180.0
"""Seconds the fleet may take to come up (a local Ray and four endpoints on a shared box)."""

QUIET_EXIT = 128 + signal.SIGPIPE

README_COMMAND = ["fleet", "--env", "CartPole-v1", "--endpoints", "4", "--num-envs", "8"]
"""The README's ``rlmesh-trio fleet`` command, as written."""

FITS_TWO_CORES = ["--cpus-per-endpoint", "0.5"]
"""The one addition: the README's four 1-CPU bundles do not fit a 2-core machine."""


def _readme_says_it() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    assert "`rlmesh-trio " + " ".join(README_COMMAND) in " ".join(readme.split())


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.Popen(
        [sys.executable, "-m", "rlmesh_trio", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


def _drain(stream: IO[bytes], into: list[bytes]) -> threading.Thread:
    thread = threading.Thread(target=lambda: into.extend(iter(stream.readline, b"")))
    thread.start()
    return thread


def _read_line(stream: IO[bytes], proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    """One line of ``stream`` within ``timeout`` seconds (b"" when none came)."""
    deadline = time.monotonic() + timeout
    line = b""
    fd = stream.fileno()
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b""
        assert proc.poll() is None, f"the fleet exited ({proc.poll()})"
        readable, _, _ = select.select([fd], [], [], min(remaining, 1.0))
        if readable:
            chunk = os.read(fd, 1)
            assert chunk, "stdout closed before a report"
            line += chunk
    return line


def _listener_pid(port: int) -> int | None:
    """The process listening on 127.0.0.1:``port`` (Linux: /proc/net/tcp, /proc/*/fd)."""
    inode = None
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # LISTEN
            inode = fields[9]
    if inode is None:
        return None
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == f"socket:[{inode}]" for fd in fd_dir.iterdir()):
                return int(fd_dir.parent.name)
        except OSError:
            continue
    return None


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc (Linux)")
def test_the_readme_fleet_command_binds_loopback_and_keeps_stdout_for_its_json() -> None:
    """The README's command on a laptop: a local Ray, loopback, no token needed. stdout
    is JSON only, even while Ray says ``(raylet) A worker died ...`` for an endpoint
    killed under it (that line goes to stderr); a reader that leaves (``| head -1``)
    stops the fleet, quietly."""
    _readme_says_it()
    proc = _spawn(*README_COMMAND, *FITS_TWO_CORES, "--json", "--health-period-seconds", "1")
    assert proc.stdout is not None and proc.stderr is not None
    err: list[bytes] = []
    drainer = _drain(proc.stderr, err)
    try:
        first = json.loads(_read_line(proc.stdout, proc, BOUND) or b"null")
        rows = first["endpoints"]
        assert len(rows) == 4
        assert all(r["address"].startswith("tcp://127.0.0.1:") for r in rows), rows
        assert all(r["num_envs"] == 8 and r["state"] == "serving" for r in rows), rows
        found = probe(rows[0]["address"], timeout_seconds=10.0)  # no token on loopback
        assert found.serving and found.report()["num_envs"] == 8
        # kill one endpoint's process: Ray restarts it and its driver prints a raylet
        # line; the fleet reports the change -- on stdout, as JSON, and nothing else
        port = int(rows[1]["address"].rsplit(":", 1)[1])
        pid = _listener_pid(port)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        seen = []
        while True:  # until it is back (reports come on changes; none for 60 s: done)
            line = _read_line(proc.stdout, proc, 60.0)
            if not line:
                break
            report = json.loads(line)["endpoints"]  # JSON, only
            seen.append([(r["state"], r["restarts"]) for r in report])
            if all(r["state"] == "serving" for r in report) and report[1]["restarts"] >= 1:
                break
        # It saw the restart: a restart over before any probe failed (the port is pinned)
        # never shows as a state, but it is reported by its count.
        assert seen and seen[-1] == [("serving", 0), ("serving", 1)] + [("serving", 0)] * 2, seen
        proc.stdout.close()  # the reader leaves, as head does
        proc.wait(timeout=BOUND)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        drainer.join(BOUND)
        proc.stdout.close()
        proc.stderr.close()
    text = b"".join(err).decode(errors="replace")
    assert proc.returncode == QUIET_EXIT, text
    assert "stdout closed: stopping the fleet" in text
    assert "Traceback" not in text and "BrokenPipeError" not in text, text
    assert "--auth-token" not in text  # not refused for want of a token


def test_a_fleet_whose_stdout_is_gone_at_once_exits_quietly() -> None:
    """The reader gone before the first report: the report's write fails, the fleet is
    closed again, exit 141 and no traceback."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlmesh_trio",
                "fleet",
                "--env",
                "CartPole-v1",
                "--endpoints",
                "1",
                "--cpus-per-endpoint",
                "0.5",
                "--json",
            ],
            stdin=subprocess.DEVNULL,
            stdout=write_fd,
            stderr=subprocess.PIPE,
            env=env,
        )
    finally:
        os.close(write_fd)
    _, err = proc.communicate(timeout=BOUND)
    text = err.decode(errors="replace")
    assert proc.returncode == QUIET_EXIT, text
    assert "stdout closed: stopping the fleet" in text
    assert "Traceback" not in text and "BrokenPipeError" not in text, text


def test_the_fleet_flags_reach_launch_and_default_as_it_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each supervision and bound flag of ``rlmesh-trio fleet`` is launch()'s keyword of
    the same name, with launch()'s own default (the CLI spells them without Ray)."""
    import inspect

    import ray

    from rlmesh_trio._cli import _fleet as cli_fleet
    from rlmesh_trio._cli import build_parser
    from rlmesh_trio.fleet import ray as fleet_ray

    fields = (
        "health_period_seconds",
        "health_timeout_seconds",
        "unhealthy_after",
        "ready_timeout_seconds",
        "stop_timeout_seconds",
    )
    defaults = inspect.signature(fleet_ray.launch).parameters
    parsed = build_parser().parse_args(["fleet", "--env", "CartPole-v1", "--endpoints", "2"])
    assert {f: getattr(parsed, f) for f in fields} == {f: defaults[f].default for f in fields}

    seen: dict[str, object] = {}

    def fake_launch(env: object, **kwargs: object) -> None:
        seen.update(kwargs)
        raise RuntimeError("not launching")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(fleet_ray, "launch", fake_launch)
    monkeypatch.setattr(fleet_ray, "resolve_bind", lambda bind: "127.0.0.1")
    given = ["--health-period-seconds", "0.5", "--health-timeout-seconds", "0.25"]
    given += ["--unhealthy-after", "5", "--ready-timeout-seconds", "30"]
    given += ["--stop-timeout-seconds", "4"]
    args = build_parser().parse_args(["fleet", "--env", "CartPole-v1", "--endpoints", "2", *given])
    assert cli_fleet.fleet_command(args) == 1  # "cannot launch the fleet: not launching"
    assert {f: seen[f] for f in fields} == {
        "health_period_seconds": 0.5,
        "health_timeout_seconds": 0.25,
        "unhealthy_after": 5,
        "ready_timeout_seconds": 30.0,
        "stop_timeout_seconds": 4.0,
    }
