"""Benchmark: how rlmesh-trio and the reference (rlmesh 0.1.0) stand up to hostile clients.

Both servers run as subprocesses started the same way (``tests/support/refserver.py``),
each one fresh for every case (so one case's memory cannot leak into the next) and
alone on the machine while it is measured; the clients run in this process. Every case
runs once per server (these are not throughput numbers: a ratio of 10 or 100 is the
finding, not noise). Sections:

* ``cpu`` — CPU amplification. On one connection a single JoinRequest whose body is a
  ~10 MB repeated field, built by hand: a lane-scoped ``step`` with 10,000,000 packed
  ``env_indices`` zeros; a lane-scoped ``reset`` (``env_indices=[0]``) with 10,000,000
  packed ``seeds``; a lane-scoped reset with 1,000,000 repeated ``episode_ids``. From a
  second, already open connection a Handshake is started ~50 ms after the big request's
  last byte was sent, and again every ~50 ms (one at a time) until the big request is
  answered. Reported: send time, time from the last byte sent to the reply, the
  server's CPU seconds over the case, the first and the worst Handshake latency.
* ``memory`` — memory given back. The server's RSS (``/proc/<pid>/status`` VmRSS) at
  baseline, its peak while one near-limit request is handled (VmRSS sampled every
  10 ms, and VmHWM), and 3 s and 6 s after the reply, the connection left open and
  idle: a whole ``step`` whose single action leaf is 255 MiB (rejected by the codec
  for its length), and a lane-scoped step carrying a 200 MiB Text action on an env
  whose action space is ``Text`` (:class:`TextActionEnv`, defined here and served
  with ``--entrypoint bench_hostile:make_text_env``).
* ``buffering`` — unbounded reply buffering. An h2 client that never grants the
  server any receive window (it reads the socket, so it sees the server's
  WINDOW_UPDATEs, but never acknowledges DATA: the server can send at most 64 KiB of
  replies in total) sends lane-scoped steps, each with a 100 KiB ``request_id`` (which
  the reply echoes), 2,000 of them paced over ~10 s. Reported: how many the server
  let in (its own flow control may stop the client), RSS growth in MiB per 1,000
  requests, and the RSS 3 s after the client disconnected.

Run: ``python bench/bench_hostile.py [--only cpu,memory,buffering] [--timeout S]
[--ours-src snapshot|live|DIR] [--json PATH]``; about 2 minutes. CartPole-v1 on 4
lanes except for the Text case. Our package is by default a copy of
``src/rlmesh_trio`` taken (and smoke-tested with a short session) at the start, so a
rewrite of ``src`` during the run cannot mix two versions; ``DIR`` is a directory
holding some other ``rlmesh_trio`` package. Every wait is bounded (``--timeout`` for
one big request's reply, default 60 s); a server that does not answer in time gets
``timeout`` in the table and the run goes on; a case that fails is reported as a note.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _support  # noqa: F401  (the test harness as ``support``: see bench/_support.py)
import gymnasium as gym
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import numpy as np
from _common import rss_mib
from gymnasium import spaces
from support import protobuf
from support.refserver import ServerConfig, ServerProcess, start_server

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(__file__).resolve().parent

# ``support.wire`` and the message classes import ``rlmesh_trio``: they are loaded by
# :func:`load_ours` once it is settled which copy of our package is used (a server
# subprocess that imports this module for ``make_text_env`` never loads them).
wire: Any = None
env_v1: Any = None

OURS_SRC = ROOT / "src" / "rlmesh_trio"
SERVER_PATH: list[str] = [str(ROOT / "tests"), str(BENCH_DIR)]
"""PYTHONPATH of both servers: a frozen copy of our package (if any), tests/, bench/."""


SMOKE = """
import asyncio, sys
from support import wire
from support.refserver import ServerConfig, start_server

async def session(address):
    async with wire.WireClient(address) as client, client.join() as join:
        reply = await join.call(wire.configure())
        assert reply.error is None, reply
        reply = await join.call(wire.reset(seeds=[0, 1]))
        assert reply.error is None, reply
        reply = await join.call(wire.step([wire.i64([1])], env_indices=[0]))
        assert reply.step is not None, reply

