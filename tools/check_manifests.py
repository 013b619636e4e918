"""Render every kustomization under ``deploy/`` as ``kubectl kustomize`` does and validate
each object against the Kubernetes API's schemas, strictly (an unknown field is an
error), so a typo in a manifest or a patch fails CI rather than ``kubectl apply``. Run by
``nox -s manifests``; needs PyYAML, jsonpatch and kubernetes-validate.

What is rendered: a kustomization's ``resources`` (manifest files, or directories holding
a kustomization of their own, rendered first), then its ``patches`` in order, each a
JSON 6902 patch file applied (with jsonpatch) to every object its ``target`` selects;
a patch that selects nothing, or an op that does not apply, fails. Any other
kustomization field fails too (this renderer does not know it: extend it with the
field). Manifests that no kustomization lists (``secret.example.yaml``) are validated
alone. Every object is validated for each Kubernetes version in ``--versions`` (default:
1.27, the first with the gRPC probes the StatefulSet uses, and the newest the installed
kubernetes-validate carries).

Usage: ``python tools/check_manifests.py [--versions 1.27.0,1.37.0]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUSTOMIZATION = "kustomization.yaml"
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "patches"}
OLDEST = "1.27.0"


class Invalid(Exception):
    pass


def load_documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc or "apiVersion" not in doc:
            raise Invalid(f"{path}: not a Kubernetes object: {str(doc)[:200]}")
    return docs


def selects(target: dict[str, Any], doc: dict[str, Any]) -> bool:
    metadata = doc.get("metadata", {})
    wanted = {
        "kind": doc.get("kind"),
        "name": metadata.get("name"),
        "namespace": metadata.get("namespace"),
        "group": doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else "",
        "version": doc["apiVersion"].split("/")[-1],
    }
    unknown = set(target) - set(wanted)
    if unknown:
        raise Invalid(f"patch target fields not understood here: {sorted(unknown)}")
    return all(wanted[key] == value for key, value in target.items())


def render(directory: Path, seen: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """The objects the kustomization in ``directory`` renders."""
    directory = directory.resolve()
    if directory in seen:
        raise Invalid(f"{directory}: a kustomization cycle through {[str(p) for p in seen]}")
    path = directory / KUSTOMIZATION
    kustomization = yaml.safe_load(path.read_text())
    unknown = set(kustomization) - KNOWN_FIELDS
    if unknown:
        raise Invalid(f"{path}: fields this renderer does not apply: {sorted(unknown)}")
    if kustomization.get("kind") != "Kustomization":
        raise Invalid(f"{path}: kind is {kustomization.get('kind')!r}, not Kustomization")
    docs: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        source = (directory / resource).resolve()
        if source.is_dir():
            docs += render(source, (*seen, directory))
        elif source.is_file():
            docs += load_documents(source)
        else:
            raise Invalid(f"{path}: resource {resource!r} does not exist")
    for patch in kustomization.get("patches", []):
        if set(patch) - {"path", "target"} or "path" not in patch or "target" not in patch:
            raise Invalid(f"{path}: only JSON 6902 patches (path + target) are applied: {patch}")
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise Invalid(f"{directory / patch['path']}: not a JSON 6902 patch (a list of ops)")
        chosen = [i for i, doc in enumerate(docs) if selects(patch["target"], doc)]
        if not chosen:
            raise Invalid(f"{path}: patch {patch['path']} selects nothing ({patch['target']})")
        for index in chosen:
            try:
                docs[index] = jsonpatch.apply_patch(docs[index], ops)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise Invalid(f"{path}: patch {patch['path']}: {exc}") from None
    return docs


def validate(where: str, docs: list[dict[str, Any]], versions: list[str]) -> list[str]:
    problems: list[str] = []
    names = [f"{d['kind']}/{d.get('metadata', {}).get('name')}" for d in docs]
    if len(set(names)) != len(names):
        problems.append(f"{where}: an object twice: {sorted(names)}")
    for name, doc in zip(names, docs, strict=True):
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = "/".join(str(p) for p in exc.path)
                problems.append(f"{where}: {name} (Kubernetes {version}) at {path}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                problems.append(f"{where}: {name} (Kubernetes {version}): {exc}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--versions",
        default=f"{OLDEST},{kubernetes_validate.latest_version()}",
        help="Kubernetes versions to validate against, comma-separated",
    )
    args = parser.parse_args(argv)
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    problems: list[str] = []
    listed: set[Path] = set()
    kustomizations = sorted(p.parent for p in DEPLOY.rglob(KUSTOMIZATION))
    for directory in kustomizations:  # what the kustomizations name is rendered, not alone
        text = yaml.safe_load((directory / KUSTOMIZATION).read_text())
        listed |= {(directory / r).resolve() for r in text.get("resources", [])}
        listed |= {(directory / p["path"]).resolve() for p in text.get("patches", [])}
    for directory in kustomizations:
        where = str(directory.relative_to(ROOT))
        try:
            docs = render(directory)
        except Invalid as exc:
            problems.append(str(exc))
            continue
        problems += validate(where, docs, versions)
        kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
        print(f"check_manifests: {where}: {len(docs)} objects rendered: {', '.join(kinds)}")
    for path in sorted(DEPLOY.rglob("*.yaml")):
        if path.name == KUSTOMIZATION or path.resolve() in listed:
            continue
        try:
            docs = load_documents(path)
        except Invalid as exc:
            problems.append(str(exc))
            continue
        problems += validate(str(path.relative_to(ROOT)), docs, versions)
        print(f"check_manifests: {path.relative_to(ROOT)}: {len(docs)} objects, alone")
    for problem in problems:
        print(f"check_manifests: INVALID: {problem}")
    if not kustomizations:
        print(f"check_manifests: no {KUSTOMIZATION} under {DEPLOY}")
        return 1
    print(
        f"check_manifests: {'FAILED' if problems else 'valid'} (Kubernetes {', '.join(versions)})"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
