"""``deploy/kubernetes/``: the manifests agree with themselves and with the server.

No cluster here (none can be fetched offline): the manifests are parsed and checked --
probe ports equal the container port and the ``--address`` port, ports are numeric,
the command line is one ``rlmesh-trio serve`` accepts -- and the container's exact
arguments are run locally (address rewritten to loopback) to check that the probes'
health service answers without the token while everything else requires it, and that
``Fleet.from_addresses`` drives the endpoint.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rlmesh
import rlmesh.numpy
import test_tls
from support.refserver import ROOT, TESTS_DIR, _read_addresses

from rlmesh_trio._address import TcpAddress, parse_address
from rlmesh_trio._cli import build_parser
from rlmesh_trio._cli._serve import _resolve_address
from rlmesh_trio._options import stop_bound
from rlmesh_trio._wire import SERVICE_NAME
from rlmesh_trio.client import probe
from rlmesh_trio.fleet import Fleet

yaml = pytest.importorskip("yaml")

pki = test_tls.pki  # the fixture: a throwaway CA and certificates (trustme)

pytestmark = [pytest.mark.timeout(120)]

DEPLOY = ROOT / "deploy" / "kubernetes"


def _manifests() -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[f"{doc['kind']}/{doc.get('metadata', {}).get('name', path.stem)}"] = doc
    return docs


DOCS = _manifests()


def _container() -> dict[str, Any]:
    (container,) = DOCS["StatefulSet/rlmesh-envs"]["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def _container_port() -> int:
    (port,) = _container()["ports"]
    assert isinstance(port["containerPort"], int)
    return port["containerPort"]  # type: ignore[no-any-return]


def test_kustomization_lists_every_manifest() -> None:
    listed = set(DOCS["Kustomization/kustomization"]["resources"])
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_headless_service_selects_the_statefulset_pods_on_the_container_port() -> None:
    service = DOCS["Service/rlmesh-envs"]
    statefulset = DOCS["StatefulSet/rlmesh-envs"]
    assert service["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == port["port"] == _container_port()
    assert DOCS["PodDisruptionBudget/rlmesh-envs"]["spec"]["selector"]["matchLabels"].items() <= (
        labels.items()
    )
    policy = DOCS["NetworkPolicy/rlmesh-envs"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert [p["port"] for rule in policy["ingress"] for p in rule["ports"]] == [_container_port()]


def test_probes_are_native_grpc_on_the_numeric_container_port() -> None:
    container = _container()
    port = _container_port()
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe_spec = container[kind]
        assert set(probe_spec) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, kind
        assert probe_spec["grpc"]["port"] == port, kind
        assert isinstance(probe_spec["grpc"]["port"], int), kind  # gRPC probes: no names
    assert container["livenessProbe"]["grpc"]["service"] == SERVICE_NAME
    assert "service" not in container["readinessProbe"]["grpc"]  # "": the server
    assert container["livenessProbe"]["timeoutSeconds"] >= 1


def _bound_address(argv: list[str], env: dict[str, str], monkeypatch: Any) -> Any:
    """The address ``rlmesh-trio serve argv`` binds with ``env`` set (only that env)."""
    for name in ("RLMESH_ADDRESS", "RLMESH_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    address, _ = _resolve_address(build_parser().parse_args(argv))
    return parse_address(address)


def _plain_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_container_runs_a_serve_command_line_the_parser_accepts(monkeypatch: Any) -> None:
    container = _container()
    assert container["command"] == ["rlmesh-trio"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve"
    assert args.address is None  # rlmesh's bind contract: RLMESH_ADDRESS says where
    address = _bound_address(container["args"], _plain_env(container), monkeypatch)
    assert isinstance(address, TcpAddress)
    assert address.host == "0.0.0.0"  # the kubelet probes the pod IP
    assert address.port == _container_port()
    requests = container["resources"]["requests"]
    assert requests.get("cpu") and requests.get("memory")
    grace = DOCS["StatefulSet/rlmesh-envs"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    drain = args.drain_timeout_seconds or 5.0
    close = args.close_timeout_seconds or 5.0
    assert grace > stop_bound(drain, close)  # SIGTERM drains before the SIGKILL
    (token_env,) = [e for e in container["env"] if e["name"] == "RLMESH_TRIO_AUTH_TOKEN"]
    assert token_env["valueFrom"]["secretKeyRef"]["optional"] is True


def test_dockerfile_default_command_binds_by_rlmeshs_contract(monkeypatch: Any) -> None:
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    (cmd,) = [line for line in lines if line.startswith("CMD ")]
    env = dict(
        word.split("=", 1) for line in lines if line.startswith("ENV ") for word in line[4:].split()
    )
    import json

    argv = json.loads(cmd[4:])
    assert build_parser().parse_args(argv).address is None
    assert env["RLMESH_ADDRESS"] == "0.0.0.0:50051"
    assert _bound_address(argv, env, monkeypatch) == TcpAddress("0.0.0.0", _container_port())
    # and an --address appended to the image's command wins over the image's ENV
    assert _bound_address([*argv, "--address", "127.0.0.1:7"], env, monkeypatch) == TcpAddress(
        "127.0.0.1", 7
    )


def _local_args(
    token: str | None,
    ready_fd: int,
    container: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The container's exact arguments, bound to loopback port 0 instead (and the
    mounted ``files`` replaced by local ones)."""
    container = container or _container()
    args = [(files or {}).get(a, a) for a in container["args"]]
    env = dict(os.environ)
    env.update(_plain_env(container))
    assert "--address" not in args and env["RLMESH_ADDRESS"] == "0.0.0.0:50051"
    env["RLMESH_ADDRESS"] = "127.0.0.1:0"  # the pod's address, on loopback
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH")) if p)
    env.pop("RLMESH_TRIO_AUTH_TOKEN", None)
    if token is not None:  # what the optional Secret puts there
        env["RLMESH_TRIO_AUTH_TOKEN"] = token
    return [*args, "--ready-fd", str(ready_fd)], env


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Any]:
    """Start the container's command locally; yields ``start(token) -> address``
    (``container=`` another container spec, ``files=`` mounted paths to replace); the
    i-th pod's output is in ``pod-<i>.log`` under ``tmp_path``."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        token: str | None,
        container: dict[str, Any] | None = None,
        files: dict[str, str] | None = None,
        pod_env: dict[str, str] | None = None,
    ) -> str:
        read_fd, write_fd = os.pipe()
        args, env = _local_args(token, write_fd, container, files)
        if pod_env:  # what the kubelet adds (the downward API), $(VAR) expanded in args
            env.update(pod_env)
            args = [_kubelet_expand(a, env) for a in args]
        log_path = tmp_path / f"pod-{len(procs)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rlmesh_trio", *args],
                pass_fds=(write_fd,),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        procs.append(proc)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as ready:
            try:
                return _read_addresses(ready, proc, 60.0, 1)[0]
            except Exception:
                text = log_path.read_text(errors="replace")
                raise RuntimeError(f"{shlex.join(args)} did not start: {text}") from None

    start.procs = procs  # type: ignore[attr-defined]  (the pods started, in order)
    try:
        yield start
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_pod_command_health_without_token_everything_else_with_it(pod: Any) -> None:
    token = "k8s-secret-token-for-tests"
    address = pod(token)
    anonymous = probe(address, timeout_seconds=5.0)
    assert anonymous.health == "SERVING"  # what the kubelet's probe sees: no token needed
    assert not anonymous.serving
    assert "UNAUTHENTICATED" in (anonymous.error or "")
    with Fleet.from_addresses([address], auth_token=token) as fleet:
        (health,) = fleet.health()
        assert health.serving and health.num_envs == 8


def test_pod_command_without_the_secret_is_driven_by_fleet_from_addresses(pod: Any) -> None:
    address = pod(None)
    model = rlmesh.numpy.Model(lambda obs: (np.asarray(obs)[..., 2] > 0).astype(np.int64))
    with Fleet.from_addresses([address]) as fleet:
        fleet.wait_ready(30)
        result = fleet.run(model, seeds=list(range(10)))
    assert [e.seed for e in result.episodes] == list(range(10))
    assert result.discarded == 6  # 10 seeds on 8 lanes: the second round filled up


# ---------------------------------------------------------------------------- TLS overlays

OVERLAYS = {"tls": ROOT / "deploy" / "kubernetes-tls", "mtls": ROOT / "deploy" / "kubernetes-mtls"}
MOUNT = "/etc/rlmesh-trio/tls"


def _patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 ``add`` / ``replace`` (all the overlays use), applied to a copy."""
    import copy

    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")
        ]
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        assert op["op"] in ("add", "replace"), op
        if isinstance(node, list):
            if last == "-":
                node.append(op["value"])
            elif op["op"] == "add":
                node.insert(int(last), op["value"])
            else:
                node[int(last)] = op["value"]
        else:
            assert op["op"] == "add" or last in node, op  # replace needs the member
            node[last] = op["value"]
    return doc