config = ServerConfig(num_envs=2, env=(("PYTHONPATH", sys.argv[1]),))
with start_server("ours", config) as server:
    try:
        asyncio.run(asyncio.wait_for(session(server.address), 30))
    except BaseException:
        print(server.log()[-2000:], file=sys.stderr)
        raise
"""


def smoke_ours(package_dir: Path | None) -> str:
    """'' if our server from ``package_dir`` (None: as installed) serves a short session."""
    path = os.pathsep.join([*([str(package_dir)] if package_dir else []), str(ROOT / "tests")])
    try:
        check = subprocess.run(
            [sys.executable, "-c", SMOKE, path],
            env={**os.environ, "PYTHONPATH": path},
            cwd=package_dir or ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return "smoke session timed out"
    if check.returncode == 0:
        return ""
    lines = [line for line in check.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {check.returncode}"


def snapshot_ours(wait_seconds: float = 120.0) -> Path:
    """Copy ``src/rlmesh_trio`` to a temp dir once it works; return the dir holding it.

    ``src`` may be rewritten while the bench runs: every server of the run is started
    from this one copy, so all of our numbers come from the same code. A copy that
    does not serve a short session (caught mid-rewrite) is retried every 5 s for
    ``wait_seconds``.
    """
    deadline = time.monotonic() + wait_seconds
    while True:
        tmp = Path(tempfile.mkdtemp(prefix="rlt-hostile-"))
        try:
            shutil.copytree(
                OURS_SRC, tmp / "rlmesh_trio", ignore=shutil.ignore_patterns("__pycache__")
            )
            error = smoke_ours(tmp)
        except (OSError, shutil.Error) as exc:
            error = repr(exc)
        if not error:
            return tmp
        shutil.rmtree(tmp, ignore_errors=True)
        if time.monotonic() > deadline:
            raise SystemExit(f"src/rlmesh_trio does not serve a session ({error}); gave up")
        print(f"  src/rlmesh_trio does not work yet ({error}); retrying in 5 s", file=sys.stderr)
        time.sleep(5)


def load_ours(source: str) -> str:
    """Settle which rlmesh_trio this run uses (``snapshot``, ``live`` or a directory).

    Whichever it is must first serve a short session (configure, reset, lane step).
    """
    global wire, env_v1
    if source == "snapshot":
        frozen = snapshot_ours()
        import atexit

        atexit.register(shutil.rmtree, frozen, True)
        SERVER_PATH.insert(0, str(frozen))
        sys.path.insert(0, str(frozen))
    else:
        package_dir = None if source == "live" else Path(source).resolve()
        error = smoke_ours(package_dir)
        if error:
            raise SystemExit(f"our server ({source}) does not serve a session: {error}")
        if package_dir is not None:
            SERVER_PATH.insert(0, str(package_dir))
            sys.path.insert(0, str(package_dir))
    from support import wire as _wire

    import rlmesh_trio
    from rlmesh_trio._proto.rlmesh.env import v1 as _env_v1

    wire, env_v1 = _wire, _env_v1
    newest = max(
        (p.stat().st_mtime for p in Path(rlmesh_trio.__file__).parent.rglob("*.py")), default=0
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newest))
    return f"{Path(rlmesh_trio.__file__).parent} (newest file {stamp})"


def config(entrypoint: str = "support.envs:make_cartpole") -> ServerConfig:
    return ServerConfig(
        entrypoint=entrypoint,
        num_envs=NUM_ENVS,
        env=(("PYTHONPATH", os.pathsep.join(SERVER_PATH)),),
    )


KINDS = ("ref", "ours")
NUM_ENVS = 4
CARTPOLE = "support.envs:make_cartpole"
TEXT_ENTRYPOINT = "bench_hostile:make_text_env"
MiB = 1 << 20

PROBE_DELAY = 0.05
"""Seconds after the big request's last byte before the first Handshake; also the period."""

SETTLE_TIMES = (3.0, 6.0)
"""Seconds after the near-limit reply at which the RSS is read again."""

