"""TLS and mTLS end to end, loopback only, on a throwaway CA (trustme): the server
(``ServeOptions`` and ``rlmesh-trio serve --tls-*``), the Trio client, ``VectorEnv`` and
``Env``, the probe (function and CLI), the static fleet; what fails, fails in the
handshake with a clear error and the server keeps serving."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_cli
import trio
import trustme
from test_cli import BOUND, run_probe, spawn, start_serving

from rlmesh_trio import ServeOptions, serve_env
from rlmesh_trio._options import resolve
from rlmesh_trio.client import (
    ConnectionLostError,
    Env,
    RpcError,
    VectorEnv,
    open_endpoint,
    probe,
)
from rlmesh_trio.fleet import Fleet, FleetError

pytestmark = pytest.mark.timeout(120)

procs = test_cli.procs  # the fixture: server subprocesses, killed at the end

WAIT = 30.0
"""Bound (seconds) on any single wait here: these tests fail, never hang."""


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: str
    """The CA that signed the server's and the good client's certificates (PEM)."""
    cert: str
    """The server's chain, for 127.0.0.1, ::1 and localhost."""
    key: str
    client_cert: str
    client_key: str
    other_ca: str
    """A second CA: its client certificate must be refused."""
    other_client_cert: str
    other_client_key: str
    dns_only_cert: str
    """A server certificate naming only ``localhost`` (no IP SAN)."""
    dns_only_key: str

    def client(self, *, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca)
        if cert is not None:
            context.load_cert_chain(cert, key)
        return context

    def good_client(self) -> ssl.SSLContext:
        return self.client(cert=self.client_cert, key=self.client_key)

    def server(self, **extra: Any) -> ServeOptions:
        return ServeOptions(tls_cert_file=self.cert, tls_key_file=self.key, **extra)

    def mtls(self, **extra: Any) -> ServeOptions:
        return self.server(tls_client_ca_file=self.ca, **extra)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()

    def write(name: str, blob: trustme.Blob | list[trustme.Blob]) -> str:
        path = root / name
        blobs = blob if isinstance(blob, list) else [blob]
        path.write_bytes(b"".join(b.bytes() for b in blobs))
        return str(path)

    server = ca.issue_cert("127.0.0.1", "::1", "localhost")
    client = ca.issue_cert("client@rlmesh-trio.test")
    stranger = other.issue_cert("client@rlmesh-trio.test")
    dns_only = ca.issue_cert("localhost")
    return Pki(
        ca=write("ca.pem", ca.cert_pem),
        cert=write("server.pem", server.cert_chain_pems),
        key=write("server.key", server.private_key_pem),
        client_cert=write("client.pem", client.cert_chain_pems),
        client_key=write("client.key", client.private_key_pem),
        other_ca=write("other-ca.pem", other.cert_pem),
        other_client_cert=write("stranger.pem", stranger.cert_chain_pems),
        other_client_key=write("stranger.key", stranger.private_key_pem),
        dns_only_cert=write("dns-only.pem", dns_only.cert_chain_pems),
        dns_only_key=write("dns-only.key", dns_only.private_key_pem),
    )


@contextlib.asynccontextmanager
async def serving(
    options: ServeOptions, *, num_envs: int = 2, env: str = "CartPole-v1"
) -> AsyncIterator[Any]:
    async with trio.open_nursery() as nursery:
        with trio.fail_after(WAIT):
            info = await nursery.start(
                lambda task_status: serve_env(
                    env, num_envs=num_envs, options=options, task_status=task_status
                )
            )
        try:
            yield info
        finally:
            nursery.cancel_scope.cancel()


async def in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with trio.fail_after(WAIT):
        return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


async def _a_session(address: str, **kwargs: Any) -> int:
    with trio.fail_after(WAIT):
        async with open_endpoint(address, **kwargs) as ep:
            obs, _ = await ep.reset(seeds=7)
            obs2, rewards, *_ = await ep.step(np.zeros(ep.num_envs, dtype=np.int64))
            assert obs.shape == obs2.shape == (ep.num_envs, 4)
            assert rewards.tolist() == [1.0] * ep.num_envs
            return ep.num_envs


