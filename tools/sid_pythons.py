"""Run nox sessions on the Pythons that pyenv lacks here (3.14, 3.15), in a Debian sid
chroot that has them. Run by ``.ci/run``; stdlib only, Linux, as root.

1. debootstrap, from Debian (``apt-get install``) if it is missing;
2. a ``--variant=minbase`` sid chroot with python3.14, python3.15 (and their venv
   packages), built once at ``--root`` (default ``/var/tmp/rlmesh-trio-sid``) and reused
   while its stamp names the same packages; ``--rebuild`` builds it anew. It is built
   aside and renamed into place, so a half-built one is never reused. The mirror is the
   host's own Debian archive (its apt sources), or ``--mirror``;
3. the host's CA bundle and resolv.conf copied in (pip verifies against the bundle), the
   repository's files copied in (``git ls-files``: tracked and untracked, not ignored),
   nox (pyproject's pin, at the CI pins) in a venv of the chroot's python3.14;
4. each session in a mount and PID namespace of its own (/proc, /dev and /sys mounted
   inside; everything it started dies with it, and no mount outlives it), chrooted, with
   a clean environment (HOME, PATH, LANG, CI and any ``RLMESH_*`` variable: nothing of
   the host's pip configuration). Loopback is the host's: the suite's servers bind it.

By default the sessions are ``suite-3.14`` (the whole suite, but Ray, at the CI pins) and
``newest`` (the suite against the newest release every range admits, on 3.15): with
``nox -s lowest`` on 3.11, three Pythons, three corners of the ranges. Arguments after
``--`` go to pytest. Not root (or not Linux): skipped with a message, unless ``CI`` is
set, where that is a failure -- CI must run these.

Usage: ``python3 tools/sid_pythons.py [--root DIR] [--rebuild] [--mirror URL]
[--session NAME ...] [-- PYTEST ARGS]``
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHROOT = Path("/var/tmp/rlmesh-trio-sid")
SUITE = "sid"
PACKAGES = ("python3.14", "python3.14-venv", "python3.15", "python3.15-venv", "ca-certificates")
SESSIONS = ("suite-3.14", "newest")
INSIDE = Path("/work")
"""Where the repository copy (``rlmesh-trio``) and nox's venv live in the chroot."""
NOX_PYTHON = "python3.14"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
STAMP = ".rlmesh-trio-sid.json"
LEFT_OUT = {".git", ".nox", ".venv", ".ci-venv", "__pycache__", ".mypy_cache", ".ruff_cache"}


def log(message: str) -> None:
    print(f"sid_pythons: {message}", flush=True)


class Failed(Exception):
    pass


def run(argv: Sequence[str], env: dict[str, str] | None = None) -> None:
    log(f"$ {shlex.join(argv)}")
    done = subprocess.run(list(argv), env=env, check=False)
    if done.returncode != 0:
        raise Failed(f"exit {done.returncode}: {shlex.join(argv)}")


# -- the host ------------------------------------------------------------------------------


