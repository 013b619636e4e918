"""Start a server under test in a subprocess: the reference (rlmesh 0.1.0) or ours.

Both kinds are started the same way and report readiness the same way: the process
writes its resolved address and a newline to the ``--ready-fd`` pipe, then the harness
polls a Handshake (bounded retries) until the server answers. The reference is run by
this module's own ``__main__`` (``python -m support.refserver serve ...``), which takes
the same options as ``rlmesh-trio serve`` and builds
``rlmesh.EnvServer([make() for _ in range(N)], address, options=ServeOptions(...))``.

A :class:`ServerProcess` is stopped with SIGTERM, then SIGKILL after a bound; every
process still alive when the test process exits is killed by an ``atexit`` hook.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import importlib
import inspect
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar, cast, get_args

TESTS_DIR = Path(__file__).resolve().parent.parent
ROOT = TESTS_DIR.parent

Kind = Literal["ref", "ours"]
Transport = Literal["tcp", "unix"]
T = TypeVar("T")

READY_TIMEOUT = 60.0
"""Seconds a server may take to report its address (imports included, on a busy box)."""

PROBE_TIMEOUT = 15.0
"""Seconds the Handshake probe retries after the address was reported."""

STOP_TIMEOUT = 10.0
"""Seconds a server gets to exit after SIGTERM before it is killed."""

WORKFLOW_EDITION = "2026.06"


def ours_available() -> bool:
    """Whether our server exists yet (``rlmesh_trio.serve_env``)."""
    try:
        module = importlib.import_module("rlmesh_trio")
    except ImportError:
        return False
    return hasattr(module, "serve_env")


OURS_MISSING_REASON = "rlmesh_trio has no serve_env yet: our server is not built"


@dataclass(frozen=True)
class ServerConfig:
    """What to serve and how: the same knobs for both kinds of server."""

    entrypoint: str = "support.envs:make_cartpole"
    env_id: str | None = None
    """A gymnasium id to serve instead of the entrypoint (``--env``)."""
    num_envs: int = 1
    transport: Transport = "tcp"
    allow_remote_shutdown: bool = False
    idle_timeout_seconds: float | None = None
    drain_timeout_seconds: float | None = None
    close_timeout_seconds: float | None = None
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables of the server process."""
    ours_args: tuple[str, ...] = ()
    """Extra ``rlmesh-trio serve`` options (ignored for the reference server)."""
    endpoints: int = 1
    """How many endpoints of ``num_envs`` lanes the process serves (ours: ``--endpoints``;
    the reference: that many ``rlmesh.EnvServer`` in one process)."""

    def args(self, address: str, ready_fd: int) -> list[str]:
        """The ``serve`` options, spelled as ``rlmesh-trio serve`` takes them."""
        source = ["--env", self.env_id] if self.env_id else ["--entrypoint", self.entrypoint]
        args = [
            "serve",
            *source,
            "--num-envs",
            str(self.num_envs),
            "--address",
            address,
            "--ready-fd",
            str(ready_fd),
        ]
        if self.endpoints != 1:
            args += ["--endpoints", str(self.endpoints)]
        if self.allow_remote_shutdown:
            args.append("--allow-remote-shutdown")
        for flag, value in (
            ("--idle-timeout-seconds", self.idle_timeout_seconds),
            ("--drain-timeout-seconds", self.drain_timeout_seconds),
            ("--close-timeout-seconds", self.close_timeout_seconds),
        ):
            if value is not None:
                args += [flag, repr(float(value))]
        return args


_LIVE: set[ServerProcess] = set()


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_LIVE):
        server.kill()