# ---------------------------------------------------------------------------- TLS


async def test_trio_client_over_tls(pki: Pki) -> None:
    async with serving(pki.server()) as info:
        assert info.tls and not info.mtls
        assert info.address.startswith("tcp://127.0.0.1:")
        assert await _a_session(info.address, tls=pki.ca) == 2  # a CA file
        assert await _a_session(info.address, tls=Path(pki.ca)) == 2  # PathLike
        assert await _a_session(info.address, tls=pki.client()) == 2  # an SSLContext
        # The same context again (set up once, shared by threads in a fleet).
        context = pki.client()
        assert await _a_session(info.address, tls=context) == 2
        assert await _a_session(info.address, tls=context) == 2


async def test_vector_env_and_env_over_tls(pki: Pki) -> None:
    async with serving(pki.server()) as info:

        def drive() -> None:
            env = VectorEnv(info.address, tls=pki.ca)
            try:
                obs, _ = env.reset(seed=3)
                assert obs.shape == (2, 4)
                obs, rewards, *_ = env.step(np.array([0, 1]))
                assert rewards.tolist() == [1.0, 1.0]
            finally:
                env.close()

        await in_thread(drive)
    async with serving(pki.server(), num_envs=1) as info:

        def single() -> None:
            env = Env(info.address, tls=pki.client())
            try:
                obs, _ = env.reset(seed=3)
                assert obs.shape == (4,)
                assert env.step(1)[1] == 1.0
            finally:
                env.close()

        await in_thread(single)


async def test_system_trust_refuses_a_private_ca_and_names_why(pki: Pki) -> None:
    async with serving(pki.server()) as info:
        with pytest.raises(ConnectionLostError, match="certificate verification failed"):
            await _a_session(info.address, tls=True)
        with pytest.raises(ConnectionLostError, match="certificate verification failed"):
            await in_thread(VectorEnv, info.address, tls=True)
        assert await _a_session(info.address, tls=pki.ca) == 2  # still serving


async def test_ip_addresses_are_checked_against_ip_sans(pki: Pki) -> None:
    """A certificate naming only ``localhost``: good for ``localhost:port``, refused for
    ``127.0.0.1:port`` (an IP address is matched against IP SANs, never DNS names)."""
    options = ServeOptions(tls_cert_file=pki.dns_only_cert, tls_key_file=pki.dns_only_key)
    async with serving(options) as info:
        with pytest.raises(ConnectionLostError, match="IP address mismatch"):
            await _a_session(info.address, tls=pki.ca)
        port = info.address.rsplit(":", 1)[1]
        assert await _a_session(f"localhost:{port}", tls=pki.ca) == 2


async def test_plaintext_and_tls_mismatches_fail_at_once_with_a_clear_error(pki: Pki) -> None:
    async with serving(pki.server()) as info:
        with trio.fail_after(WAIT):
            with pytest.raises(ConnectionLostError, match="TLS"):
                await _a_session(info.address)
        with pytest.raises(ConnectionLostError, match="TLS"):
            await in_thread(VectorEnv, info.address)
        result = await in_thread(probe, info.address, timeout_seconds=5.0)
        assert not result.serving and "TLS" in (result.error or "")
        assert await _a_session(info.address, tls=pki.ca) == 2
    async with serving(ServeOptions()) as info:  # TLS client, plaintext server
        with pytest.raises(ConnectionLostError, match=r"TLS handshake with .* failed"):
            await _a_session(info.address, tls=pki.ca)
        with pytest.raises(ConnectionLostError, match=r"TLS handshake with .* failed"):
            await in_thread(VectorEnv, info.address, tls=pki.ca)
        assert await _a_session(info.address) == 2


async def test_the_token_is_still_enforced_under_tls(pki: Pki) -> None:
    async with serving(pki.server(auth_token="s3cret")) as info:
        with pytest.raises(RpcError) as caught:
            await _a_session(info.address, tls=pki.ca)
        assert caught.value.grpc_status == 16  # UNAUTHENTICATED
        assert await _a_session(info.address, tls=pki.ca, auth_token="s3cret") == 2
        anonymous = await in_thread(probe, info.address, tls=pki.ca)
        assert anonymous.health == "SERVING"  # the health check needs no token
        assert not anonymous.serving and "UNAUTHENTICATED" in (anonymous.error or "")
        assert (await in_thread(probe, info.address, tls=pki.ca, auth_token="s3cret")).serving


