"""Benchmark: rlmesh-trio's client against rlmesh 0.1.0's, on the same server.

Our server runs as a subprocess (``tests/support/refserver.py``, as in the tests) serving
CartPole-v1; every client runs in this process, alternating which goes first from round
to round; every number is the median over the rounds.

Rows:

* ``rlmesh_trio.client.VectorEnv`` (NEXT_STEP autoreset, done client-side) against
  ``rlmesh.numpy.RemoteVectorEnv`` (no autoreset; at N = 1, where it refuses the
  endpoint, ``rlmesh.numpy.RemoteEnv``) at N = 1, 4, 8 lanes: env steps/s (N x vector
  steps per second), random actions drawn beforehand;
* one CartPole step at a time on a one-lane endpoint, round-trip p50 / p99:
  the Trio client (``open_endpoint``), the raw wire client of ``tests/support/wire.py``
  (h2 on asyncio, nothing but framing: the floor), and — the transport alternative the
  client was chosen against — grpclib on an asyncio thread driven from Trio (the same
  messages, two thread crossings per call);
* ``--ref``: the same VectorEnv / RemoteVectorEnv rows against rlmesh 0.1.0's server.

Run: ``python bench/bench_client.py [--rounds R] [--seconds S] [--steps N] [--ref]
[--only throughput|latency] [--quick] [--json PATH]``.
On a shared 2-core VM numbers move from run to run: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _support  # noqa: F401  (the test harness as ``support``: see bench/_support.py)
import numpy as np
import trio
from support import wire
from support.refserver import ServerConfig, start_server

from rlmesh_trio.client import VectorEnv, open_endpoint
from rlmesh_trio.client._messages import (
    configure_request,
    decode_reply,
    reset_request,
    step_request,
)

ROOT = Path(__file__).resolve().parent.parent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# ---------------------------------------------------------------------------- throughput


def ours_vector(address: str, n: int, seconds: float) -> tuple[float, float]:
    env = VectorEnv(address)
    try:
        env.reset(seed=0)
        env.action_space.seed(0)
        actions = [env.action_space.sample() for _ in range(256)]
        return _loop(env, actions, n, seconds)
    finally:
        env.close()


def _loop(env: Any, actions: list[Any], n: int, seconds: float) -> tuple[float, float]:
    """(env steps/s, this process's CPU µs per env step — all its threads, so the
    native client's too) over ``seconds`` of back-to-back steps."""
    steps = 0
    cpu = time.process_time()
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        env.step(actions[steps % 256])
        steps += 1
    elapsed = time.perf_counter() - started
    return steps * n / elapsed, (time.process_time() - cpu) / (steps * n) * 1e6


def ref_vector(address: str, n: int, seconds: float) -> tuple[float, float]:
    """rlmesh's RemoteVectorEnv (it refuses one-lane endpoints: RemoteEnv there)."""
    from rlmesh.numpy import RemoteEnv, RemoteVectorEnv

    rng = np.random.default_rng(0)
    env: Any
    if n == 1:
        env = RemoteEnv(address)
        env.reset(seed=0)
        actions: list[Any] = [int(a) for a in rng.integers(0, 2, 256)]
    else:
        env = RemoteVectorEnv(address)
        env.reset(seed=list(range(n)))
        actions = [rng.integers(0, 2, n) for _ in range(256)]
    try:
        return _loop(env, actions, n, seconds)
    finally:
        env.close()


# ---------------------------------------------------------------------------- latency


async def trio_client(address: str, steps: int) -> list[float]:
    out: list[float] = []
    actions = [np.array([0]), np.array([1])]
    async with open_endpoint(address) as ep:
        await ep.reset(seeds=0)
        for i in range(steps):
            started = time.perf_counter()
            _obs, _r, term, trunc, _ = await ep.step(actions[i % 2])
            out.append(time.perf_counter() - started)
            if term[0] or trunc[0]:
                await ep.reset()
    return out


async def trio_transport(address: str, steps: int) -> list[float]:
    """The Trio client's transport alone: the same request bytes and reply decoding as
    the other two transport rows, none of the numpy / gymnasium batching."""
    out: list[float] = []
    actions = [[np.int64(0).tobytes()], [np.int64(1).tobytes()]]
    async with open_endpoint(address) as ep:
        await ep.reset(seeds=0)
        state = ep._joined()
        for i in range(steps):
            rid = state.next_id()
            started = time.perf_counter()
            reply = (await ep._call(step_request(rid, actions[i % 2]), rid)).reply
            out.append(time.perf_counter() - started)
            assert reply is not None
            if reply.terminated != b"\x00" or reply.truncated != b"\x00":
                await ep.reset()
    return out


async def raw_floor(address: str, steps: int) -> list[float]:
    out: list[float] = []
    async with wire.WireClient(address) as client, client.join() as join:
        await join.call(wire.configure())
        await join.call(wire.reset(seeds=[0]))
        actions = [[wire.i64([0])], [wire.i64([1])]]
        for i in range(steps):
            request = wire.step(actions[i % 2])
            started = time.perf_counter()
            reply = await join.call(request)
            out.append(time.perf_counter() - started)
            assert reply.step is not None
            if reply.step.terminated_mask != b"\x00" or reply.step.truncated_mask != b"\x00":
                await join.call(wire.reset())
        await join.call(wire.close())
    return out


class GrpclibThread:
    """The alternative transport: grpclib's Join on an asyncio loop in its own thread,
    called from Trio (one crossing out, one back per request)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _open(self) -> None:
        from grpclib.client import Channel
        from grpclib.const import Cardinality

        from rlmesh_trio._transport._shim import RawCodec

        target = wire.Target.parse(self.address)
        self.channel = Channel(target.host, target.port, codec=RawCodec())
        self.cm = self.channel.request(
            "/rlmesh.env.v1.EnvService/Join", Cardinality.STREAM_STREAM, bytes, bytes
        )
        self.stream = await self.cm.__aenter__()
        await self.stream.send_request()

    async def _call(self, payload: bytes) -> bytes:
        await self.stream.send_message(payload)
        reply: bytes = await self.stream.recv_message()
        return reply

    async def _close(self) -> None:
        await self.stream.cancel()
        self.channel.close()

    async def run(self, coro: Any) -> Any:
        """Run ``coro`` on the loop thread; wake this Trio task when it is done."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        future.add_done_callback(lambda _f: token.run_sync_soon(done.set))
        await done.wait()
        return future.result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


async def grpclib_thread(address: str, steps: int) -> list[float]:
    client = GrpclibThread(address)
    out: list[float] = []
    try:
        await client.run(client._open())
        await client.run(client._call(configure_request("c")))
        await client.run(client._call(reset_request("r", seeds=[0])))
        actions = [[np.int64(0).tobytes()], [np.int64(1).tobytes()]]
        for i in range(steps):
            started = time.perf_counter()
            reply = decode_reply(
                await client.run(client._call(step_request(f"s{i}", actions[i % 2])))
            )
            out.append(time.perf_counter() - started)
            if reply.terminated != b"\x00" or reply.truncated != b"\x00":
                await client.run(client._call(reset_request(f"x{i}")))
        await client.run(client._close())
    finally:
        client.stop()
    return out


# ---------------------------------------------------------------------------- main


def rounds_of(rounds: int, work: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    results: dict[str, list[Any]] = {name: [] for name in work}
    names = list(work)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            results[name].append(work[name]())
    return results


def bench(
    rounds: int, seconds: float, steps: int, with_ref: bool, only: str | None = None
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    kinds = ["ours", "ref"] if with_ref else ["ours"]
    with_latency = only in (None, "latency")
    for kind in kinds if only in (None, "throughput") else []:
        for n in (1, 4, 8):
            server = start_server(
                kind, ServerConfig(entrypoint="support.envs:make_cartpole", num_envs=n)
            )  # type: ignore[arg-type]
            try:
                work: dict[str, Callable[[], Any]] = {
                    "VectorEnv": functools.partial(ours_vector, server.address, n, seconds),
                    "RemoteVectorEnv": functools.partial(ref_vector, server.address, n, seconds),
                }
                results = rounds_of(rounds, work)
            finally:
                server.stop()
            ours = statistics.median(r[0] for r in results["VectorEnv"])
            ref = statistics.median(r[0] for r in results["RemoteVectorEnv"])
            ours_cpu = statistics.median(r[1] for r in results["VectorEnv"])
            ref_cpu = statistics.median(r[1] for r in results["RemoteVectorEnv"])
            rows.append(
                {
                    "server": kind,
                    "row": f"CartPole N={n}",
                    "metric": "env steps/s; client CPU us per env step",
                    "rlmesh_trio.client.VectorEnv": ours,
                    "rlmesh RemoteVectorEnv": ref,
                    "ratio": ours / ref,
                    "VectorEnv cpu_us": ours_cpu,
                    "RemoteVectorEnv cpu_us": ref_cpu,
                }
            )
            print(rows[-1], flush=True)
    if not with_latency:
        return rows
    server = start_server("ours", ServerConfig(entrypoint="support.envs:make_cartpole", num_envs=1))
    address = server.address
    try:
        latency = rounds_of(
            rounds,
            {
                "Endpoint.step (h2 on Trio)": timed(lambda: trio.run(trio_client, address, steps)),
                "transport only: h2 on Trio": timed(
                    lambda: trio.run(trio_transport, address, steps)
                ),
                "raw floor: test client, h2 on asyncio": timed(
                    lambda: asyncio.run(raw_floor(address, steps))
                ),
                "transport only: grpclib on a thread, from Trio": timed(
                    lambda: trio.run(grpclib_thread, address, steps)
                ),
            },
        )
    finally:
        server.stop()
    for name, per_round in latency.items():
        p50 = statistics.median(percentile(v, 50) for v, _ in per_round) * 1e3
        p99 = statistics.median(percentile(v, 99) for v, _ in per_round) * 1e3
        cpu = statistics.median(c / steps for _, c in per_round) * 1e6
        rows.append(
            {
                "server": "ours",
                "row": "CartPole N=1 step round trip",
                "client": name,
                "p50_ms": p50,
                "p99_ms": p99,
                "client_cpu_us_per_step": cpu,
            }
        )
        print(rows[-1], flush=True)
    return rows


def timed(run: Callable[[], list[float]]) -> Callable[[], tuple[list[float], float]]:
    """``run``, returning its latencies and this process's CPU seconds (all threads;
    connecting included, a few ms over the whole run)."""

    def wrapper() -> tuple[list[float], float]:
        cpu = time.process_time()
        latencies = run()
        return latencies, time.process_time() - cpu

    return wrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per throughput measurement")
    parser.add_argument("--steps", type=int, default=2000, help="per latency measurement")
    parser.add_argument("--ref", action="store_true", help="also against rlmesh 0.1.0's server")
    parser.add_argument("--only", choices=["throughput", "latency"])
    parser.add_argument(
        "--quick", action="store_true", help="1 round, 1 s per measurement, 500 steps"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.steps = 1, 1.0, 500
    rows = bench(args.rounds, args.seconds, args.steps, args.ref, args.only)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
