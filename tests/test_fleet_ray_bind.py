"""``launch(bind="auto")``'s decision, on clusters described to it (no Ray started):
loopback only when every live node is this host, and never through Ray Client."""

from __future__ import annotations

from typing import Any

import pytest

ray = pytest.importorskip("ray")

from rlmesh_trio.fleet.ray import resolve_bind  # noqa: E402

pytestmark = pytest.mark.timeout(30)

HERE = "10.1.2.3"


def _node(address: str, alive: bool = True) -> dict[str, Any]:
    return {"NodeManagerAddress": address, "Alive": alive}


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = []
    monkeypatch.setattr(ray, "nodes", lambda: list(nodes))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: HERE)
    monkeypatch.setattr(ray.util.client.ray, "is_connected", lambda: False)
    return nodes


def test_a_cluster_of_this_host_alone_binds_loopback(cluster: list[dict[str, Any]]) -> None:
    cluster.append(_node(HERE))
    assert resolve_bind() == resolve_bind("auto") == "127.0.0.1"
    cluster.append(_node("10.9.9.9", alive=False))  # a node gone is not a node
    assert resolve_bind() == "127.0.0.1"


def test_a_cluster_with_another_node_binds_each_nodes_address(
    cluster: list[dict[str, Any]],
) -> None:
    cluster.extend([_node(HERE), _node("10.1.2.4")])
    assert resolve_bind() == "node"
    cluster.clear()  # nothing alive is nothing known: not local
    assert resolve_bind() == "node"


def test_ray_client_is_never_local(
    cluster: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster.append(_node(HERE))
    monkeypatch.setattr(ray.util.client.ray, "is_connected", lambda: True)
    assert resolve_bind() == "node"


def test_explicit_binds_are_kept_without_asking_the_cluster(
    cluster: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def unasked() -> list[dict[str, Any]]:
        raise AssertionError("an explicit bind asked the cluster")

    monkeypatch.setattr(ray, "nodes", unasked)
    assert resolve_bind("node") == "node"
    assert resolve_bind("0.0.0.0") == "0.0.0.0"
    assert resolve_bind("127.0.0.1") == "127.0.0.1"
    for bad in ("", "not a host!"):
        with pytest.raises(ValueError):
            resolve_bind(bad)
