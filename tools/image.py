"""Build every Dockerfile under ``deploy/`` with buildah, run each image's own command in a
network namespace of its own, and drive it as users do. Run by ``nox -s image``; Linux,
as root. The build half is stdlib only; the drive half runs with the Python that runs
this file, which needs rlmesh-trio, rlmesh 0.1.0, gymnasium and trustme (the session's).

1. **Tools**: buildah, debootstrap and iproute2 from Debian (``apt-get``) where missing.
2. **The base image** the Dockerfiles name (``FROM python:3.11-slim``): a *stand-in*
   made from Debian bookworm's packages (``debootstrap --variant=minbase`` with
   python3, python3-venv, python3-pip and ca-certificates; ``EXTERNALLY-MANAGED``
   removed, ``python`` linked to ``python3``; bookworm's Python is 3.11), committed under
   that name in a buildah storage of this tool's own (``--root``, default
   ``/var/tmp/rlmesh-trio-image``): never in your buildah, podman or docker storage, and
   never pushed anywhere. Built once per machine and reused while its label names the
   same recipe (``--rebuild-base`` builds it anew).
3. **Each Dockerfile built unchanged**: ``buildah bud --pull=never --isolation chroot
   --format docker`` (the docker format keeps ``HEALTHCHECK``), from the repository root
   as the README's ``docker build`` does; the host's CA bundle is mounted for pip in the
   ``RUN`` steps (this machine reaches PyPI through a proxy with its own CA).
4. **Each image run and driven**, in a new network namespace (``unshare --net``: loopback
   only): from a working container, the image's ``ENTRYPOINT`` + ``CMD`` under its own
   ``USER`` and ``ENV``, with ``RLMESH_ADDRESS`` set to ``127.0.0.1:<its port>``
   (rlmesh's bind contract, as a platform sets it). Checked: the image's ``HEALTHCHECK``
   command, run inside the container, passes (polled while the server starts); the
   server runs as the image's non-root user; rlmesh 0.1.0's ``rlmesh.run`` and
   rlmesh-trio's ``VectorEnv`` get exactly what local gymnasium envs of the same id give
   for the same seeds and actions; SIGTERM stops it within its stop bound, exit 0. Then
   the same image again with ``--tls-cert-file``/``--tls-key-file`` from a throwaway CA
   (trustme), mounted read-only: the health check with ``--tls-ca-file``, ``VectorEnv``
   over TLS (rlmesh 0.1.0's client has no TLS), plaintext refused.
   Where a Dockerfile takes ``ARG RLMESH_TRIO_EXTRAS``, it is built once more with
   ``metrics,record`` and that image also records: its command with ``--record-dataset
   --record-append``, driven, stopped, started again in the same container and driven
   again; the image's own Minari then loads the dataset: both runs' episodes, complete.
5. **The image's size**, reported.

Usage: ``python tools/image.py [--root DIR] [--rebuild-base] [--dockerfile PATH ...]``.
Not root (or not Linux): skipped with a message, unless ``CI`` is set, where that is a
failure -- CI must build the images.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sid_pythons import Failed, host_mirror, locked, remove_tree

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DEFAULT_STORE = Path("/var/tmp/rlmesh-trio-image")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")

STAND_IN = {
    "docker.io/library/python:3.11-slim": {
        "suite": "bookworm",
        "packages": ["ca-certificates", "python3", "python3-pip", "python3-venv"],
    }
}
"""The base images this tool can stand in for: Debian's packages of the same Python."""
STAND_IN_LABEL = "org.rlmesh-trio.stand-in"
"""The label that marks a stand-in (its value: the recipe, as JSON)."""

TLS_DIR = "/run/rlmesh-trio-tls"
"""Where the throwaway TLS files are mounted in the container (read-only)."""
SEEDS = list(range(12))
VECTOR_STEPS = 300


def log(message: str) -> None:
    print(f"image: {message}", flush=True)