SAMPLE_PERIOD = 0.01
"""Seconds between two VmRSS samples."""


# --------------------------------------------------------------------------- the Text env


TEXT_MAX_LENGTH = 256 * MiB


class TextActionEnv(gym.Env[np.ndarray, str]):
    """A trivial env whose action space is ``Text`` (up to 256 Mi characters).

    The step only looks at the action's length; nothing is kept, so whatever memory
    the server holds afterwards is the server's own.
    """

    def __init__(self) -> None:
        self.observation_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.action_space = spaces.Text(TEXT_MAX_LENGTH, min_length=1)
        self.last_length = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action: str) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.last_length = len(action)
        return np.zeros(1, np.float32), 0.0, False, False, {}


def make_text_env() -> TextActionEnv:
    return TextActionEnv()


# --------------------------------------------------------------------------- /proc


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process used so far (NaN if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


class RssSampler:
    """VmRSS of a process every ``SAMPLE_PERIOD`` seconds, in a thread; keeps the max."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = float("nan")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            value = rss_mib(self.pid)
            if not math.isnan(value) and not (self.peak >= value):
                self.peak = value
            self._stop.wait(SAMPLE_PERIOD)


# --------------------------------------------------------------------------- hand-built protobuf


def join_request(kind_field: int, body: list[bytes], request_id: str = "big") -> list[bytes]:
    """A JoinRequest ``{kind_field: <body segments>, request_id}`` as a list of segments.

    The segments are sent one after the other without ever being joined, so a
    255 MiB leaf is never copied on the client side.
    """
    body_len = sum(len(s) for s in body)
    return [
        protobuf.length_prefix(kind_field, body_len),
        *body,
        protobuf.field(5, request_id.encode()),
    ]


JOIN_RESET, JOIN_STEP = 1, 2
STEP_ACTION, STEP_ENV_INDICES = 1, 3
RESET_SEEDS, RESET_ENV_INDICES, RESET_EPISODE_IDS = 1, 4, 5
SPACE_VALUE_LEAVES = 1


def action_segments(leaves: Sequence[Sequence[bytes]]) -> list[bytes]:
    """``StepRequest.action`` = SpaceValue{leaves}; each leaf given as its segments."""
    inner: list[bytes] = []
    for leaf in leaves:
        inner += [protobuf.length_prefix(SPACE_VALUE_LEAVES, sum(len(s) for s in leaf)), *leaf]
    return [protobuf.length_prefix(STEP_ACTION, sum(len(s) for s in inner)), *inner]


def big_step_env_indices(count: int) -> list[bytes]:
    """Lane-scoped step, one Discrete action, ``count`` packed zeros as env_indices."""
    body = [
        *action_segments([[wire.i64([0])]]),
        protobuf.length_prefix(STEP_ENV_INDICES, count),
        b"\x00" * count,
    ]
    return join_request(JOIN_STEP, body)


def big_reset_seeds(count: int) -> list[bytes]:
    """Lane-scoped reset of lane 0 carrying ``count`` packed zero seeds."""
    body = [
        protobuf.length_prefix(RESET_SEEDS, count),
        b"\x00" * count,
        protobuf.field(RESET_ENV_INDICES, b"\x00"),
    ]
    return join_request(JOIN_RESET, body)


def big_reset_episode_ids(count: int) -> list[bytes]:
    """Lane-scoped reset of lane 0 carrying ``count`` repeated 8-character episode ids."""
    one = protobuf.field(RESET_EPISODE_IDS, b"ep-hostl")
    body = [protobuf.field(RESET_ENV_INDICES, b"\x00"), one * count]
    return join_request(JOIN_RESET, body)


def huge_leaf_step(leaf_bytes: int) -> list[bytes]:
    """Whole step whose single action leaf is ``leaf_bytes`` long (CartPole wants 4 lanes * 8 bytes)."""
    return join_request(JOIN_STEP, action_segments([[b"\x00" * leaf_bytes]]))


def huge_text_step(text_bytes: int) -> list[bytes]:
    """Lane-scoped step of lane 0 whose Text action (slab form, SPEC §3.4) is one string."""
    slab_header = struct.pack("<2Q", 1, text_bytes)
    body = [
        *action_segments([[slab_header, b"a" * text_bytes]]),
        protobuf.field(STEP_ENV_INDICES, b"\x00"),
    ]
    return join_request(JOIN_STEP, body)


def segments_len(segments: Sequence[bytes]) -> int:
    return sum(len(s) for s in segments)


# --------------------------------------------------------------------------- client helpers


async def send_segments(
    client: wire.WireClient, stream_id: int, segments: Sequence[bytes], timeout: float
) -> None:
    """One gRPC message made of ``segments``, sent in DATA frames under flow control.

    ``JoinStream.send`` copies the remainder of the message for every 16 KiB frame
    (quadratic for a 255 MiB message); this walks memoryviews instead.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    conn = client._conn
    writer = client._writer
    assert writer is not None
    prefix = struct.pack(">?I", False, segments_len(segments))
    pieces = [prefix + segments[0], *segments[1:]]
    unflushed = 0
    for piece in pieces:
        view = memoryview(piece)
        while view:
            if client.closed is not None:
                raise ConnectionError(client.closed)
            window = min(conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size)
            if window <= 0:
                client._window.clear()
                client._flush()
                await asyncio.wait_for(writer.drain(), max(0.001, deadline - loop.time()))
                unflushed = 0
                if conn.local_flow_control_window(stream_id) > 0:
                    continue
                await asyncio.wait_for(client._window.wait(), max(0.001, deadline - loop.time()))
                continue
            n = min(window, len(view))
            conn.send_data(stream_id, bytes(view[:n]))
            view = view[n:]
            unflushed += n
            if unflushed >= 256 * 1024:
                client._flush()
                await asyncio.wait_for(writer.drain(), max(0.001, deadline - loop.time()))
                unflushed = 0
    client._flush()
    await asyncio.wait_for(writer.drain(), max(0.001, deadline - loop.time()))


def describe(raw: bytes | None, join: wire.JoinStream) -> str:
    """What the big request got back: the reply kind / error, or how the stream ended."""
    if raw is None:
        end = join.end
        if end is None:
            return "no reply"
        return f"stream ended: grpc-status {end.status} {end.message or end.detail or ''}".strip()
    reply = env_v1.JoinResponse.parse(raw)
    if reply.error is not None:
        code = reply.error.code
        name = getattr(code, "name", str(code))
        return (
            f"error {name}({int(code)}) recoverable={bool(reply.error.is_recoverable)}: "
            f"{_short(reply.error.message, 110)}"
        )
    return f"reply {wire.reply_kind(reply)} (no error)"


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def open_session(client: wire.WireClient, join: wire.JoinStream) -> None:
    """Configure and reset all lanes (seeds 0..N-1), as every case starts."""
    reply = await join.call(wire.configure())
    assert reply.error is None, reply
    reply = await join.call(wire.reset(seeds=list(range(NUM_ENVS))))
    assert reply.error is None, reply


# --------------------------------------------------------------------------- results


@dataclass
class Row:
    section: str
    case: str
    metric: str
    unit: str
    values: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def ratio(self) -> float:
        ref, ours = self.values.get("ref", math.nan), self.values.get("ours", math.nan)
        if math.isnan(ref) or math.isnan(ours) or ref == 0:
            return math.nan
        return ours / ref


class Results:
    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, str], Row] = {}
        self.notes: list[tuple[str, str, str, str]] = []  # section, case, kind, text

    def put(self, section: str, case: str, kind: str, metric: str, unit: str, value: float) -> None:
        key = (section, case, metric)
        row = self.rows.setdefault(key, Row(section, case, metric, unit))
        row.values[kind] = value

    def note(self, section: str, case: str, kind: str, text: str) -> None:
        self.notes.append((section, case, kind, text))
        print(f"  [{kind}] {section}/{case}: {text}", file=sys.stderr, flush=True)


