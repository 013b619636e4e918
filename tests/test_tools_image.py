"""The pure parts of tools/image.py (``nox -s image`` builds and drives the images
themselves, as root, in CI) and tools/check_manifests.py (``nox -s manifests``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def image_tool() -> Iterator[ModuleType]:
    sys.path.insert(0, str(TOOLS))  # it imports sid_pythons, beside it
    try:
        import image

        yield image
    finally:
        sys.path.remove(str(TOOLS))
        sys.modules.pop("image", None)


def test_the_dockerfiles_base_is_the_one_the_tool_stands_in_for(image_tool: Any) -> None:
    (base,) = image_tool.base_images(ROOT / "deploy" / "kubernetes" / "Dockerfile")
    assert base == "docker.io/library/python:3.11-slim"
    assert base in image_tool.STAND_IN


def test_base_images_skip_stages_and_qualify_names(image_tool: Any, tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "FROM --platform=linux/amd64 python:3.12-slim AS build\n"
        "RUN true\n"
        "FROM build\n"
        "from quay.io/org/img:1 as other\n"
        "FROM localhost/mine:dev\n"
        "FROM user/app\n"
    )
    assert image_tool.base_images(dockerfile) == [
        "docker.io/library/python:3.12-slim",
        "quay.io/org/img:1",
        "localhost/mine:dev",
        "docker.io/user/app",
    ]


@pytest.mark.parametrize(
    "space",
    [gym.spaces.Discrete(2), gym.spaces.Discrete(5, start=-2), gym.spaces.Box(-1, 3, (2,))],
)
def test_the_drive_policy_is_deterministic_and_in_the_space(image_tool: Any, space: Any) -> None:
    act = image_tool.policy_for(space)
    observations = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32)
    actions = [act(o) for o in observations]
    assert all(space.contains(a) for a in actions)
    assert [np.asarray(a).tolist() for a in actions] == [
        np.asarray(act(o)).tolist() for o in observations
    ]
    if isinstance(space, gym.spaces.Discrete):
        assert len({int(a) for a in actions}) > 1  # it moves


def test_the_image_tells_its_port_and_refuses_root(image_tool: Any) -> None:
    image = image_tool.Image(
        tag="t",
        entrypoint=["rlmesh-trio"],
        cmd=["serve"],
        user="65534:65534",
        env={"RLMESH_ADDRESS": "0.0.0.0:50051"},
        healthcheck=[],
        start_seconds=60.0,
    )
    assert image.port() == 50051 and image.uid() == 65534
    image.user = "0"
    with pytest.raises(image_tool.Failed, match="root"):
        image.uid()
    image.env = {}
    with pytest.raises(image_tool.Failed, match="RLMESH_ADDRESS"):
        image.port()


@pytest.fixture(scope="module")
def manifests_tool() -> Iterator[ModuleType]:
    pytest.importorskip("jsonpatch")
    pytest.importorskip("kubernetes_validate")
    sys.path.insert(0, str(TOOLS))
    try:
        import check_manifests

        yield check_manifests
    finally:
        sys.path.remove(str(TOOLS))
        sys.modules.pop("check_manifests", None)


def test_a_typo_in_a_patch_fails_the_manifests_check(
    manifests_tool: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    deploy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", deploy)
    monkeypatch.setattr(manifests_tool, "DEPLOY", deploy)
    monkeypatch.setattr(manifests_tool, "ROOT", tmp_path)
    assert manifests_tool.main([]) == 0
    patch = deploy / "kubernetes-tls" / "statefulset-tls.yaml"
    patch.write_text(
        patch.read_text().replace("readOnly: true", "readOnly: true\n      readonly: 1")
    )
    assert manifests_tool.main([]) == 1