def run(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    quiet: bool = False,
    capture: bool = False,
) -> str:
    """Run ``argv``: its output passes through, or is returned with ``capture``;
    :class:`Failed` on a non-zero exit."""
    if not quiet:
        log(f"$ {shlex.join(argv)}")
    stdout = subprocess.PIPE if capture else None
    done = subprocess.run(list(argv), env=env, check=False, stdout=stdout, text=True)
    if done.returncode != 0:
        raise Failed(f"exit {done.returncode}: {shlex.join(argv)}\n{(done.stdout or '')[-4000:]}")
    return done.stdout or ""


@dataclass(frozen=True)
class Buildah:
    """buildah on a storage of this tool's own (vfs: no overlay mounts needed)."""

    store: Path

    def argv(self, *args: str) -> list[str]:
        return [
            "buildah",
            "--root",
            str(self.store / "storage"),
            "--runroot",
            str(self.store / "run"),
            "--storage-driver",
            "vfs",
            *args,
        ]

    def __call__(self, *args: str, quiet: bool = False) -> str:
        return run(self.argv(*args), quiet=quiet, capture=quiet)

    def inspect(self, image: str) -> dict[str, Any] | None:
        done = subprocess.run(
            self.argv("inspect", "--type", "image", image), capture_output=True, text=True
        )
        return json.loads(done.stdout) if done.returncode == 0 else None


# -- 1. tools -------------------------------------------------------------------------------


def unable_here() -> str | None:
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if os.geteuid() != 0:
        return "needs root (buildah's chroot isolation, network namespaces)"
    return None


def ensure_tools() -> None:
    wanted = {"buildah": "buildah", "debootstrap": "debootstrap", "ip": "iproute2"}
    missing = sorted({package for tool, package in wanted.items() if not shutil.which(tool)})
    if shutil.which("unshare") is None:
        raise Failed("no unshare (util-linux) on PATH")
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise Failed(f"missing {missing}, and no apt-get to install them with")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]
    try:
        run(install, env=env)
    except Failed:
        run(["apt-get", "update", "-qq"], env=env)
        run(install, env=env)


# -- 2. the stand-in base ---------------------------------------------------------------------


def base_images(dockerfile: Path) -> list[str]:
    """The images a Dockerfile's FROM lines name (not its own stages), fully qualified."""
    stages: set[str] = set()
    bases: list[str] = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if not words or words[0].upper() != "FROM":
            continue
        words = [w for w in words[1:] if not w.startswith("--")]
        image = words[0]
        if len(words) >= 3 and words[1].upper() == "AS":
            stages.add(words[2])
        if image in stages:
            continue
        name = image if "/" in image else f"library/{image}"
        first = name.split("/", 1)[0]
        if "." not in first and ":" not in first and first != "localhost":
            name = f"docker.io/{name}"
        if name not in bases:
            bases.append(name)
    return bases


def ensure_base(buildah: Buildah, image: str, *, rebuild: bool) -> str:
    """``image`` in the tool's storage: already there (a real one, or a stand-in of the
    same recipe), or a stand-in built now; how it was had."""
    found = buildah.inspect(image)
    labels = ((found or {}).get("OCIv1", {}).get("config", {}) or {}).get("Labels") or {}
    recipe = STAND_IN.get(image)
    if found is not None and STAND_IN_LABEL not in labels:
        return "a real image, found in the tool's storage"
    if recipe is None:
        raise Failed(
            f"{image} is not in {buildah.store} and this tool has no stand-in for it: "
            f"pull it there (buildah --root {buildah.store / 'storage'} pull {image})"
        )
    stamp = json.dumps(recipe, sort_keys=True)
    if found is not None and labels.get(STAND_IN_LABEL) == stamp and not rebuild:
        return "the stand-in, reused"
    rootfs = buildah.store / "stand-in-rootfs"
    remove_tree(rootfs)
    packages = ",".join(recipe["packages"])
    run(["debootstrap", "--variant=minbase", f"--include={packages}", str(recipe["suite"]),
         str(rootfs), host_mirror()])  # fmt: skip
    for managed in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        managed.unlink()
    (rootfs / "usr/bin/python").unlink(missing_ok=True)
    (rootfs / "usr/bin/python").symlink_to("python3")
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for path in (rootfs / cache).glob("*"):
            if path.is_file():
                path.unlink()
    container = buildah("from", "scratch", quiet=True).strip()
    try:
        mount = Path(buildah("mount", container, quiet=True).strip())
        run(["cp", "-a", f"{rootfs}/.", f"{mount}/"], quiet=True)
        buildah("umount", container, quiet=True)
        buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env", "LANG=C.UTF-8", "--cmd", "python3",
                "--label", f"{STAND_IN_LABEL}={stamp}", container)  # fmt: skip
        buildah("commit", "--quiet", container, image)
    finally:
        buildah("rm", container, quiet=True)
        remove_tree(rootfs)
    return "the stand-in, built from Debian's packages"