def _overlay(name: str) -> dict[str, Any]:
    """The StatefulSet an overlay renders: its bases' with every patch applied in order."""
    return _render(OVERLAYS[name])


def _render(root: Path) -> dict[str, Any]:
    kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
    (base,) = kustomization["resources"]
    base_dir = (root / base).resolve()
    if base_dir == DEPLOY.resolve():
        statefulset = DOCS["StatefulSet/rlmesh-envs"]
    else:
        statefulset = _render(base_dir)
    for patch in kustomization["patches"]:
        assert patch["target"] == {"kind": "StatefulSet", "name": "rlmesh-envs"}
        statefulset = _patch(statefulset, yaml.safe_load((root / patch["path"]).read_text()))
    return statefulset  # type: ignore[no-any-return]


def _overlay_container(name: str) -> dict[str, Any]:
    (container,) = _overlay(name)["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_kubectl_renders_the_overlay_as_the_test_does(name: str) -> None:
    import shutil

    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl here to render the kustomization")
    out = subprocess.run(
        ["kubectl", "kustomize", str(OVERLAYS[name])],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    rendered = {d["kind"]: d for d in yaml.safe_load_all(out) if d}
    assert rendered["StatefulSet"]["spec"] == _overlay(name)["spec"]
    assert {"Service", "PodDisruptionBudget", "NetworkPolicy"} <= rendered.keys()
    assert "Secret" not in rendered  # the Secret is the operator's (secret.example.yaml)


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_overlay_serves_tls_from_the_mounted_secret_and_probes_with_exec(name: str) -> None:
    spec = _overlay(name)["spec"]["template"]["spec"]
    container = _overlay_container(name)
    ((volume,),) = [spec["volumes"]]
    assert volume["secret"]["secretName"] == "rlmesh-envs-tls"
    assert volume["secret"]["defaultMode"] & 0o007 == 0  # the key: not world-readable
    (mount,) = container["volumeMounts"]
    assert mount == {"name": volume["name"], "mountPath": MOUNT, "readOnly": True}
    assert spec["securityContext"]["fsGroup"] == 65534  # the Dockerfile's USER
    args = build_parser().parse_args(container["args"])
    assert args.tls_cert_file == f"{MOUNT}/tls.crt" and args.tls_key_file == f"{MOUNT}/tls.key"
    assert args.tls_client_ca_file == (f"{MOUNT}/ca.crt" if name == "mtls" else None)
    example = yaml.safe_load((OVERLAYS["tls"] / "secret.example.yaml").read_text())
    keys = {"tls.crt", "tls.key", "ca.crt"}
    assert example["metadata"]["name"] == "rlmesh-envs-tls" and set(example["stringData"]) == keys
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe_spec = container[kind]
        assert set(probe_spec) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"exec"}, kind
        command = probe_spec["exec"]["command"]
        assert command[:2] == ["rlmesh-trio", "probe"], kind
        probe_args = build_parser().parse_args(command[1:])
        target = parse_address(probe_args.address)
        assert isinstance(target, TcpAddress) and target.host == "localhost"
        assert target.port == _container_port()
        assert probe_args.tls_ca_file == f"{MOUNT}/ca.crt"
        if name == "mtls":
            assert probe_args.tls_cert_file == f"{MOUNT}/probe.crt"
            assert probe_args.tls_key_file == f"{MOUNT}/probe.key"
        else:
            assert probe_args.tls_cert_file is None
        # The probe's own calls (3 steps x --timeout) fit in the kubelet's timeout.
        assert probe_spec["timeoutSeconds"] >= 3 * probe_args.timeout_seconds, kind


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_overlay_command_lines_run_locally(name: str, tmp_path: Path, pki: Any, pod: Any) -> None:
    """The overlay's server arguments and exec probe commands, run here with the test
    CA's files in place of the Secret's: the probes pass, and under mTLS a probe without
    the client certificate fails."""
    files = {
        f"{MOUNT}/tls.crt": pki.cert,
        f"{MOUNT}/tls.key": pki.key,
        f"{MOUNT}/ca.crt": pki.ca,
        f"{MOUNT}/probe.crt": pki.client_cert,
        f"{MOUNT}/probe.key": pki.client_key,
    }
    container = _overlay_container(name)
    address = pod(None, container=container, files=files)
    port = parse_address(address).port  # type: ignore[union-attr]
    said = (tmp_path / "pod-0.log").read_text()  # the status line precedes the ready fd
    assert ("(mTLS)" if name == "mtls" else "(TLS)") in said, said
    env = _local_args(None, 0)[1]

    def run(command: list[str]) -> subprocess.CompletedProcess[bytes]:
        local = [files.get(a, a).replace(":50051", f":{port}") for a in command[1:]]
        return subprocess.run(
            [sys.executable, "-m", "rlmesh_trio", *local],
            capture_output=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )

    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        done = run(container[kind]["exec"]["command"])
        assert done.returncode == 0, (kind, done.stdout, done.stderr)
        assert b"SERVING" in done.stdout and b"CartPole-v1" in done.stdout
        assert b"deprecated" not in done.stderr, (kind, done.stderr)
    plaintext = run(["rlmesh-trio", "probe", f"localhost:{port}", "--timeout-seconds", "3"])
    assert plaintext.returncode == 1 and b"TLS" in plaintext.stdout
    if name == "mtls":
        command = container["readinessProbe"]["exec"]["command"]
        refused = run([*command[: command.index("--tls-cert-file")], "--timeout-seconds", "3"])
        assert refused.returncode == 1 and b"certificate" in refused.stdout


def test_dockerfile_health_check_is_a_probe_of_the_serve_port() -> None:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if line.startswith("HEALTHCHECK ")]
    import json

    command = json.loads(line[line.index("CMD ") + 4 :])
    assert command[:2] == ["rlmesh-trio", "probe"]
    args = build_parser().parse_args(command[1:])
    assert parse_address(args.address) == TcpAddress("127.0.0.1", _container_port())


