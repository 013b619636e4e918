"""Regenerate (or check) the betterproto2 code in src/rlmesh_trio/_proto from proto/.

Usage: python tools/codegen.py [--check]

betterproto2 classes are generated for ``proto/rlmesh/``; every file under ``proto/``
(``grpc/health/v1`` too) goes into ``descriptors.binpb``, a serialized
``FileDescriptorSet`` that server reflection (``--reflection``) answers from.

The generated tree is committed. ``--check`` regenerates into a temporary folder and
fails (exit 1) when it differs from what is committed, naming the files that drifted.
"""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
OUT = ROOT / "src" / "rlmesh_trio" / "_proto"
HEADER = "# Generated from proto/ by `nox -s codegen` (betterproto2-compiler) -- do not edit.\n"


DESCRIPTORS = "descriptors.binpb"


def generate(dest: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO)) for p in (PROTO / "rlmesh").rglob("*.proto"))
    every = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO}",
            f"--descriptor_set_out={dest / DESCRIPTORS}",
            "--include_imports",
            *every,
        ],
        check=True,
        cwd=PROTO,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO}",
            f"--python_betterproto2_out={dest}",
            "--python_betterproto2_opt=client_generation=async,server_generation=async",
            *protos,
        ],
        check=True,
        cwd=PROTO,
        stdout=subprocess.DEVNULL,
    )
    for path in dest.rglob("*.py"):
        path.write_text(HEADER + path.read_text())
    (dest / "py.typed").touch()


def main(argv: list[str]) -> int:
    check = "--check" in argv
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "_proto"
        fresh.mkdir()
        generate(fresh)
        if check:
            drift = _diff(fresh, OUT)
            if drift:
                print("generated protobuf code is out of date; run `nox -s codegen`:")
                for name in drift:
                    print(f"  {name}")
                return 1
            print("generated protobuf code is up to date")
            return 0
        if OUT.exists():
            shutil.rmtree(OUT)
        shutil.copytree(fresh, OUT)
        print(f"regenerated {OUT.relative_to(ROOT)}")
    return 0


def _diff(fresh: Path, committed: Path) -> list[str]:
    names = {p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file()}
    if committed.exists():
        names |= {
            p.relative_to(committed)
            for p in committed.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }
    drift = []
    for name in sorted(names):
        a, b = fresh / name, committed / name
        if not (a.exists() and b.exists() and filecmp.cmp(a, b, shallow=False)):
            drift.append(str(name))
    return drift


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
