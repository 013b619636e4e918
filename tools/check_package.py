"""Check what a user installs: the built sdist and wheel, the image's install steps, the
README's quick start. Run by ``nox -s package`` (it builds ``--dist`` first); stdlib only.

1. The wheel and the sdist carry the generated protobuf code and both ``py.typed``.
2. The wheel, with the ``metrics`` extra, goes into a fresh venv; ``rlmesh-trio serve``
   from it answers ``rlmesh-trio probe``, rlmesh-trio's client and a Prometheus scrape.
   Then the wheel alone, without constraints, into a venv holding a 2025 stack (numpy
   2.2.6, gymnasium 1.1.1, trio 0.30.0): none of them is replaced, and it serves.
3. deploy/kubernetes/Dockerfile, run without a container engine: each stage gets a fresh
   venv (the image's Python) and a directory standing in for its filesystem; ``WORKDIR``,
   ``COPY`` and ``RUN`` run as written (a ``RUN`` may use relative paths only, so that it
   means the same here); then the image's ``ENTRYPOINT``/``CMD`` serves (bound to
   loopback) and its ``HEALTHCHECK`` command must pass; SIGTERM must stop it with 0.
4. The README's quick start, as written: its serve commands in a copy of the repository,
   the client commands in a fresh directory of their own, the client example against
   the address the server printed. ``PIP_CONSTRAINT`` holds every ``pip install`` to the
   CI pins without changing the commands.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
import venv
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "kubernetes" / "Dockerfile"
README = ROOT / "README.md"
SERVING = re.compile(r"rlmesh-trio: serving .* on (\S+)$")
INSTALL_TIMEOUT = 900.0
"""Seconds for a step that installs from the package index."""
SERVE_TIMEOUT = 120.0
"""Seconds from a server's start (its installs done) to its address line, and to its exit."""


def log(message: str) -> None:
    print(f"check_package: {message}", flush=True)


class CheckFailed(Exception):
    pass


# -- 1. the artefacts ---------------------------------------------------------------------


def generated_files() -> list[str]:
    """The package files a user must get: the generated code and the typing markers."""
    src = ROOT / "src"
    names = [p.relative_to(src).as_posix() for p in (src / "rlmesh_trio" / "_proto").rglob("*.py")]
    return sorted([*names, "rlmesh_trio/py.typed", "rlmesh_trio/_proto/py.typed"])


def check_artefacts(dist: Path) -> tuple[Path, Path]:
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise CheckFailed(f"expected one wheel and one sdist in {dist}, got {wheels + sdists}")
    wheel, sdist = wheels[0], sdists[0]
    wanted = generated_files()
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = zf.read(entry_points).decode()
    missing = [n for n in wanted if n not in names]
    if missing:
        raise CheckFailed(f"{wheel.name} lacks {missing}")
    if "rlmesh-trio = rlmesh_trio._cli:main" not in scripts:
        raise CheckFailed(f"{wheel.name} has no rlmesh-trio script: {scripts!r}")
    with tarfile.open(sdist) as tf:
        members = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    missing = [n for n in (f"src/{w}" for w in wanted) if n not in members]
    missing += [n for n in ("pyproject.toml", "README.md") if n not in members]
    if missing:
        raise CheckFailed(f"{sdist.name} lacks {missing}")
    log(f"{wheel.name} and {sdist.name} carry {len(wanted)} generated/typing files")
    return wheel, sdist


# -- helpers ------------------------------------------------------------------------------


def fresh_venv(path: Path) -> Path:
    """A new venv with pip (the stand-in for a user's or an image's Python); its bin dir."""
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin"