# ---------------------------------------------------------------------------- recording


RECORD_OVERLAY = ROOT / "deploy" / "kubernetes-record"


def _kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """``$(VAR)`` in a container's args, as the kubelet expands it from the env."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def test_record_overlay_pods_continue_their_own_dataset_across_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pod: Any
) -> None:
    """The kubernetes-record overlay's command, run as the kubelet runs it ($(POD_NAME)
    expanded from the pod's env, Minari's root on the pod's volume), twice: the restarted
    pod continues its own dataset; the grace period covers the writer's last batch."""
    minari = pytest.importorskip("minari")
    spec = _render(RECORD_OVERLAY)["spec"]
    pod_spec = spec["template"]["spec"]
    (container,) = pod_spec["containers"]
    assert pod_spec["terminationGracePeriodSeconds"] >= stop_bound(5.0, 5.0) + 120
    (claim,) = spec["volumeClaimTemplates"]
    (mount,) = container["volumeMounts"]
    assert mount["name"] == claim["metadata"]["name"]
    env_names = {e["name"]: e for e in container["env"]}
    assert env_names["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    minari_root = env_names["MINARI_DATASETS_PATH"]["value"]
    assert minari_root.startswith(mount["mountPath"] + "/")  # on the pod's own volume
    assert pod_spec["securityContext"]["fsGroup"] == 65534  # the image's user writes it

    volume = tmp_path / "volume"
    pod_env = {
        "POD_NAME": "rlmesh-envs-2",
        "MINARI_DATASETS_PATH": str(volume / minari_root[len(mount["mountPath"]) + 1 :]),
    }
    model = rlmesh.numpy.Model(lambda obs: (np.asarray(obs)[..., 2] > 0).astype(np.int64))
    for seeds in (range(0, 10), range(50, 60)):  # the pod, then the pod restarted
        address = pod(None, container=container, pod_env=pod_env)
        rlmesh.run(model, address, seeds=list(seeds))
        proc = pod.procs[-1]
        proc.terminate()  # the kubelet's SIGTERM
        assert proc.wait(60) == 0
    monkeypatch.setenv("MINARI_DATASETS_PATH", pod_env["MINARI_DATASETS_PATH"])
    dataset = minari.load_dataset("rlmesh/envs-rlmesh-envs-2-v0")
    recorded = dataset.storage.get_episode_metadata(range(dataset.total_episodes))
    seeds_recorded = {m.get("seed") for m in recorded}
    said = dataset.storage.metadata["rlmesh_trio"]
    assert {*range(10), *range(50, 60)} <= seeds_recorded
    assert said["runs"] == 2 and said["complete"] is True