# ---------------------------------------------------------------------------- mTLS


async def test_mtls_admits_only_certificates_of_its_client_ca(pki: Pki) -> None:
    async with serving(pki.mtls()) as info:
        assert info.tls and info.mtls
        assert resolve(pki.mtls()).mtls
        with pytest.raises(ConnectionLostError, match="certificate"):
            await _a_session(info.address, tls=pki.ca)  # no client certificate
        stranger = pki.client(cert=pki.other_client_cert, key=pki.other_client_key)
        with pytest.raises(ConnectionLostError, match="TLS"):
            await _a_session(info.address, tls=stranger)  # signed by another CA
        with pytest.raises(ConnectionLostError, match="TLS"):
            await in_thread(VectorEnv, info.address, tls=pki.ca)
        refused = await in_thread(probe, info.address, tls=pki.ca)
        assert not refused.serving and refused.health == "unknown"
        assert "certificate" in (refused.error or "")
        # Still serving, to the right certificate, through every client.
        assert await _a_session(info.address, tls=pki.good_client()) == 2
        env = await in_thread(VectorEnv, info.address, tls=pki.good_client())
        await in_thread(env.close)
        found = await in_thread(probe, info.address, tls=pki.good_client())
        assert found.serving and found.health == "SERVING" and found.num_envs == 2
        assert found.lane_states == ("serving", "serving")


# ---------------------------------------------------------------------------- options


def test_serve_options_check_the_tls_files(pki: Pki, tmp_path: Path) -> None:
    assert resolve(ServeOptions()).tls is None and not resolve(ServeOptions()).mtls
    files = resolve(pki.server()).tls
    assert files is not None and files.cert_file == pki.cert and files.client_ca_file is None
    with pytest.raises(ValueError, match="tls_cert_file needs tls_key_file"):
        resolve(ServeOptions(tls_cert_file=pki.cert))
    with pytest.raises(ValueError, match="tls_key_file needs tls_cert_file"):
        resolve(ServeOptions(tls_key_file=pki.key))
    with pytest.raises(ValueError, match="tls_client_ca_file needs tls_cert_file"):
        resolve(ServeOptions(tls_client_ca_file=pki.ca))
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match=r"tls_cert_file .*nope\.pem.*: no such file"):
        resolve(ServeOptions(tls_cert_file=missing, tls_key_file=pki.key))
    with pytest.raises(ValueError, match=r"tls_client_ca_file .*: no such file"):
        resolve(pki.server(tls_client_ca_file=missing))
    with pytest.raises(ValueError, match="cannot load the certificate and its key"):
        resolve(ServeOptions(tls_cert_file=pki.cert, tls_key_file=pki.client_key))  # not its key
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="cannot load"):
        resolve(ServeOptions(tls_cert_file=str(garbage), tls_key_file=pki.key))
    with pytest.raises(ValueError, match=r"tls_client_ca_file .*cannot load"):
        resolve(pki.server(tls_client_ca_file=str(garbage)))


async def test_tls_on_a_unix_socket_is_refused_clearly(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="TLS is served on TCP addresses only"):
        await serve_env("CartPole-v1", address=f"unix://{tmp_path}/s.sock", options=pki.server())
    with pytest.raises(ValueError, match="tls= is for TCP addresses"):
        async with open_endpoint(f"unix://{tmp_path}/s.sock", tls=pki.ca):
            pass
    with pytest.raises(ValueError, match="tls= is for TCP addresses"):
        VectorEnv(f"unix://{tmp_path}/s.sock", tls=True)