# -- 3. the build -----------------------------------------------------------------------------


def tag_of(dockerfile: Path) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", str(dockerfile.relative_to(DEPLOY)).lower()).strip("-")
    return f"localhost/rlmesh-trio-check/{slug}:ci"


RECORD_VARIANT = ("record", ["--build-arg", "RLMESH_TRIO_EXTRAS=metrics,record"])
"""The Dockerfile built once more with the record extra, where it takes the build
argument (deploy/kubernetes-record runs that image)."""


def variants(dockerfile: Path) -> list[tuple[str, list[str]]]:
    """(name, build arguments) of each image built from ``dockerfile``: as it is, and
    with the record extra where it declares ``ARG RLMESH_TRIO_EXTRAS``."""
    found: list[tuple[str, list[str]]] = [("", [])]
    if re.search(r"^ARG\s+RLMESH_TRIO_EXTRAS\b", dockerfile.read_text(), flags=re.M):
        found.append(RECORD_VARIANT)
    return found


def build(buildah: Buildah, dockerfile: Path, variant: str, build_args: list[str]) -> str:
    pip_conf = buildah.store / "pip.conf"
    pip_conf.write_text(f"[global]\ncert = {CA_BUNDLE}\n")
    tag = tag_of(dockerfile)
    if variant:
        tag = tag.replace(":ci", f"-{variant}:ci")
    buildah("bud", "--pull=never", "--isolation", "chroot", "--format", "docker", *build_args,
            "-v", f"{CA_BUNDLE.parent}:{CA_BUNDLE.parent}:ro", "-v", f"{pip_conf}:/etc/pip.conf:ro",
            "-f", str(dockerfile), "-t", tag, str(ROOT))  # fmt: skip
    return tag


def image_size(buildah: Buildah, tag: str) -> str:
    return buildah("images", "--format", "{{.Size}}", tag, quiet=True).strip()


# -- 4. run and drive (inside a network namespace of its own) ----------------------------------


@dataclass
class Image:
    tag: str
    entrypoint: list[str]
    cmd: list[str]
    user: str
    env: dict[str, str]
    healthcheck: list[str]
    start_seconds: float

    @classmethod
    def of(cls, buildah: Buildah, tag: str) -> Image:
        found = buildah.inspect(tag)
        if found is None:
            raise Failed(f"no image {tag}")
        config = found["Docker"]["config"]
        check = config.get("Healthcheck") or {}
        test = list(check.get("Test") or [])
        if test[:1] != ["CMD"]:
            raise Failed(f"{tag}: HEALTHCHECK is not an exec-form CMD: {test}")
        nanos = 1e-9
        start = check.get("StartPeriod", 0) + check.get("Interval", 0) * check.get("Retries", 3)
        return cls(
            tag=tag,
            entrypoint=list(config.get("Entrypoint") or []),
            cmd=list(config.get("Cmd") or []),
            user=config.get("User") or "",
            env=dict(e.split("=", 1) for e in config.get("Env") or []),
            healthcheck=test[1:],
            start_seconds=max(start * nanos, 60.0),
        )

    def port(self) -> int:
        listen = self.env.get("RLMESH_ADDRESS", "")
        match = re.fullmatch(r"(?:tcp://)?[^:]*:(\d+)", listen)
        if match is None:
            raise Failed(f"{self.tag}: ENV RLMESH_ADDRESS={listen!r} names no TCP port")
        return int(match.group(1))

    def uid(self) -> int:
        user = self.user.split(":", 1)[0]
        if not user.isdigit():
            raise Failed(f"{self.tag}: USER {self.user!r} is not numeric (checked as a uid)")
        if int(user) == 0:
            raise Failed(f"{self.tag}: USER {self.user!r} is root")
        return int(user)