def with_path(bin_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment with ``bin_dir`` first on PATH (as an activated venv has it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


DOCKER_SHELL = ("sh", "-c")
"""How ``docker build`` runs a shell-form ``RUN``."""
USER_SHELL = ("bash", "-euo", "pipefail", "-c")
"""How the README's console lines run: one shell session, stopping at the first failure."""


def run(
    cmd: Sequence[str] | str,
    *,
    cwd: Path,
    env: dict[str, str],
    timeout: float,
    shell: Sequence[str] = USER_SHELL,
) -> None:
    """Run an argv, or a shell script with ``shell``; a non-zero exit fails the check."""
    shown = cmd if isinstance(cmd, str) else shlex.join(cmd)
    log(f"({cwd.name}) $ {shown}")
    argv = [*shell, cmd] if isinstance(cmd, str) else list(cmd)
    done = subprocess.run(argv, cwd=cwd, env=env, timeout=timeout, check=False)
    if done.returncode != 0:
        raise CheckFailed(f"exit {done.returncode}: {shown}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A serving command line in its own process group; stderr is echoed and watched."""

    def __init__(self, argv: Sequence[str], *, cwd: Path, env: dict[str, str]) -> None:
        log(f"({cwd.name}) $ {shlex.join(argv)} &")
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            sys.stderr.write(f"  | {line}")
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise CheckFailed(f"server exited ({self.proc.wait()}) before {pattern.pattern!r}")
            self.seen.append(line)
            if match := pattern.search(line):
                return match
        raise CheckFailed(f"no line matching {pattern.pattern!r} within {timeout} s")

    def stop(self, sig: signal.Signals) -> int:
        """Signal the process group once; the exit status (the server must drain and exit)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(SERVE_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise CheckFailed(f"server still running {SERVE_TIMEOUT} s after {sig.name}") from None


@contextmanager
def serving(argv: Sequence[str], *, cwd: Path, env: dict[str, str]) -> Iterator[Server]:
    server = Server(argv, cwd=cwd, env=env)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


def expect_clean_stop(server: Server, sig: signal.Signals) -> None:
    status = server.stop(sig)
    if status != 0:
        raise CheckFailed(f"server exited {status} after {sig.name}, expected 0")
    log(f"server stopped with 0 after {sig.name}")


CLIENT_CHECK = """
import sys
from rlmesh_trio.client import VectorEnv
envs = VectorEnv(sys.argv[1])
obs, infos = envs.reset(seed=0)
for _ in range(20):
    obs, rewards, terminated, truncated, infos = envs.step(envs.action_space.sample())
assert obs.shape == (envs.num_envs, 4), obs.shape
envs.close()
print("client: 20 steps on", envs.num_envs, "lanes")
"""


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


# -- 2. the wheel in a fresh venv ---------------------------------------------------------


def check_wheel(wheel: Path, constraints: Path, work: Path) -> None:
    bin_dir = fresh_venv(work / "wheel-venv")
    env = with_path(bin_dir)
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "-c", str(constraints)]
    run([*pip, f"{wheel}[metrics]"], cwd=work, env=env, timeout=INSTALL_TIMEOUT)
    metrics_port = free_port()
    argv = [str(bin_dir / "rlmesh-trio"), "serve", "--env", "CartPole-v1", "--num-envs", "3"]
    argv += ["--metrics-address", f"tcp://127.0.0.1:{metrics_port}"]
    with serving(argv, cwd=work, env=env) as server:
        address = server.wait_for(SERVING, SERVE_TIMEOUT).group(1)
        run([str(bin_dir / "rlmesh-trio"), "probe", address], cwd=work, env=env, timeout=60)
        run([str(bin_dir / "python"), "-c", CLIENT_CHECK, address], cwd=work, env=env, timeout=120)
        text = scrape(metrics_port)
        if "rlmesh_trio_" not in text:
            raise CheckFailed(f"no rlmesh_trio_ metrics at :{metrics_port}/metrics")
        log(f"metrics scraped ({len(text.splitlines())} lines)")
        expect_clean_stop(server, signal.SIGINT)


STACK_2025 = ("numpy==2.2.6", "gymnasium==1.1.1", "trio==0.30.0")
"""A training stack of 2025 (numpy pinned below 2.3 for numba or TensorFlow, say): the
wheel installs beside it without replacing any of them."""


def check_beside_a_2025_stack(wheel: Path, work: Path) -> None:
    """``pip install WHEEL`` into a venv that holds :data:`STACK_2025` (no constraints
    file: pip resolves as a user's would) keeps every one of those versions, and serves."""
    bin_dir = fresh_venv(work / "stack-venv")
    env = with_path(bin_dir)
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet"]
    run([*pip, *STACK_2025], cwd=work, env=env, timeout=INSTALL_TIMEOUT)
    run([*pip, str(wheel)], cwd=work, env=env, timeout=INSTALL_TIMEOUT)
    frozen = (
        subprocess.run(
            [str(bin_dir / "python"), "-m", "pip", "freeze"],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        .stdout.lower()
        .split()
    )
    replaced = [pin for pin in STACK_2025 if pin.lower() not in frozen]
    if replaced:
        raise CheckFailed(f"installing the wheel replaced {replaced}: {frozen}")
    argv = [str(bin_dir / "rlmesh-trio"), "serve", "--env", "CartPole-v1"]
    with serving(argv, cwd=work, env=env) as server:
        server.wait_for(SERVING, SERVE_TIMEOUT)
        expect_clean_stop(server, signal.SIGINT)
    log(f"installed beside {', '.join(STACK_2025)} without replacing them, and served")


# -- 3. the Dockerfile's steps ------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def exec_form(args: str) -> list[str]:
    """A JSON-array (exec form) instruction's argv; the shell form is refused."""
    value = json.loads(args)
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise CheckFailed(f"expected an exec-form JSON array, got {args!r}")
    return value


def dockerignored(context: Path) -> list[str]:
    path = context / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.strip().rstrip("/") for line in lines if line.strip() and line[0] != "#"]


def copy_context(dest: Path) -> Path:
    """The repository as ``docker build`` would send it (.dockerignore applied)."""
    patterns = dockerignored(ROOT)

    def ignore(directory: str, names: list[str]) -> list[str]:
        rel = Path(directory).relative_to(ROOT)
        return [
            n
            for n in names
            if any(fnmatch.fnmatch((rel / n).as_posix(), p) for p in patterns)
            or any(fnmatch.fnmatch(n, p) for p in patterns if "/" not in p)
        ]

    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


class Stage:
    def __init__(self, name: str, root: Path, bin_dir: Path) -> None:
        self.name, self.root, self.bin_dir = name, root, bin_dir
        self.workdir = root
        self.entrypoint: list[str] = []
        self.cmd: list[str] = []
        self.healthcheck: list[str] = []
        self.user = "root"
        self.env: dict[str, str] = {}

    def inside(self, path: str) -> Path:
        """An image path, mapped into this stage's stand-in filesystem."""
        if path.startswith("/"):
            return self.root / path.lstrip("/")
        return self.workdir / path


def copy_into(sources: Sequence[Path], dest_text: str, dest: Path) -> None:
    """``COPY``: a directory's contents go into ``dest``; files into it when it is a
    directory (several sources, a trailing ``/``, or one that exists), else onto it."""
    as_dir = len(sources) > 1 or dest_text.endswith("/") or dest.is_dir()
    for source in sources:
        if not source.exists():
            raise CheckFailed(f"COPY source {source} does not exist")
        if source.is_dir():
            shutil.copytree(source, dest, dirs_exist_ok=True)
            continue
        target = dest / source.name if as_dir else dest
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def run_dockerfile(work: Path) -> Stage:
    """Each instruction as ``docker build`` would run it; the last stage."""
    context = copy_context(work / "context")
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for word, args in dockerfile_instructions(DOCKERFILE):
        if word == "FROM":
            image, _, name = args.partition(" AS ")
            name = name.strip() or f"stage{len(stages)}"
            root = work / "stages" / name
            root.mkdir(parents=True)
            log(f"FROM {image} -> fresh venv for stage {name}")
            stage = stages[name] = Stage(name, root, fresh_venv(work / "venvs" / name))
            continue
        if stage is None:
            if word == "ARG":
                continue
            raise CheckFailed(f"{word} before FROM")
        if word == "WORKDIR":
            stage.workdir = stage.inside(args)
            stage.workdir.mkdir(parents=True, exist_ok=True)
        elif word == "COPY":
            parts = shlex.split(args)
            source_root = context
            for flag in [p for p in parts if p.startswith("--")]:
                if flag.startswith("--from="):
                    source_root = stages[flag.split("=", 1)[1]].root
                elif not flag.startswith("--chown="):
                    raise CheckFailed(f"COPY flag {flag} not understood")
            *sources, dest = [p for p in parts if not p.startswith("--")]
            paths = [source_root / s.lstrip("/") for s in sources]
            copy_into(paths, dest, stage.inside(dest))
        elif word == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                stage.env[key] = value
        elif word == "RUN":
            if re.search(r"(^|\s)/", args):
                raise CheckFailed(f"RUN with an absolute path cannot be checked: {args!r}")
            env = with_path(stage.bin_dir, stage.env)
            run(args, cwd=stage.workdir, env=env, timeout=INSTALL_TIMEOUT, shell=DOCKER_SHELL)
        elif word == "ENTRYPOINT":
            stage.entrypoint = exec_form(args)
        elif word == "CMD":
            stage.cmd = exec_form(args)
        elif word == "HEALTHCHECK":
            _options, _, command = args.partition("CMD ")
            stage.healthcheck = exec_form(command)
        elif word == "USER":
            stage.user = args
        elif word in ("LABEL", "EXPOSE", "ARG", "STOPSIGNAL"):
            continue
        else:
            raise CheckFailed(f"Dockerfile instruction {word} not understood by this check")
    if stage is None:
        raise CheckFailed("Dockerfile has no FROM")
    return stage


def check_image_steps(work: Path) -> None:
    image = run_dockerfile(work)
    if image.user.split(":")[0] in ("root", "0", ""):
        raise CheckFailed(f"the image runs as {image.user!r}, not a non-root user")
    argv = [*image.entrypoint, *image.cmd]
    port = free_port()
    # where it listens: rlmesh's bind contract (RLMESH_ADDRESS in the image's ENV), moved
    # to a free loopback port here
    listen = image.env.get("RLMESH_ADDRESS", "")
    if "--address" in argv or not listen.startswith("0.0.0.0:"):
        raise CheckFailed(
            f"the image should listen on ENV RLMESH_ADDRESS=0.0.0.0:PORT, not --address: "
            f"{argv}, RLMESH_ADDRESS={listen!r}"
        )
    container_port = listen.split(":")[1]
    health = [a.replace(f":{container_port}", f":{port}") for a in image.healthcheck]
    if not health or health[:2] != ["rlmesh-trio", "probe"]:
        raise CheckFailed(f"HEALTHCHECK is not `rlmesh-trio probe ...`: {image.healthcheck}")
    env = with_path(image.bin_dir, {**image.env, "RLMESH_ADDRESS": f"127.0.0.1:{port}"})
    with serving(argv, cwd=image.workdir, env=env) as server:
        server.wait_for(SERVING, SERVE_TIMEOUT)
        run(health, cwd=image.workdir, env=env, timeout=60)
        run(
            [str(image.bin_dir / "python"), "-c", "import prometheus_client"],
            cwd=image.workdir,
            env=env,
            timeout=60,
        )
        expect_clean_stop(server, signal.SIGTERM)


# -- 4. the README's quick start ----------------------------------------------------------


def readme_quick_start() -> tuple[list[str], str, list[str], str]:
    """(serve commands, the line serve prints, client commands, the client example)."""
    text = README.read_text()
    section = text.split("\n## Serve an env\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)
    consoles = [body for lang, body in blocks if lang == "console"]
    pythons = [body for lang, body in blocks if lang == "python"]
    if len(consoles) < 2 or not pythons:
        raise CheckFailed("README's quick start: expected two console blocks and a python one")
    serve_lines = consoles[0].splitlines()
    serve = [line[2:] for line in serve_lines if line.startswith("$ ")]
    printed = next(line for line in serve_lines if SERVING.search(line))
    client = [line[2:] for line in consoles[1].splitlines() if line.startswith("$ ")]
    return serve, printed, client, pythons[0]


def check_quick_start(work: Path, constraints: Path) -> None:
    serve, printed, client, example = readme_quick_start()
    shown = SERVING.search(printed)
    assert shown is not None
    clone = copy_context(work / "clone")
    env = with_path(Path(sys.executable).parent, {"PIP_CONSTRAINT": str(constraints)})
    script = "set -euo pipefail\n" + "\n".join(serve)
    with serving(["bash", "-c", script], cwd=clone, env=env) as server:
        address = server.wait_for(SERVING, INSTALL_TIMEOUT).group(1)
        if not re.fullmatch(r"tcp://127\.0\.0\.1:\d+", address):
            raise CheckFailed(f"serve printed {address!r}, the README shows {shown.group(1)!r}")
        home = work / "client"
        home.mkdir()
        (home / "quickstart.py").write_text(example.replace(shown.group(1), address))
        run(
            "\n".join([*client, "python quickstart.py"]), cwd=home, env=env, timeout=INSTALL_TIMEOUT
        )
        expect_clean_stop(server, signal.SIGINT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--dist", type=Path, required=True, help="where `python -m build` wrote")
    parser.add_argument("--constraints", type=Path, required=True, help="constraints/ci.txt")
    parser.add_argument("--workdir", type=Path, required=True, help="an empty scratch directory")
    parser.add_argument(
        "--only",
        choices=("wheel", "stack", "image", "readme"),
        action="append",
        help="run only these checks (repeatable; default all)",
    )
    args = parser.parse_args()
    only = set(args.only or ("wheel", "stack", "image", "readme"))
    constraints = args.constraints.resolve()
    work = args.workdir.resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    try:
        wheel, _ = check_artefacts(args.dist.resolve())
        if "wheel" in only:
            (work / "wheel").mkdir()
            check_wheel(wheel, constraints, work / "wheel")
        if "stack" in only:
            (work / "stack").mkdir()
            check_beside_a_2025_stack(wheel, work / "stack")
        if "image" in only:
            (work / "image").mkdir()
            check_image_steps(work / "image")
        if "readme" in only:
            (work / "readme").mkdir()
            check_quick_start(work / "readme", constraints)
    except CheckFailed as exc:
        log(f"FAILED: {exc}")
        return 1
    log("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