@dataclass(eq=False)
class ServerProcess:
    """A running server subprocess; a context manager that stops it on exit."""

    kind: Kind
    config: ServerConfig
    address: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    workdir: Path
    started_at: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when the process was spawned."""
    ready_at: float | None = None
    """``time.monotonic()`` when it reported its address (and answered the probe)."""
    addresses: list[str] = field(default_factory=list)
    """Every endpoint's address, in order (``address`` is the first)."""

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None if the process is still running after ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def freeze(self) -> None:
        """SIGSTOP, and return once the kernel reports the process stopped.

        ``kill`` only queues the signal: a request sent right after it could still be
        answered. ``waitpid(WUNTRACED)`` (this process is the parent) waits for the stop
        itself, which reaps nothing.
        """
        os.kill(self.pid, signal.SIGSTOP)
        _, status = os.waitpid(self.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), f"server exited instead of stopping: {status:#x}"

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)

    def log(self) -> str:
        """What the server wrote to stdout/stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            if self.wait_exit(timeout) is None:
                self.kill()
        code = self.proc.wait()
        self._cleanup()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        _LIVE.discard(self)
        shutil.rmtree(self.workdir, ignore_errors=True)


class ServerPool:
    """Servers started on demand and shared: one process per (kind, config, slot).

    ``slot`` tells apart two processes of the same kind and config (the reference
    compared with itself). :meth:`fresh` starts one that is not shared. :meth:`close`
    stops them all.
    """

    def __init__(self) -> None:
        self._shared: dict[tuple[Kind, ServerConfig, int], ServerProcess] = {}
        self._fresh: list[ServerProcess] = []

    def get(self, kind: Kind, config: ServerConfig, *, slot: int = 0) -> ServerProcess:
        key = (kind, config, slot)
        server = self._shared.get(key)
        if server is None or not server.alive():
            server = self._shared[key] = start_server(kind, config)
        return server

    def pair(self, peer: Kind, config: ServerConfig) -> tuple[ServerProcess, ServerProcess]:
        """A reference server and the peer compared with it (ours, or a second reference).

        Each peer gets a reference process of its own, so both sides of a comparison
        have served exactly the same sequence of sessions: some state lives as long as
        the process (the conformance-warning sets of SPEC §3.7.6, the envs themselves).
        """
        if peer == "ref":
            return self.get("ref", config, slot=1), self.get("ref", config, slot=2)
        return self.get("ref", config, slot=0), self.get(peer, config)

    def on_both(
        self,
        peer: str,
        config: ServerConfig,
        scenario: Callable[..., Coroutine[Any, Any, T]] | Callable[..., T],
        *args: Any,
    ) -> tuple[T, T]:
        """One differential run: ``scenario(address, *args)`` against the reference,
        then against ``peer`` (of :meth:`pair`); both results, the reference's first.

        A scenario that is a coroutine function is run to completion on its own event
        loop (as :func:`support.wire.run` does); a plain function is just called.
        Comparing the two results is the test's business.
        """
        if peer not in get_args(Kind):
            raise ValueError(f"not a kind of server: {peer!r}")
        reference, other = self.pair(cast(Kind, peer), config)
        first = _finish(scenario(reference.address, *args))
        return first, _finish(scenario(other.address, *args))

    def fresh(self, kind: Kind, config: ServerConfig, **kwargs: Any) -> ServerProcess:
        server = start_server(kind, config, **kwargs)
        self._fresh.append(server)
        return server

    def close(self) -> None:
        servers = [*self._shared.values(), *self._fresh]
        self._shared.clear()
        self._fresh.clear()
        for server in servers:
            server.stop()


LANE_ISOLATION_ENV = "RLMESH_TEST_LANE_ISOLATION"
"""Set to ``process`` to run every rlmesh-trio server subprocess with process lanes (the
``tests-process`` nox session: the interop and differential suites in process mode)."""


def _finish(result: Any) -> Any:
    """A scenario's result: a coroutine is run on a new event loop first."""
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def _isolation_args() -> tuple[str, ...]:
    isolation = os.environ.get(LANE_ISOLATION_ENV)
    return ("--lane-isolation", isolation) if isolation else ()


def server_command(kind: Kind) -> list[str]:
    if kind == "ref":
        return [sys.executable, "-m", "support.refserver"]
    return [sys.executable, "-m", "rlmesh_trio"]


def start_server(
    kind: Kind,
    config: ServerConfig | None = None,
    *,
    ready_timeout: float = READY_TIMEOUT,
    probe: bool = True,
) -> ServerProcess:
    """Start a server subprocess and return once it answers a Handshake.

    Raises ``RuntimeError`` (with the server's log) if it exits or does not report
    its address within ``ready_timeout`` seconds.
    """
    config = config or ServerConfig()
    workdir = Path(tempfile.mkdtemp(prefix="rlt-"))  # short: unix socket paths are bounded
    address = f"unix://{workdir}/server.sock" if config.transport == "unix" else "tcp://127.0.0.1:0"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH", "")) if p)
    env.setdefault("RLMESH_WORKFLOW_EDITION", WORKFLOW_EDITION)
    env.update(dict(config.env))
    log_path = workdir / "server.log"
    read_fd, write_fd = os.pipe()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    *server_command(kind),
                    *config.args(address, write_fd),
                    *(config.ours_args if kind == "ours" else ()),
                    *(_isolation_args() if kind == "ours" else ()),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                pass_fds=(write_fd,),
            )
    finally:
        os.close(write_fd)
    server = ServerProcess(kind, config, address, proc, log_path, workdir)
    _LIVE.add(server)
    try:
        with os.fdopen(read_fd, "rb") as ready:
            server.addresses = _read_addresses(ready, proc, ready_timeout, config.endpoints)
        server.address = server.addresses[0]
        server.ready_at = time.monotonic()
        if probe:
            from .wire import probe_handshake

            for each in server.addresses:
                asyncio.run(probe_handshake(each, PROBE_TIMEOUT))
    except BaseException as exc:
        log_text = server.log()
        server.kill()
        if isinstance(exc, Exception):
            raise RuntimeError(
                f"{kind} server ({config}) did not start: {exc!r}\n--- server log ---\n{log_text}"
            ) from exc
        raise
    return server