def run_case(
    results: Results,
    section: str,
    case: str,
    config: ServerConfig,
    body: Callable[[ServerProcess, Callable[[str, str, float], None]], Any],
) -> None:
    """``body(server, put)`` against a fresh server of each kind; failures become notes."""
    for kind in KINDS:
        started = time.monotonic()
        server: ServerProcess | None = None

        def put(metric: str, unit: str, value: float, kind: str = kind) -> None:
            results.put(section, case, kind, metric, unit, value)

        try:
            server = start_server(kind, config)  # type: ignore[arg-type]
            note = body(server, put)
            if note:
                results.note(section, case, kind, note)
            if not server.alive():
                results.note(section, case, kind, f"server DIED (exit {server.proc.poll()})")
        except Exception as exc:  # a failed case must not stop the run
            log_tail = server.log()[-600:] if server is not None else ""
            results.note(section, case, kind, f"case failed: {exc!r} {log_tail}")
        finally:
            if server is not None:
                server.stop()
        print(
            f"  done: {section}/{case} [{kind}] {time.monotonic() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )


# --------------------------------------------------------------------------- 1. cpu


CPU_CASES: dict[str, Callable[[], list[bytes]]] = {
    "step env_indices 10M packed": lambda: big_step_env_indices(10_000_000),
    "reset[0] seeds 10M packed": lambda: big_reset_seeds(10_000_000),
    "reset[0] episode_ids 1M": lambda: big_reset_episode_ids(1_000_000),
}


async def cpu_case(server: ServerProcess, segments: list[bytes], timeout: float, put: Any) -> str:
    loop = asyncio.get_running_loop()
    pid = server.pid
    latencies: list[float] = []
    stalled: list[float] = []  # a Handshake that had not finished when we stopped waiting
    done = asyncio.Event()

    async with (
        wire.WireClient(server.address, timeout=timeout) as big,
        wire.WireClient(server.address, timeout=timeout) as probe,
    ):
        await probe.handshake()  # warm: the probe connection is up and answered once
        idle = []
        for _ in range(5):
            started = loop.time()
            await probe.handshake()
            idle.append(loop.time() - started)
        put("idle Handshake (median of 5)", "ms", sorted(idle)[2] * 1e3)
        async with big.join() as join:
            await open_session(big, join)
            await asyncio.sleep(0.2)
            cpu_before = cpu_seconds(pid)
            t0 = loop.time()
            await send_segments(big, join.stream.id, segments, timeout)
            t_sent = loop.time()

            async def prober() -> None:
                await asyncio.sleep(PROBE_DELAY)
                while True:
                    started = loop.time()
                    task = asyncio.ensure_future(probe.handshake())
                    try:
                        await asyncio.wait_for(asyncio.shield(task), timeout)
                    except TimeoutError:
                        task.cancel()
                        stalled.append(loop.time() - started)
                        return
                    latencies.append(loop.time() - started)
                    if done.is_set():
                        return
                    await asyncio.sleep(max(0.0, PROBE_DELAY - (loop.time() - started)))

            probe_task = asyncio.ensure_future(prober())
            raw: bytes | None = None
            timed_out = False
            try:
                raw = await join.recv_raw(timeout)
            except TimeoutError:
                timed_out = True
            t_reply = loop.time()
            done.set()
            try:
                await asyncio.wait_for(probe_task, timeout + 5)
            except TimeoutError:
                probe_task.cancel()
            cpu_after = cpu_seconds(pid)

    put("send time", "s", t_sent - t0)
    put("reply after last byte", "s", math.inf if timed_out else t_reply - t_sent)
    put("server CPU", "s", cpu_after - cpu_before)
    worst = max([*latencies, *stalled], default=math.nan)
    first = latencies[0] if latencies else (stalled[0] if stalled else math.nan)
    put("1st Handshake (+50 ms)", "ms", first * 1e3)
    put("worst Handshake", "ms", worst * 1e3)
    put("Handshakes answered", "n", float(len(latencies)))
    what = f">{timeout:.0f} s, no reply" if timed_out else describe(raw, join)
    if stalled:
        what += f"; a Handshake was still unanswered after {stalled[0]:.1f} s"
    return f"{segments_len(segments) / 1e6:.1f} MB -> {what}"


def section_cpu(results: Results, timeout: float) -> None:
    for case, build in CPU_CASES.items():
        segments = build()

        def body(server: ServerProcess, put: Any, segments: list[bytes] = segments) -> str:
            return asyncio.run(cpu_case(server, segments, timeout, put))

        run_case(results, "cpu", case, config(CARTPOLE), body)


# --------------------------------------------------------------------------- 2. memory


async def memory_case(
    server: ServerProcess, segments: list[bytes], timeout: float, put: Any
) -> str:
    loop = asyncio.get_running_loop()
    pid = server.pid
    async with wire.WireClient(server.address, timeout=timeout) as client, client.join() as join:
        await open_session(client, join)
        await asyncio.sleep(0.5)
        baseline = rss_mib(pid)
        raw: bytes | None = None
        timed_out = False
        with RssSampler(pid) as sampler:
            t0 = loop.time()
            await send_segments(client, join.stream.id, segments, timeout)
            t_sent = loop.time()
            try:
                raw = await join.recv_raw(timeout)
            except TimeoutError:
                timed_out = True
            t_reply = loop.time()
            after: list[float] = []
            for settle in SETTLE_TIMES:
                await asyncio.sleep(max(0.0, t_reply + settle - loop.time()))
                after.append(rss_mib(pid))
        hwm = rss_mib(pid, "VmHWM")
        what = f">{timeout:.0f} s, no reply" if timed_out else describe(raw, join)

    put("send time", "s", t_sent - t0)
    put("reply after last byte", "s", math.inf if timed_out else t_reply - t_sent)
    put("RSS baseline", "MiB", baseline)
    put("RSS peak (10 ms samples)", "MiB", sampler.peak)
    put("VmHWM", "MiB", hwm)
    for settle, value in zip(SETTLE_TIMES, after, strict=True):
        put(f"RSS +{settle:.0f} s after reply", "MiB", value)
    put(f"kept at +{SETTLE_TIMES[-1]:.0f} s (RSS - baseline)", "MiB", after[-1] - baseline)
    return f"{segments_len(segments) / MiB:.1f} MiB -> {what}"


def section_memory(results: Results, timeout: float) -> None:
    cases = [
        (
            "step, one 255 MiB leaf",
            config(CARTPOLE),
            lambda: huge_leaf_step(255 * MiB),
        ),
        (
            "step[0], 200 MiB Text",
            config(TEXT_ENTRYPOINT),
            lambda: huge_text_step(200 * MiB),
        ),
    ]
    for case, server_config, build in cases:
        segments = build()

        def body(server: ServerProcess, put: Any, segments: list[bytes] = segments) -> str:
            return asyncio.run(memory_case(server, segments, timeout, put))

        run_case(results, "memory", case, server_config, body)
        del segments


# --------------------------------------------------------------------------- 3. buffering


class StingyClient:
    """An h2 client that reads the socket but never acknowledges DATA.

    The connection and stream receive windows stay at their initial 65,535 bytes
    forever, so the server can send at most that much DATA on the whole connection;
    every other reply stays wherever the server keeps it. The client still processes
    the server's SETTINGS and WINDOW_UPDATE frames, so it never violates the
    server's flow control.
    """

    def __init__(self, address: str) -> None:
        self.target = wire.Target.parse(address)
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.window = asyncio.Event()
        self.received = 0
        self.messages = 0
        """Complete gRPC messages received on the Join stream."""
        self.closed: str | None = None
        self._buffer = bytearray()
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.Task[None] | None = None

    async def open(self, timeout: float) -> None:
        reader, self._writer = await asyncio.wait_for(self.target.open(), timeout)
        self.conn.initiate_connection()
        self.flush()
        self._reader = asyncio.ensure_future(self._read(reader))

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and self._writer is not None and not self._writer.is_closing():
            self._writer.write(data)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    self.closed = "closed by the server"
                    break
                for event in self.conn.receive_data(chunk):
                    if isinstance(event, h2.events.DataReceived):
                        self.received += len(event.data)  # and never acknowledged
                        self._count(event.data)
                    elif isinstance(event, h2.events.StreamReset | h2.events.ConnectionTerminated):
                        self.closed = f"server: {event!r}"
                self.flush()  # SETTINGS / PING acknowledgements only
                self.window.set()
        except (OSError, h2.exceptions.ProtocolError) as exc:
            self.closed = f"connection lost: {exc!r}"
        self.window.set()

    def _count(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= 5:
            length = int.from_bytes(self._buffer[1:5], "big")
            if len(self._buffer) < 5 + length:
                return
            del self._buffer[: 5 + length]
            self.messages += 1

    def open_window(self, stream_id: int) -> None:
        """Grant 1 GiB on the connection and the stream at last: the backlog may flow."""
        with contextlib.suppress(h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self.conn.increment_flow_control_window(1 << 30)
            self.conn.increment_flow_control_window(1 << 30, stream_id)
            self.flush()

    def open_join(self) -> int:
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", wire.JOIN),
                (":authority", self.target.authority),
                ("te", "trailers"),
                ("content-type", "application/grpc"),
            ],
        )
        self.flush()
        return stream_id

    async def send_message(self, stream_id: int, payload: bytes, deadline: float) -> bool:
        """One gRPC message; False if the deadline passed while the server's window was shut."""
        loop = asyncio.get_running_loop()
        data = memoryview(struct.pack(">?I", False, len(payload)) + payload)
        while data:
            if self.closed is not None:
                raise ConnectionError(self.closed)
            window = min(
                self.conn.local_flow_control_window(stream_id), self.conn.max_outbound_frame_size
            )
            if window <= 0:
                self.window.clear()
                self.flush()
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.window.wait(), remaining)
                continue
            self.conn.send_data(stream_id, bytes(data[:window]))
            data = data[window:]
        self.flush()
        assert self._writer is not None
        remaining = max(0.001, deadline - loop.time())
        try:
            await asyncio.wait_for(self._writer.drain(), remaining)
        except TimeoutError:
            return False
        return True

    async def abort(self) -> None:
        if self._writer is not None:
            transport = self._writer.transport
            transport.abort()
            self._writer = None
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


