"""The examples run as documented (small sizes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import trio
from support.refserver import ServerConfig, ServerPool

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.timeout(120)


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_serve_and_evaluate_in_one_nursery() -> None:
    example = load("serve_and_evaluate")
    with trio.fail_after(90):
        returns = await example.main(episodes=6, num_envs=3)
    assert len(returns) == 6
    assert all(r >= 20 for r in returns)  # the lean-following policy balances for a while


@pytest.mark.interop
@pytest.mark.parametrize("kind", ["ref", "ours"])
def test_train_vector_env(servers: ServerPool, kind: str) -> None:
    example = load("train_vector_env")
    server = servers.get(kind, ServerConfig(env_id="CartPole-v1", num_envs=4))  # type: ignore[arg-type]
    history = example.train(server.address, generations=2)
    assert len(history) == 2 and all(h > 0 for h in history)