def test_client_tls_arguments_are_checked(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="tls must be"):
        VectorEnv("127.0.0.1:1", tls=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no such file"):
        probe("127.0.0.1:1", tls=str(tmp_path / "missing-ca.pem"))
    with pytest.raises(ValueError, match="no such file"):
        Fleet.from_addresses(["127.0.0.1:1"], tls=str(tmp_path / "missing-ca.pem"))


# ---------------------------------------------------------------------------- the CLI


def _serve_tls(procs: Any, pki: Pki, *extra: str) -> str:
    return start_serving(
        procs,
        "--env",
        "CartPole-v1",
        "--tls-cert-file",
        pki.cert,
        "--tls-key-file",
        pki.key,
        *extra,
    )[1]


def test_serve_and_probe_cli_over_tls(procs: list[subprocess.Popen[bytes]], pki: Pki) -> None:
    address = _serve_tls(procs, pki)
    code, out, err = run_probe(address, "--tls-ca-file", pki.ca, "--json")
    assert code == 0, (out, err)
    report = json.loads(out)
    assert report["serving"] is True and report["health"] == "SERVING"
    assert report["env_id"] == "CartPole-v1"
    code, out, _ = run_probe(address, "--timeout-seconds", "5")  # plaintext probe of a TLS server
    assert code == 1 and "unreachable" in out and "TLS" in out
    code, out, _ = run_probe(address, "--tls")  # system trust: not our CA
    assert code == 1 and "certificate verification failed" in out
    assert run_probe(address, "--tls-cert-file", pki.client_cert)[0] == 2  # no key
    proc = procs[0]
    proc.terminate()
    _, err = proc.communicate(timeout=BOUND)
    said = err.decode().splitlines()
    assert any(line.endswith(f"on {address} (TLS)") for line in said), said


def test_probe_cli_under_mtls(procs: list[subprocess.Popen[bytes]], pki: Pki) -> None:
    address = _serve_tls(procs, pki, "--tls-client-ca-file", pki.ca)
    code, out, _ = run_probe(address, "--tls-ca-file", pki.ca)
    assert code == 1 and "certificate" in out
    code, out, _ = run_probe(
        address,
        "--tls-ca-file",
        pki.ca,
        "--tls-cert-file",
        pki.other_client_cert,
        "--tls-key-file",
        pki.other_client_key,
    )
    assert code == 1 and "unreachable" in out
    code, out, err = run_probe(
        address,
        "--tls-ca-file",
        pki.ca,
        "--tls-cert-file",
        pki.client_cert,
        "--tls-key-file",
        pki.client_key,
    )
    assert code == 0, (out, err)
    assert "SERVING" in out and "CartPole-v1" in out
    procs[0].terminate()
    _, err = procs[0].communicate(timeout=BOUND)
    assert f"on {address} (mTLS)" in err.decode()


def test_serve_cli_refuses_half_a_tls_configuration(pki: Pki) -> None:
    proc = spawn("serve", "--env", "CartPole-v1", "--tls-cert-file", pki.cert)
    _, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 1
    assert "tls_cert_file needs tls_key_file" in err.decode()


# ---------------------------------------------------------------------------- the fleet


async def test_a_static_fleet_over_tls_and_mtls(pki: Pki) -> None:
    async with serving(pki.server()) as one, serving(pki.mtls()) as two:

        def drive() -> None:
            with Fleet.from_addresses([one.address], tls=pki.ca) as fleet:
                (health,) = fleet.health()
                assert health.serving and health.num_envs == 2
                assert fleet.tls == pki.ca

                def shard(address: str, seed: int) -> float:
                    env = VectorEnv(address, tls=fleet.tls)
                    try:
                        env.reset(seed=seed)
                        return float(env.step(np.array([0, 0]))[1].sum())
                    finally:
                        env.close()

                assert fleet.map(shard, [1, 2, 3]) == [2.0, 2.0, 2.0]
                with pytest.raises(FleetError, match="TLS"):
                    fleet.run(object(), seeds=[0])
            with Fleet.from_addresses([one.address]) as plain:
                (health,) = plain.health()
                assert not health.serving and "TLS" in (health.error or "")
            with Fleet.from_addresses([two.address], tls=pki.good_client()) as fleet:
                fleet.wait_ready(WAIT)
                assert [h.serving for h in fleet.health()] == [True]
            with Fleet.from_addresses([two.address], tls=pki.ca) as fleet:
                (health,) = fleet.health()
                assert not health.serving and "certificate" in (health.error or "")

        await in_thread(drive)


# ---------------------------------------------------------------------------- rlmesh 0.1.0


@pytest.mark.interop
async def test_the_reference_client_has_no_tls(pki: Pki) -> None:
    """rlmesh 0.1.0's client dials ``tcp://`` in plaintext only (``https://`` is kept for
    its control plane): it cannot reach a TLS endpoint, and its attempt costs the
    server nothing."""
    import rlmesh.numpy

    async with serving(pki.server()) as info:
        port = info.address.rsplit(":", 1)[1]
        with pytest.raises(ValueError, match="https://"):
            rlmesh.numpy.RemoteEnv(f"https://127.0.0.1:{port}", connect_timeout_seconds=2)
        with pytest.raises(Exception):  # noqa: B017 - its own error type for a failed connect
            await in_thread(rlmesh.numpy.RemoteEnv, info.address, connect_timeout_seconds=2)
        assert await _a_session(info.address, tls=pki.ca) == 2


# ---------------------------------------------------------------------------- reload


def _copy(source: str | bytes, target: Path) -> None:
    target.write_bytes(Path(source).read_bytes() if isinstance(source, str) else source)


class _Said(logging.Handler):
    """Sets a Trio event (from whichever thread logs) once a message containing
    ``text`` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.INFO)
        self.text = text
        self.event = trio.Event()
        self._token = trio.lowlevel.current_trio_token()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self._token.run_sync_soon(self.event.set)

    async def wait(self) -> None:
        with trio.fail_after(WAIT):
            await self.event.wait()


@contextlib.contextmanager
def _listening(text: str) -> Iterator[_Said]:
    logger = logging.getLogger("rlmesh_trio.transport")
    handler, level = _Said(text), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_a_renewed_certificate_is_served_without_a_restart(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files are looked at every RELOAD_INTERVAL: a certificate of a new CA written
    over the old one is served from the next handshake on (a client trusting only the
    old CA is refused then); files that do not load leave the previous certificate."""
    from rlmesh_trio import _tls

    monkeypatch.setattr(_tls, "RELOAD_INTERVAL", 0.05)
    cert, key = tmp_path / "live.pem", tmp_path / "live.key"
    _copy(pki.cert, cert)
    _copy(pki.key, key)
    renewed = trustme.CA()
    renewed_ca = str(tmp_path / "renewed-ca.pem")
    renewed.cert_pem.write_to_path(renewed_ca)
    issued = renewed.issue_cert("127.0.0.1")
    async with serving(ServeOptions(tls_cert_file=str(cert), tls_key_file=str(key))) as info:
        assert await _a_session(info.address, tls=pki.ca) == 2
        with _listening("the TLS files changed but cannot be used") as said:
            _copy(issued.private_key_pem.bytes(), key)  # the new key, the old certificate
            await said.wait()
        assert await _a_session(info.address, tls=pki.ca) == 2  # the previous one stays
        with _listening("certificate reloaded") as said:
            _copy(b"".join(b.bytes() for b in issued.cert_chain_pems), cert)
            await said.wait()
        assert await _a_session(info.address, tls=renewed_ca) == 2
        with pytest.raises(ConnectionLostError, match="certificate verification failed"):
            await _a_session(info.address, tls=pki.ca)


def test_fleet_cli_checks_its_tls_flags_before_starting_ray(
    pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlmesh_trio._cli import main

    base = ["fleet", "--env", "CartPole-v1", "--endpoints", "1"]
    assert main([*base, "--tls-ca-file", pki.ca]) == 2
    assert "need --tls-cert-file and --tls-key-file" in capsys.readouterr().err
    served = [*base, "--tls-cert-file", pki.cert, "--tls-key-file", pki.key]
    assert main([*served, "--tls-client-ca-file", pki.ca]) == 2
    assert "the probes need a client certificate" in capsys.readouterr().err
    assert main([*served, "--tls-client-cert-file", pki.client_cert]) == 2
    assert "go together" in capsys.readouterr().err
    assert (
        main([*served, "--tls-client-cert-file", pki.cert, "--tls-client-key-file", pki.client_key])
        == 2
    )
    assert "--tls-client-key-file: cannot load them" in capsys.readouterr().err


@pytest.mark.parametrize(("kind", "warned"), [("tls", True), ("mtls", False)])
async def test_beyond_loopback_mtls_counts_as_knowing_the_client(
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    warned: bool,
) -> None:
    """TLS alone encrypts but does not say who the client is: only mTLS (or a token)
    silences the beyond-loopback warning."""
    from rlmesh_trio import _serve

    monkeypatch.setattr(_serve, "is_loopback", lambda address: False)
    caplog.set_level(logging.WARNING, logger="rlmesh_trio")
    async with serving(pki.mtls() if kind == "mtls" else pki.server()):
        pass
    warnings = [r for r in caplog.records if "beyond loopback" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0)


def test_a_reset_tls_session_before_any_frame_reads_as_a_refusal() -> None:
    """A busy mTLS server's refusal can arrive as a TCP reset instead of an EOF: before
    the server's first HTTP/2 frame, on TLS, both read as the refusal they are."""
    from rlmesh_trio.client._grpc import GrpcConnection
    from rlmesh_trio.client._settings import transport_failure

    reset = trio.BrokenResourceError("socket connection broken")
    reset.__cause__ = ConnectionResetError(104, "Connection reset by peer")
    secure = GrpcConnection("localhost:1", [], tls=True)
    assert "ended the TLS session abruptly" in transport_failure(secure, reset, "lost")
    plain = GrpcConnection("localhost:1", [])
    assert transport_failure(plain, reset, "lost").startswith("lost: BrokenResourceError(")
    # A plaintext client reset before any frame: a TLS server's alert may have been
    # destroyed by the reset (the blocking client sees the OSError itself); say what it
    # most likely was (CI saw the alert lost once, and the message had no hint).
    for error in (reset, ConnectionResetError(104, "Connection reset by peer")):
        said = transport_failure(plain, error, "Handshake failed: connection lost")
        assert "if it serves TLS, connect with tls=" in said, said
    eof = ssl.SSLEOFError(8, "EOF occurred in violation of protocol")
    assert "abruptly" in transport_failure(plain, eof, "lost")


def _tls_first_bytes(address: str, ca: str, alpn: list[str] | None) -> tuple[str | None, bytes]:
    """A raw TLS client offering ``alpn`` (None: no ALPN at all) that sends the HTTP/2
    preface: what ALPN it agreed on, and what the server sent before closing (or 1 s)."""
    import socket

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca)
    if alpn is not None:
        context.set_alpn_protocols(alpn)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
    with (
        socket.create_connection((host, int(port)), timeout=WAIT) as raw,
        context.wrap_socket(raw, server_hostname=host) as sock,
    ):
        selected = sock.selected_alpn_protocol()
        received = b""
        with contextlib.suppress(OSError):
            sock.sendall(preface)
            sock.settimeout(1.0)
            while chunk := sock.recv(4096):
                received += chunk
    return selected, received


@pytest.mark.parametrize("alpn", [["http/1.1"], None], ids=["http1-only", "no-alpn"])
async def test_a_tls_client_that_does_not_negotiate_h2_is_refused(
    pki: Pki, alpn: list[str] | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 28, row 8: before, such a client was served HTTP/2 anyway. Now the
    connection is closed before a byte of HTTP/2 (not even our SETTINGS), with one
    warning; a client that offers h2 is served on the same server right after."""
    async with serving(pki.server()) as info:
        selected, received = await in_thread(_tls_first_bytes, info.address, pki.ca, alpn)
        assert selected is None and received == b""
        selected, received = await in_thread(
            _tls_first_bytes, info.address, pki.ca, ["http/1.1", "h2"]
        )
        assert selected == "h2" and received[3] == 0x4  # our SETTINGS frame first
        assert await _a_session(info.address, tls=pki.ca) == 2
    assert any("did not negotiate h2" in r.getMessage() for r in caplog.records)