def unable_here() -> str | None:
    """Why this machine cannot run the chroot, or None."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if os.geteuid() != 0:
        return "needs root (debootstrap, chroot, mount)"
    for tool in ("unshare", "chroot", "mount"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH"
    return None


def ensure_debootstrap() -> None:
    if shutil.which("debootstrap") is not None:
        return
    if shutil.which("apt-get") is None:
        raise Failed("no debootstrap, and no apt-get to install it with")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "debootstrap"], env=env)


def host_mirror() -> str:
    """The URI of the host's own Debian archive: the apt source that carries the host's
    release (``VERSION_CODENAME`` of /etc/os-release) with its ``main`` component."""
    release = dict(
        line.split("=", 1)
        for line in Path("/etc/os-release").read_text().splitlines()
        if "=" in line
    )
    if release.get("ID", "").strip('"') != "debian":
        raise Failed("the host is not Debian: pass --mirror with a Debian archive's URI")
    codename = release.get("VERSION_CODENAME", "").strip('"')
    apt = Path("/etc/apt")
    for path in sorted(apt.glob("sources.list.d/*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if ":" in line and not line.lstrip().startswith("#"):
                    key, value = line.split(":", 1)
                    fields[key.strip().lower()] = value.strip()
            if fields.get("enabled", "yes").lower() == "no":
                continue
            if (
                codename in fields.get("suites", "").split()
                and "main" in fields.get("components", "").split()
            ):
                return fields["uris"].split()[0]
    for path in [apt / "sources.list", *sorted(apt.glob("sources.list.d/*.list"))]:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            # deb [options] URI SUITE COMPONENT...
            words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
            if words[:1] == ["deb"] and len(words) >= 4:
                uri, suite, components = words[1], words[2], words[3:]
                if suite == codename and "main" in components:
                    return uri
    raise Failed(f"no apt source for {codename} main found: pass --mirror")


# -- the chroot ----------------------------------------------------------------------------


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()).rstrip("/") + "/"
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [p for p in points if (p + "/").startswith(prefix)]


def remove_tree(path: Path) -> None:
    """``rm -r`` a chroot, refusing while anything is mounted inside it."""
    if not path.exists():
        return
    busy = mounts_under(path)
    if busy:
        raise Failed(f"{path} has mounts inside ({busy[:3]}): unmount them first")
    shutil.rmtree(path)


def wanted_stamp() -> dict[str, object]:
    return {"suite": SUITE, "variant": "minbase", "packages": sorted(PACKAGES)}


def ensure_chroot(chroot: Path, *, rebuild: bool, mirror: str | None) -> str:
    """The chroot at ``chroot``, built unless a complete one is there; how it was had."""
    stamp = chroot / STAMP
    if not rebuild and stamp.exists():
        found = json.loads(stamp.read_text())
        if {k: found.get(k) for k in wanted_stamp()} == wanted_stamp():
            return f"reused (built {found.get('built', '?')})"
        log(f"{chroot} was built for {found}: building it anew")
    ensure_debootstrap()
    uri = mirror or host_mirror()
    partial = chroot.with_name(chroot.name + ".partial")
    command = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE]
    for attempt in (1, 2):  # once more after a failure: a mirror's hiccup must not fail CI
        remove_tree(partial)
        try:
            run([*command, str(partial), uri])
            break
        except Failed:
            if attempt == 2:
                raise
            log("debootstrap failed: once more from scratch in 10 s")
            time.sleep(10)
    (partial / STAMP).write_text(
        json.dumps({**wanted_stamp(), "built": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n"
    )
    remove_tree(chroot)
    partial.rename(chroot)
    return "built"


def copy_host_files(chroot: Path) -> None:
    """The host's CA bundle (pip verifies the registry with it) and resolver config."""
    for source in (CA_BUNDLE, Path("/etc/resolv.conf")):
        if not source.exists():
            raise Failed(f"the host has no {source}")
        target = chroot / source.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        target.write_bytes(source.read_bytes())


def repository_files() -> list[Path]:
    """The files of the work tree that git does not ignore (tracked and untracked)."""
    if (ROOT / ".git").exists() and shutil.which("git") is not None:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout.split(b"\0")
        paths = [Path(os.fsdecode(p)) for p in listed if p]
        return [p for p in paths if (ROOT / p).is_file()]
    return [
        p.relative_to(ROOT)
        for p in ROOT.rglob("*")
        if p.is_file() and not LEFT_OUT & set(p.relative_to(ROOT).parts)
    ]


def copy_repository(chroot: Path) -> Path:
    """A fresh copy of the repository at /work/rlmesh-trio in the chroot."""
    target = chroot / INSIDE.relative_to("/") / "rlmesh-trio"
    remove_tree(target)
    files = repository_files()
    for relative in files:
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, target / relative)
    log(f"copied {len(files)} files of {ROOT} to {target}")
    return target


