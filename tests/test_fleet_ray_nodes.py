"""``rlmesh_trio.fleet.ray`` on a two-node Ray (both nodes on this machine, loopback).

SPREAD puts the endpoints on distinct nodes; losing a node moves its endpoint to the
surviving one (Ray reschedules the placement-group bundle and restarts the actor), and
the fleet follows: new node, current address, serving, and ``fleet.run`` completes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

# Before Ray is imported: it reads them at import (the node IP then is 127.0.0.1).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ray = pytest.importorskip("ray")

import rlmesh  # noqa: E402
import rlmesh.numpy  # noqa: E402
from conftest import leaked_threads  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from rlmesh_trio.fleet.ray import launch  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

MODEL = rlmesh.numpy.Model(lambda obs: (np.asarray(obs)[..., 2] > 0).astype(np.int64))


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Any, Any]]:
    began = time.monotonic()
    two = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    worker = two.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    try:
        # Loopback, whatever address the head reports for itself.
        ray.init(address="127.0.0.1:" + two.address.rsplit(":", 1)[1], log_to_driver=False)
        two.wait_for_nodes()
        print(f"two-node Ray: {time.monotonic() - began:.1f} s")
        yield two, worker
    finally:
        ray.shutdown()
        two.shutdown()


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    leaked = [t for t in leaked_threads(before, 5.0) if t.name.startswith("rlmesh")]
    assert not leaked, f"threads leaked by this test: {[t.name for t in leaked]}"


def test_spread_over_nodes_and_a_lost_node_moves_its_endpoint(cluster: tuple[Any, Any]) -> None:
    two, worker = cluster
    with launch(
        "CartPole-v1",
        endpoints=2,
        num_envs=2,
        resources={"CPU": 0.5},
        placement="SPREAD",
        bind="127.0.0.1",
        health_period_seconds=0.5,
        health_timeout_seconds=1.0,
        unhealthy_after=2,
        ready_timeout_seconds=90.0,
    ) as fleet:
        nodes = [e.node for e in fleet.endpoints]
        assert len(set(nodes)) == 2  # SPREAD: one endpoint per node
        assert worker.node_id in nodes
        moved = nodes.index(worker.node_id)
        began = time.monotonic()
        two.remove_node(worker)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            endpoint = fleet.endpoints[moved]
            if endpoint.node != worker.node_id and endpoint.state == "serving":
                break
            time.sleep(0.2)
        print(f"node lost -> endpoint serving on the other node: {time.monotonic() - began:.2f} s")
        endpoint = fleet.endpoints[moved]
        assert endpoint.node == nodes[1 - moved]  # the surviving node
        assert endpoint.state == "serving"
        assert endpoint.restarts >= 1
        assert fleet.info(moved).node == nodes[1 - moved]
        result = fleet.run(MODEL, seeds=list(range(8)))
        assert [e.seed for e in result.episodes] == list(range(8))
        assert {s.endpoint for s in result.shards} == {0, 1}