def _read_addresses(
    ready: Any, proc: subprocess.Popen[bytes], timeout: float, count: int
) -> list[str]:
    deadline = time.monotonic() + timeout
    line = b""
    while line.count(b"\n") < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no address on the ready fd within {timeout} s")
        readable, _, _ = select.select([ready], [], [], remaining)
        if not readable:
            continue
        chunk = os.read(ready.fileno(), 4096)
        if not chunk:
            raise RuntimeError(f"server closed its ready fd (exit code {proc.poll()})")
        line += chunk
    return line.decode().split()


# --------------------------------------------------------------------------- the runner


def _load(entrypoint: str) -> Any:
    module_name, _, attr = entrypoint.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="support.refserver")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve envs with the reference rlmesh 0.1.0 server")
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--env", help="gymnasium id")
    source.add_argument("--entrypoint", help="module:callable returning one env")
    serve.add_argument("--num-envs", type=int, default=1)
    serve.add_argument("--address", default="tcp://127.0.0.1:0")
    serve.add_argument("--ready-fd", type=int, default=None)
    serve.add_argument("--allow-remote-shutdown", action="store_true")
    serve.add_argument("--idle-timeout-seconds", type=float, default=None)
    serve.add_argument("--drain-timeout-seconds", type=float, default=None)
    serve.add_argument("--close-timeout-seconds", type=float, default=None)
    serve.add_argument("--endpoints", type=int, default=1)
    return parser.parse_args(argv)


def _addresses(address: str, count: int) -> list[str]:
    """``count`` addresses from one, as ``rlmesh-trio serve --endpoints`` takes them."""
    if count == 1:
        return [address]
    if address.startswith("unix://"):
        root, ext = os.path.splitext(address)
        return [f"{root}-{k}{ext}" for k in range(count)]
    host, _, port = address.rpartition(":")
    return [f"{host}:{int(port) + k if int(port) else 0}" for k in range(count)]


def main(argv: list[str] | None = None) -> int:
    """Serve with ``rlmesh.EnvServer``; write the bound address to ``--ready-fd``."""
    args = _parse(argv)
    import rlmesh

    if args.env is not None:
        import gymnasium as gym

        def make() -> Any:
            return gym.make(args.env)
    else:
        make = _load(args.entrypoint)
    options = rlmesh.ServeOptions(
        allow_remote_shutdown=args.allow_remote_shutdown,
        idle_timeout_seconds=args.idle_timeout_seconds,
        drain_timeout_seconds=args.drain_timeout_seconds,
        close_timeout_seconds=args.close_timeout_seconds,
        workflow_edition=WORKFLOW_EDITION,
    )
    servers = [
        rlmesh.EnvServer([make() for _ in range(args.num_envs)], each, options=options)
        for each in _addresses(args.address, args.endpoints)
    ]
    line = "".join(f"{server.address}\n" for server in servers).encode()
    if args.ready_fd is None:
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
    else:
        os.write(args.ready_fd, line)
        os.close(args.ready_fd)
    # SIGTERM from the harness: stop like Ctrl-C (drain, close the envs) rather than die.
    if len(servers) == 1:
        signal.signal(signal.SIGTERM, lambda *_: servers[0].shutdown())
        servers[0].serve()
        return 0
    for server in servers:
        server.start()
    signal.signal(signal.SIGTERM, lambda *_: [server.shutdown() for server in servers])
    for server in servers:
        server.wait()
    return 0


def server_env(extra: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """``ServerConfig.env`` from a mapping."""
    return tuple(sorted(extra.items()))


if __name__ == "__main__":
    sys.exit(main())