def children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent:
                found.append(child)
                frontier.append(child)
    return found


def server_process(launcher: int) -> int | None:
    """The server's own process under ``buildah run`` (the image's ENTRYPOINT: not
    buildah's chroot helper)."""
    for pid in children_of(launcher):
        with contextlib.suppress(OSError):
            exe = os.readlink(f"/proc/{pid}/exe")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if "buildah" not in os.path.basename(exe) and any(w == b"serve" for w in cmdline):
                return pid
    return None


def uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise Failed(f"no Uid line for pid {pid}")


class Container:
    """A working container of an image, removed on exit."""

    def __init__(self, buildah: Buildah, image: Image) -> None:
        self.buildah = buildah
        self.image = image
        self.name = "rlmesh-trio-check-" + re.sub(r"[^a-z0-9]+", "-", image.tag).strip("-")

    def __enter__(self) -> Container:
        subprocess.run(self.buildah.argv("rm", self.name), capture_output=True)
        self.buildah("from", "--pull=never", "--name", self.name, self.image.tag, quiet=True)
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(self.buildah.argv("rm", self.name), capture_output=True)

    def argv(self, command: Sequence[str], env: dict[str, str], mounts: Sequence[str]) -> list[str]:
        extra: list[str] = []
        for key, value in env.items():
            extra += ["--env", f"{key}={value}"]
        for mount in mounts:
            extra += ["-v", mount]
        return self.buildah.argv("run", "--isolation", "chroot", *extra, self.name, "--", *command)