BUFFERING_REQUESTS = 2000
BUFFERING_SECONDS = 10.0
REQUEST_ID_BYTES = 100 * 1024


async def buffering_case(server: ServerProcess, requests: int, seconds: float, put: Any) -> str:
    loop = asyncio.get_running_loop()
    pid = server.pid
    client = StingyClient(server.address)
    await client.open(10)
    try:
        stream_id = client.open_join()
        deadline = loop.time() + 10
        # The configure and whole-reset replies are small: they fit in the 64 KiB window.
        for request in (wire.configure(), wire.reset(seeds=list(range(NUM_ENVS)))):
            if not await client.send_message(stream_id, bytes(request), deadline):
                raise TimeoutError("could not send the session set-up")
        await asyncio.sleep(1.0)
        baseline = rss_mib(pid)
        pad = "x" * REQUEST_ID_BYTES
        prebuilt = [
            bytes(wire.step([wire.i64([a])], env_indices=[lane], request_id=f"{lane}{a}{pad}"))
            for lane in range(NUM_ENVS)
            for a in (0, 1)
        ]
        period = seconds / requests * 10  # 10 requests per tick
        sent = 0
        t0 = loop.time()
        hard_deadline = t0 + seconds + 5.0
        stopped = ""
        with RssSampler(pid) as sampler:
            while sent < requests:
                tick = t0 + (sent // 10) * period
                await asyncio.sleep(max(0.0, tick - loop.time()))
                ok = await client.send_message(
                    stream_id, prebuilt[sent % len(prebuilt)], hard_deadline
                )
                if not ok:
                    stopped = f"the server stopped reading after {sent} requests"
                    break
                sent += 1
            t_end = loop.time()
            rss_end = rss_mib(pid)
            await asyncio.sleep(3.0)
            rss_settled = rss_mib(pid)
            peak = sampler.peak
            # Now read everything: were those replies held by the server, all of them?
            before = client.messages
            client.open_window(stream_id)
            t_open = loop.time()
            want = 2 + sent  # configure + reset + the steps
            while client.messages < want and client.closed is None and loop.time() < t_open + 15:
                client.window.clear()  # set again by the reader after every chunk it reads
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(client.window.wait(), 0.5)
            drained = client.messages - before
            t_drained = loop.time() - t_open
            await asyncio.sleep(2.0)
            rss_drained = rss_mib(pid)
    finally:
        await client.abort()
    await asyncio.sleep(3.0)
    rss_gone = rss_mib(pid)

    put("requests let in", "n", float(sent))
    put("send time", "s", t_end - t0)
    put("RSS baseline", "MiB", baseline)
    put("RSS at end of sending", "MiB", rss_end)
    put("RSS +3 s", "MiB", rss_settled)
    put("RSS peak", "MiB", peak)
    growth = (rss_settled - baseline) / (sent / 1000) if sent else math.nan
    put("growth per 1000 requests", "MiB", growth)
    put("replies delivered once window opened", "n", float(drained))
    put("RSS 2 s after they were read", "MiB", rss_drained)
    put("RSS 3 s after disconnect", "MiB", rss_gone)
    return (
        f"{sent}/{requests} requests of {len(prebuilt[0]) / 1024:.0f} KiB in {t_end - t0:.1f} s "
        f"with only 64 KiB of window granted ({before} replies got through); once 1 GiB was "
        f"granted {drained} more replies arrived in {t_drained:.1f} s"
        + (f"; {stopped}" if stopped else "")
    )


def section_buffering(results: Results, requests: int, seconds: float) -> None:
    def body(server: ServerProcess, put: Any) -> str:
        return asyncio.run(buffering_case(server, requests, seconds, put))

    run_case(results, "buffering", f"{requests} lane steps, 100 KiB ids", config(CARTPOLE), body)


# --------------------------------------------------------------------------- output


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "timeout"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def table(results: Results) -> str:
    header = ("section", "case", "metric", "unit", "reference", "ours", "ours/ref")
    lines = [header]
    for row in results.rows.values():
        ratio = row.ratio()
        lines.append(
            (
                row.section,
                row.case,
                row.metric,
                row.unit,
                _fmt(row.values.get("ref")),
                _fmt(row.values.get("ours")),
                "-" if math.isnan(ratio) else f"{ratio:.2f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


SECTIONS = ("cpu", "memory", "buffering")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}"
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for one big request's reply"
    )
    parser.add_argument("--requests", type=int, default=BUFFERING_REQUESTS)
    parser.add_argument("--seconds", type=float, default=BUFFERING_SECONDS)
    parser.add_argument(
        "--ours-src",
        default="snapshot",
        help="which rlmesh_trio to serve: 'snapshot' (default: a copy of src/rlmesh_trio taken "
        "at the start, so a rewrite in progress cannot change it mid-run), 'live' (src as "
        "installed), or a directory holding an rlmesh_trio package",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {sorted(unknown)}; pick from {SECTIONS}")

    started = time.monotonic()
    ours = load_ours(args.ours_src)
    print(f"ours: {ours}", file=sys.stderr, flush=True)
    results = Results()
    if "cpu" in only:
        section_cpu(results, args.timeout)
    if "memory" in only:
        section_memory(results, args.timeout)
    if "buffering" in only:
        section_buffering(results, args.requests, args.seconds)

    print(f"\nrlmesh-trio vs rlmesh 0.1.0 under hostile clients (CartPole-v1, {NUM_ENVS} lanes)")
    print(f"ours: {ours}\n")
    print(table(results))
    print("\nreplies / notes:")
    for section, case, kind, text in results.notes:
        print(f"  {section} / {case} [{kind}]: {text}")
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    if args.json is not None:
        payload = {
            "rows": [
                {
                    "section": r.section,
                    "case": r.case,
                    "metric": r.metric,
                    "unit": r.unit,
                    "values": {k: (None if math.isnan(v) else v) for k, v in r.values.items()},
                    "ratio": None if math.isnan(r.ratio()) else r.ratio(),
                }
                for r in results.rows.values()
            ],
            "notes": [
                {"section": s, "case": c, "kind": k, "text": t} for s, c, k, t in results.notes
            ],
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