def clean_env() -> list[str]:
    env = {
        "HOME": "/root",
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "CI": os.environ.get("CI", ""),
    }
    env.update({k: v for k, v in os.environ.items() if k.startswith("RLMESH_")})
    return [f"{k}={v}" for k, v in env.items() if v]


def in_chroot(chroot: Path, argv: Sequence[str]) -> None:
    """Run ``argv`` chrooted, in its own mount and PID namespaces (see the module doc)."""
    root = shlex.quote(str(chroot))
    script = (
        "set -e; "
        f"mount -t proc proc {root}/proc; "
        f"mount --rbind /dev {root}/dev; "
        f"mount --rbind /sys {root}/sys; "
        f"exec chroot {root} /usr/bin/env -i {shlex.join(clean_env())} {shlex.join(argv)}"
    )
    run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--pid",
            "--fork",
            "--kill-child",
            "--",
            "sh",
            "-c",
            script,
        ]
    )


def nox_pin() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [r for r in project["optional-dependencies"]["dev"] if r.startswith("nox==")]
    return str(pin)


def ensure_nox(chroot: Path) -> str:
    """nox at pyproject's pin in /work/nox-venv of the chroot; its path inside."""
    venv = INSIDE / "nox-venv"
    version_file = chroot / venv.relative_to("/") / "nox-pin"
    pin = nox_pin()
    if not version_file.exists() or version_file.read_text().strip() != pin:
        repo = INSIDE / "rlmesh-trio"
        in_chroot(chroot, [NOX_PYTHON, "-m", "venv", "--clear", str(venv)])
        in_chroot(
            chroot,
            [
                f"{venv}/bin/pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "-c",
                f"{repo}/constraints/ci.txt",
                pin,
            ],
        )
        version_file.write_text(pin + "\n")
    return f"{venv}/bin/nox"


@contextmanager
def locked(chroot: Path) -> Iterator[None]:
    """One run at a time per chroot (they share its copy of the repository)."""
    chroot.parent.mkdir(parents=True, exist_ok=True)
    with open(chroot.with_name(chroot.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=DEFAULT_CHROOT, help="the chroot's path")
    parser.add_argument("--rebuild", action="store_true", help="build the chroot anew")
    parser.add_argument("--mirror", help="a Debian archive's URI (default: the host's)")
    parser.add_argument(
        "--session",
        action="append",
        dest="sessions",
        help=f"a nox session to run (repeatable; default: {' '.join(SESSIONS)})",
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = parser.parse_args(argv)

    why = unable_here()
    if why is not None:
        if os.environ.get("CI"):
            log(f"cannot run here: {why} (CI must run the 3.14/3.15 suites)")
            return 1
        log(f"skipped: {why}")
        return 0

    chroot: Path = args.root.resolve()
    results: list[tuple[str, str, float]] = []
    try:
        with locked(chroot):
            started = time.monotonic()
            how = ensure_chroot(chroot, rebuild=args.rebuild, mirror=args.mirror)
            copy_host_files(chroot)
            copy_repository(chroot)
            nox = ensure_nox(chroot)
            in_chroot(chroot, ["sh", "-c", "python3.14 -VV; python3.15 -VV"])
            log(f"chroot {chroot} {how}; ready in {time.monotonic() - started:.0f} s")
            repo = INSIDE / "rlmesh-trio"
            for session in args.sessions or SESSIONS:
                began = time.monotonic()
                command = [nox, "-f", f"{repo}/noxfile.py", "-s", session]
                if args.pytest_args:
                    command += ["--", *args.pytest_args]
                try:
                    in_chroot(chroot, command)
                    status = "passed"
                except Failed:
                    status = "FAILED"
                results.append((session, status, time.monotonic() - began))
                log(f"{session}: {status} in {results[-1][2]:.0f} s")
    except Failed as exc:
        log(f"failed: {exc}")
        return 1
    for session, status, seconds in results:
        log(f"{session:>12}: {status} ({seconds:.0f} s)")
    return 0 if all(status == "passed" for _, status, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
