"""Benchmark: what TLS costs. The same server (a subprocess, CartPole-v1) plaintext, TLS
and mTLS, driven by ``rlmesh_trio.client.VectorEnv`` (env steps/s at N lanes) and by the
Trio client one step at a time (round trip p50 / p99) and by connection setups per second
(connect, Handshake, Join, close: what the TLS handshake adds to a session).

Certificates come from a throwaway CA (trustme, the test extra). Alternates the modes
from round to round; every number is the median over the rounds.

Run: ``python bench/bench_tls.py [--rounds R] [--seconds S] [--lanes N]``.
On a shared 2-core VM numbers move from run to run: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import trio
import trustme

from rlmesh_trio.client import VectorEnv, open_endpoint

MODES = ("plaintext", "tls", "mtls")


class Pki:
    def __init__(self, root: Path) -> None:
        ca = trustme.CA()
        server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("bench@client")
        self.ca, self.cert, self.key = root / "ca.pem", root / "cert.pem", root / "key.pem"
        self.client_cert, self.client_key = root / "client.pem", root / "client.key"
        ca.cert_pem.write_to_path(str(self.ca))
        self.cert.write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
        server.private_key_pem.write_to_path(str(self.key))
        self.client_cert.write_bytes(b"".join(b.bytes() for b in client.cert_chain_pems))
        client.private_key_pem.write_to_path(str(self.client_key))

    def serve_flags(self, mode: str) -> list[str]:
        if mode == "plaintext":
            return []
        flags = ["--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key)]
        return flags + (["--tls-client-ca-file", str(self.ca)] if mode == "mtls" else [])

    def client(self, mode: str) -> ssl.SSLContext | None:
        if mode == "plaintext":
            return None
        context = ssl.create_default_context(cafile=str(self.ca))
        if mode == "mtls":
            context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


@contextlib.contextmanager
def server(pki: Pki, mode: str, lanes: int) -> Iterator[str]:
    read_fd, write_fd = os.pipe()
    args = ["serve", "--env", "CartPole-v1", "--num-envs", str(lanes), "--ready-fd"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlmesh_trio", *args, str(write_fd), *pki.serve_flags(mode)],
        pass_fds=(write_fd,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(write_fd)
    try:
        with os.fdopen(read_fd) as ready:
            address = ready.readline().strip()
        if not address:
            raise RuntimeError(f"the {mode} server did not start")
        yield address
    finally:
        proc.terminate()
        proc.wait(30)


def throughput(address: str, tls: Any, lanes: int, seconds: float) -> float:
    env = VectorEnv(address, tls=tls)
    try:
        env.reset(seed=0)
        actions = np.random.default_rng(0).integers(0, 2, size=(4096, lanes))
        steps, began = 0, time.perf_counter()
        while time.perf_counter() - began < seconds:
            env.step(actions[steps % len(actions)])
            steps += 1
        return steps * lanes / (time.perf_counter() - began)
    finally:
        env.close()


async def latency(address: str, tls: Any, steps: int) -> tuple[float, float, float]:
    """Round trip p50 and p99 (ms), and the client's own CPU per step (µs; robust to a
    busy machine, unlike the wall clock)."""
    async with open_endpoint(address, tls=tls) as ep:
        await ep.reset(seeds=0)
        action = np.zeros(ep.num_envs, dtype=np.int64)
        times = []
        cpu = time.process_time()
        for _ in range(steps):
            began = time.perf_counter()
            await ep.step(action)
            times.append(time.perf_counter() - began)
        cpu = time.process_time() - cpu
    times.sort()
    return times[len(times) // 2] * 1e3, times[int(len(times) * 0.99)] * 1e3, cpu / steps * 1e6


async def sessions(address: str, tls: Any, seconds: float) -> float:
    count, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        async with open_endpoint(address, tls=tls):
            count += 1
    return count / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    with tempfile.TemporaryDirectory() as root:
        pki = Pki(Path(root))
        for round_ in range(args.rounds):
            order = MODES[round_ % 3 :] + MODES[: round_ % 3]
            for mode in order:
                tls = pki.client(mode)
                row = results[mode]
                with server(pki, mode, args.lanes) as address:
                    row.setdefault("steps/s", []).append(
                        throughput(address, tls, args.lanes, args.seconds)
                    )
                with server(pki, mode, 1) as address:
                    p50, p99, cpu = trio.run(latency, address, tls, args.steps)
                    row.setdefault("cpu us", []).append(cpu)
                    row.setdefault("p50 ms", []).append(p50)
                    row.setdefault("p99 ms", []).append(p99)
                    row.setdefault("sessions/s", []).append(
                        trio.run(sessions, address, tls, args.seconds)
                    )
    print(
        f"| mode | env steps/s (N={args.lanes}) | step p50 ms | step p99 ms "
        "| client CPU µs/step | sessions/s |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in MODES:
        row = {k: statistics.median(v) for k, v in results[mode].items()}
        print(
            f"| {mode} | {row['steps/s']:.0f} | {row['p50 ms']:.3f} | {row['p99 ms']:.3f} | "
            f"{row['cpu us']:.0f} | {row['sessions/s']:.1f} |"
        )


if __name__ == "__main__":
    main()
