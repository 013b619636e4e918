"""The fleet's 0.1 names: each still works, with a ``DeprecationWarning``, and does what
its new name does (no servers: unreachable endpoints and records built by hand)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

import rlmesh_trio
import rlmesh_trio.fleet as fleet_module
from rlmesh_trio.fleet import EndpointStatus, Fleet, FleetError, Health, ShardRun

pytestmark = pytest.mark.timeout(30)


def _closed_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_fleet_error_is_a_package_error_and_a_runtime_error() -> None:
    assert issubclass(FleetError, rlmesh_trio.RlmeshTrioError)
    assert issubclass(FleetError, RuntimeError)
    error = FleetError("no endpoint", partial=[1, None])
    assert error.partial == [1, None] and error.retries == ()


def test_endpoint_is_endpoint_status() -> None:
    with pytest.warns(DeprecationWarning, match=r"fleet\.Endpoint is deprecated.*EndpointStatus"):
        old = fleet_module.Endpoint
    assert old is EndpointStatus
    with pytest.raises(AttributeError):
        _ = fleet_module.NoSuchName


def test_endpoint_status_lanes_is_num_envs() -> None:
    status = EndpointStatus(0, "tcp://127.0.0.1:1", 4, "serving")
    with pytest.warns(DeprecationWarning, match=r"EndpointStatus\.lanes"):
        assert status.lanes == 4


def test_health_lanes_is_num_envs() -> None:
    health = Health(0, "tcp://127.0.0.1:1", True, "SERVING", num_envs=3)
    with pytest.warns(DeprecationWarning, match=r"Health\.lanes"):
        assert health.lanes == 3


def test_shard_run_duration_s_is_duration_seconds() -> None:
    shard = ShardRun(0, "tcp://127.0.0.1:1", (1, 2), 2, duration_seconds=1.5)
    with pytest.warns(DeprecationWarning, match=r"ShardRun\.duration_s"):
        assert shard.duration_s == 1.5


def test_health_timeout_is_timeout_seconds() -> None:
    with Fleet.from_addresses([_closed_address()]) as fleet:
        with pytest.warns(DeprecationWarning, match=r"health\(timeout=\)"):
            (health,) = fleet.health(timeout=1.0)
        assert not health.serving
        with (
            pytest.warns(DeprecationWarning, match=r"health\(timeout=\)"),
            pytest.raises(ValueError, match="timeout_seconds"),
        ):
            fleet.health(timeout=0)  # the old keyword reaches the same check


def test_wait_ready_timeouts_are_seconds() -> None:
    with (
        Fleet.from_addresses([_closed_address()]) as fleet,
        pytest.warns(DeprecationWarning, match=r"wait_ready\(") as warned,
        pytest.raises(TimeoutError),
    ):
        fleet.wait_ready(timeout=0.05, probe_timeout=0.05)
    messages = " ".join(str(w.message) for w in warned)
    assert "wait_ready(timeout=)" in messages and "wait_ready(probe_timeout=)" in messages


def test_map_recover_timeout_is_recover_timeout_seconds() -> None:
    # Without the old keyword's value (60 s by default) this would outlast the test.
    with (
        Fleet.from_addresses([_closed_address()]) as fleet,
        pytest.warns(DeprecationWarning, match=r"map\(recover_timeout=\)"),
        pytest.raises(FleetError, match="no endpoint left"),
    ):
        fleet.map(lambda address, shard: shard, [1], recover_timeout=0.05)


def test_run_recover_timeout_is_recover_timeout_seconds() -> None:
    pytest.importorskip("rlmesh")
    import rlmesh.numpy

    model = rlmesh.numpy.Model(lambda obs: obs)
    with (
        Fleet.from_addresses([_closed_address()]) as fleet,
        pytest.warns(DeprecationWarning, match=r"run\(recover_timeout=\)"),
        pytest.raises(FleetError, match="seeds not run: \\[0\\]"),
    ):
        fleet.run(model, seeds=[0], recover_timeout=0.05)


def test_run_fleet_is_fleet_run() -> None:
    pytest.importorskip("rlmesh")
    import rlmesh.numpy

    model = rlmesh.numpy.Model(lambda obs: obs)
    with (
        Fleet.from_addresses([_closed_address()]) as fleet,
        pytest.warns(DeprecationWarning, match=r"run_fleet\(\) is deprecated.*Fleet\.run"),
    ):
        result = fleet_module.run_fleet(fleet, model, seeds=[])
    assert result.num_episodes == 0  # an empty run, as fleet.run(model, seeds=[]) gives


class TestRayNames:
    """``fleet.ray``'s renames that need no running Ray."""

    @pytest.fixture(autouse=True)
    def _ray(self) -> Any:
        return pytest.importorskip("ray")

    def test_endpoint_info_lanes_is_num_envs(self) -> None:
        from rlmesh_trio.fleet.ray import EndpointInfo

        info = EndpointInfo("tcp://127.0.0.1:1", "node", 1, "i", 0, "CartPole-v1", 8)
        with pytest.warns(DeprecationWarning, match=r"EndpointInfo\.lanes"):
            assert info.lanes == 8

    def test_launch_lanes_is_num_envs(self) -> None:
        from rlmesh_trio.fleet.ray import launch

        # Checked before Ray starts: the old keyword's value reaches the new one's check.
        with (
            pytest.warns(DeprecationWarning, match=r"launch\(lanes=\)"),
            pytest.raises(ValueError, match="num_envs must be an int >= 1, got 0"),
        ):
            launch("CartPole-v1", endpoints=1, lanes=0)

    @pytest.mark.parametrize(
        "old", ["health_period_s", "health_timeout_s", "ready_timeout_s", "stop_timeout_s"]
    )
    def test_launch_seconds(self, old: str) -> None:
        from rlmesh_trio.fleet.ray import launch

        new = old.removesuffix("_s") + "_seconds"
        kwargs: dict[str, Any] = {old: -1.0}
        with (
            pytest.warns(DeprecationWarning, match=rf"launch\({old}=\).*{new}="),
            pytest.raises(ValueError, match=rf"{new} must be a number > 0, got -1.0"),
        ):
            launch("CartPole-v1", endpoints=1, num_envs=1, **kwargs)

    def test_bind_is_checked_before_ray_starts(self) -> None:
        from rlmesh_trio.fleet.ray import launch, resolve_bind

        assert resolve_bind("node") == "node" and resolve_bind("0.0.0.0") == "0.0.0.0"
        for bad in ("", "not a host!"):
            with pytest.raises(ValueError):
                launch("CartPole-v1", endpoints=1, num_envs=1, bind=bad)