@contextlib.contextmanager
def serving(
    container: Container,
    extra_args: Sequence[str],
    mounts: Sequence[str],
    log_path: Path,
    more_env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    image = container.image
    env = {"RLMESH_ADDRESS": f"127.0.0.1:{image.port()}", **(more_env or {})}
    command = [*image.entrypoint, *image.cmd, *extra_args]
    log(f"serving: RLMESH_ADDRESS={env['RLMESH_ADDRESS']} {shlex.join(command)}")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            container.argv(command, env, mounts), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            for pid in [*children_of(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()


def wait_healthy(
    container: Container, health: list[str], mounts: Sequence[str], proc: subprocess.Popen[bytes]
) -> float:
    """Run the health-check command inside the container until it passes; seconds taken."""
    started = time.monotonic()
    deadline = started + container.image.start_seconds
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Failed(f"the server exited ({proc.returncode}) before it was healthy")
        done = subprocess.run(
            container.argv(health, {}, mounts), capture_output=True, text=True, timeout=60
        )
        if done.returncode == 0:
            return time.monotonic() - started
        last = (done.stdout + done.stderr).strip()[-600:]
        time.sleep(1.0)
    raise Failed(f"the health check never passed in {container.image.start_seconds:.0f} s: {last}")


def policy_for(space: Any) -> Any:
    """A deterministic policy of one observation for ``space`` (gymnasium's ``Discrete``
    or ``Box``): the same actions locally and remotely, as ``rlmesh.run`` calls it."""
    import gymnasium as gym
    import numpy as np

    def act(obs: Any) -> Any:
        score = float(np.sin(np.asarray(obs).astype(np.float64).sum() * 7.0))
        if isinstance(space, gym.spaces.Discrete):
            n = int(space.n)
            return np.int64(space.start + min(int((score + 1.0) / 2.0 * n), n - 1))
        if isinstance(space, gym.spaces.Box):
            middle = (np.nan_to_num(space.low, nan=0.0) + np.nan_to_num(space.high, nan=0.0)) / 2
            return middle.astype(space.dtype)
        raise Failed(f"no policy here for action space {space}")

    return act


def local_episodes(env_id: str, policy: Any, seeds: Sequence[int]) -> list[tuple[int, int, float]]:
    """(seed, steps, return) of one local episode per seed, as ``rlmesh.run`` plays it."""
    import gymnasium as gym

    env = gym.make(env_id)
    try:
        episodes = []
        for seed in seeds:
            obs, _ = env.reset(seed=seed)
            steps, total, done = 0, 0.0, False
            while not done:
                action = policy(obs)
                obs, reward, terminated, truncated, _ = env.step(action)
                steps, total, done = steps + 1, total + float(reward), terminated or truncated
            episodes.append((seed, steps, total))
        return episodes
    finally:
        env.close()


def drive_rlmesh(address: str, env_id: str, policy: Any) -> str:
    import rlmesh
    import rlmesh.numpy

    result = rlmesh.run(rlmesh.numpy.Model(policy), address, seeds=SEEDS)
    remote = sorted((e.seed, e.steps, float(e.reward)) for e in result.episodes)
    local = local_episodes(env_id, policy, SEEDS)
    if remote != local:
        raise Failed(f"rlmesh.run over the image: {remote}\nlocal {env_id}: {local}")
    return f"rlmesh.run: {len(remote)} episodes, as local"


def drive_vector(address: str, env_id: str, num_envs: int, policy: Any, tls: Any) -> str:
    import gymnasium as gym
    import numpy as np

    from rlmesh_trio.client import VectorEnv

    remote = VectorEnv(address, tls=tls)
    local = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(num_envs)])
    try:
        got, want = remote.reset(seed=0)[0], local.reset(seed=0)[0]
        for step in range(VECTOR_STEPS):
            if not np.array_equal(got, want):
                raise Failed(f"VectorEnv over the image: observations differ at step {step}")
            action = np.stack([policy(o) for o in got])
            got_step, want_step = remote.step(action), local.step(action)
            for name, a, b in zip(
                ("obs", "reward", "terminated", "truncated"),
                got_step[:4],
                want_step[:4],
                strict=True,
            ):
                if not np.array_equal(a, b):
                    raise Failed(f"VectorEnv over the image: {name} differs at step {step}")
            got, want = got_step[0], want_step[0]
    finally:
        remote.close()
        local.close()
    return f"VectorEnv: {VECTOR_STEPS} steps x {num_envs} lanes, as SyncVectorEnv"


def stop(proc: subprocess.Popen[bytes], server: int, bound: float) -> float:
    """SIGTERM to the server's process (as ``docker stop`` signals PID 1); seconds until
    it is gone. Fails past ``bound`` or on a non-zero exit."""
    started = time.monotonic()
    os.kill(server, signal.SIGTERM)
    try:
        code = proc.wait(timeout=bound + 10.0)  # buildah's own exit after the server's
    except subprocess.TimeoutExpired:
        raise Failed(f"SIGTERM: still running after {bound + 10.0:.0f} s") from None
    took = time.monotonic() - started
    if took > bound + 2.0:
        raise Failed(f"SIGTERM: stopped after {took:.1f} s, the stop bound is {bound:.1f} s")
    if code != 0:
        raise Failed(f"SIGTERM: exit {code}")
    return took


def stop_bound_of(image: Image) -> float:
    from rlmesh_trio._cli import build_parser
    from rlmesh_trio._options import stop_bound

    args = build_parser().parse_args(image.cmd)
    return stop_bound(args.drain_timeout_seconds or 5.0, args.close_timeout_seconds or 5.0)


def one_run(
    buildah: Buildah, image: Image, work: Path, *, tls: bool
) -> list[str]:  # pragma: no cover - run in CI's image session
    from rlmesh_trio.client import probe

    findings: list[str] = []
    port = image.port()
    mounts: list[str] = []
    extra: list[str] = []
    health = list(image.healthcheck)
    client_tls: Any = None
    host = "127.0.0.1"
    if tls:
        import trustme

        ca = trustme.CA()
        cert = ca.issue_cert("localhost", "127.0.0.1")
        pki = work / "tls"
        pki.mkdir(mode=0o755)
        ca.cert_pem.write_to_path(str(pki / "ca.pem"))
        cert.private_key_and_cert_chain_pem.write_to_path(str(pki / "server.pem"))
        cert.private_key_pem.write_to_path(str(pki / "server.key"))
        for path in pki.iterdir():
            path.chmod(0o644)  # the image's non-root user reads them (a throwaway key)
        mounts.append(f"{pki}:{TLS_DIR}:ro")
        extra = ["--tls-cert-file", f"{TLS_DIR}/server.pem", "--tls-key-file", f"{TLS_DIR}/server.key"]  # fmt: skip
        # the Dockerfile's advice under TLS: dial localhost, with --tls-ca-file
        health = [w.replace("127.0.0.1:", "localhost:") for w in health]
        health += ["--tls-ca-file", f"{TLS_DIR}/ca.pem"]
        client_tls = str(pki / "ca.pem")
        host = "localhost"
    address = f"{host}:{port}"
    log_path = work / ("server-tls.log" if tls else "server.log")
    with (
        Container(buildah, image) as container,
        serving(container, extra, mounts, log_path) as proc,
    ):
        took = wait_healthy(container, health, mounts, proc)
        findings.append(f"healthy (its HEALTHCHECK, inside) after {took:.1f} s")
        server = server_process(proc.pid)
        if server is None:
            raise Failed("no server process found under buildah run")
        uid = uid_of(server)
        if uid != image.uid():
            raise Failed(f"the server runs as uid {uid}, the image's USER is {image.user}")
        findings.append(f"runs as uid {uid} (USER {image.user})")
        report = probe(address, tls=client_tls, timeout_seconds=10.0)
        if not report.serving or report.env_id is None or report.num_envs is None:
            raise Failed(f"probe {address}: {report}")
        import gymnasium as gym

        space = gym.make(report.env_id).action_space
        policy = policy_for(space)
        if tls:
            plain = probe(f"127.0.0.1:{port}", timeout_seconds=5.0)
            if plain.serving:
                raise Failed("a plaintext probe was answered by the TLS server")
            findings.append("plaintext refused")
        else:
            findings.append(drive_rlmesh(address, report.env_id, policy))
        findings.append(drive_vector(address, report.env_id, report.num_envs, policy, client_tls))
        bound = stop_bound_of(image)
        took = stop(proc, server, bound)
        findings.append(f"SIGTERM: exit 0 after {took:.1f} s (bound {bound:.0f} s)")
    text = log_path.read_text(errors="replace")
    for bad in ("Traceback", "died without stopping"):
        if bad in text:
            raise Failed(f"the server's log has {bad!r}:\n{text[-3000:]}")
    return findings


RECORD_ID = "rlmesh/image-check-v0"
RECORD_ROOT = "/tmp/rlmesh-trio-minari"


def record_runs(
    buildah: Buildah, image: Image, work: Path
) -> list[str]:  # pragma: no cover - run in CI's image session
    """The record variant: the image's command with ``--record-dataset ...
    --record-append``, driven, stopped, started again in the same container (a restart)
    and driven again; then the image's own Minari reads the dataset inside it."""
    findings: list[str] = []
    extra = ["--record-dataset", RECORD_ID, "--record-append"]
    env = {"MINARI_DATASETS_PATH": RECORD_ROOT}
    address = f"127.0.0.1:{image.port()}"
    bound = stop_bound_of(image) + 120.0  # the writer's own bound for its last batch
    with Container(buildah, image) as container:
        for restart in range(2):
            log_path = work / f"server-record-{restart}.log"
            with serving(container, extra, [], log_path, env) as proc:
                wait_healthy(container, list(image.healthcheck), [], proc)
                server = server_process(proc.pid)
                if server is None:
                    raise Failed("no server process found under buildah run")
                from rlmesh_trio.client import probe

                report = probe(address, timeout_seconds=10.0)
                if not report.serving or report.env_id is None:
                    raise Failed(f"probe {address}: {report}")
                import gymnasium as gym

                policy = policy_for(gym.make(report.env_id).action_space)
                findings.append(drive_rlmesh(address, report.env_id, policy) + " (recorded)")
                took = stop(proc, server, bound)
                findings.append(f"SIGTERM: exit 0 after {took:.1f} s, the dataset written")
            text = log_path.read_text(errors="replace")
            if "Traceback" in text or "died without stopping" in text:
                raise Failed(f"the server's log:\n{text[-3000:]}")
        script = (
            f"import json, minari; d = minari.load_dataset({RECORD_ID!r}); "
            "print(json.dumps([d.total_episodes, d.storage.metadata['rlmesh_trio']]))"
        )
        done = subprocess.run(
            container.argv(["python", "-c", script], env, []),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise Failed(f"the image's Minari could not load the dataset: {done.stderr[-2000:]}")
        total, said = json.loads(done.stdout.strip().splitlines()[-1])
        if said.get("runs") != 2 or not said.get("complete") or total < 2 * len(SEEDS):
            raise Failed(f"the dataset after two runs: {total} episodes, {said}")
        findings.append(f"the image's Minari loads {total} episodes of 2 runs, complete")
    return findings


def drive(store: Path, tag: str) -> int:  # pragma: no cover - run in CI's image session
    """The inside half: in a fresh network namespace, run and drive ``tag``."""
    run(["ip", "link", "set", "lo", "up"], quiet=True)
    buildah = Buildah(store)
    image = Image.of(buildah, tag)
    with tempfile.TemporaryDirectory(dir=store, prefix="drive-") as scratch:
        work = Path(scratch)
        work.chmod(0o755)
        try:
            for tls in (False, True):
                for finding in one_run(buildah, image, work, tls=tls):
                    log(f"{tag}{' (TLS)' if tls else ''}: {finding}")
            if f"-{RECORD_VARIANT[0]}:" in tag:
                for finding in record_runs(buildah, image, work):
                    log(f"{tag} (recording): {finding}")
        except Failed as exc:
            for path in sorted(work.glob("server*.log")):
                log(f"{path.name}:\n{path.read_text(errors='replace')[-4000:]}")
            log(f"FAILED: {exc}")
            return 1
    return 0


# -- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=DEFAULT_STORE, help="the tool's storage")
    parser.add_argument("--rebuild-base", action="store_true", help="build the stand-in anew")
    parser.add_argument(
        "--dockerfile",
        type=Path,
        action="append",
        dest="dockerfiles",
        help="a Dockerfile to check (repeatable; default: every one under deploy/)",
    )
    parser.add_argument("--drive", metavar="TAG", help=argparse.SUPPRESS)  # the inside half
    args = parser.parse_args(argv)
    store: Path = args.root.resolve()
    if args.drive:
        return drive(store, args.drive)

    why = unable_here()
    if why is not None:
        if os.environ.get("CI"):
            log(f"cannot run here: {why} (CI must build and drive the images)")
            return 1
        log(f"skipped: {why}")
        return 0
    dockerfiles = [p.resolve() for p in args.dockerfiles or sorted(DEPLOY.rglob("Dockerfile*"))]
    if not dockerfiles:
        log(f"no Dockerfile under {DEPLOY}")
        return 1
    results: list[str] = []
    try:
        with locked(store / "store"):
            store.mkdir(parents=True, exist_ok=True)
            ensure_tools()
            buildah = Buildah(store)
            for dockerfile in dockerfiles:
                name = dockerfile.relative_to(ROOT)
                for base in base_images(dockerfile):
                    log(f"{base}: {ensure_base(buildah, base, rebuild=args.rebuild_base)}")
                for variant, build_args in variants(dockerfile):
                    started = time.monotonic()
                    tag = build(buildah, dockerfile, variant, build_args)
                    built = time.monotonic() - started
                    size = image_size(buildah, tag)
                    log(f"{name}: built {tag} in {built:.0f} s, {size}")
                    inside = ["unshare", "--net", "--fork", "--", sys.executable, __file__]
                    run([*inside, "--root", str(store), "--drive", tag])
                    label = " ".join([str(name), *build_args])
                    results.append(f"{label}: built in {built:.0f} s, {size}, driven")
    except Failed as exc:
        log(f"failed: {exc}")
        return 1
    for line in results:
        log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
