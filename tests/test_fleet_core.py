"""``rlmesh_trio.fleet`` without Ray: static addresses, health, map, run, failures.

The endpoints are ``rlmesh-trio serve`` subprocesses (shared per module where a test
does not kill them); the client is rlmesh 0.1.0's own ``rlmesh.run``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rlmesh
import rlmesh.numpy
from support import wire
from support.given_up import give_up_lane
from support.refserver import ServerConfig, ServerPool

from rlmesh_trio.client import probe
from rlmesh_trio.fleet import Fleet, FleetError, FleetRunResult

pytestmark = [pytest.mark.interop, pytest.mark.timeout(120)]

CARTPOLE_2 = ServerConfig(env_id="CartPole-v1", num_envs=2)
CARTPOLE_3 = ServerConfig(env_id="CartPole-v1", num_envs=3)


def _policy(obs: Any) -> Any:
    return (np.asarray(obs)[..., 2] > 0).astype(np.int64)


MODEL = rlmesh.numpy.Model(_policy)


def _key(episode: Any) -> tuple[Any, ...]:
    return (episode.seed, episode.steps, episode.reward, episode.terminated, episode.truncated)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def pair(servers: ServerPool) -> list[str]:
    """Two shared endpoints: CartPole x2 lanes and CartPole x3 lanes."""
    return [servers.get("ours", CARTPOLE_2).address, servers.get("ours", CARTPOLE_3).address]


@pytest.fixture(scope="module")
def reference(pair: list[str]) -> dict[int, tuple[Any, ...]]:
    """Seeds 0..19 run on one endpoint alone: what any shard must give back."""
    result = rlmesh.run(MODEL, pair[0], seeds=list(range(20)))
    return {e.seed: _key(e) for e in result.episodes}


def test_addresses_are_validated_and_normalized() -> None:
    fleet = Fleet.from_addresses(["127.0.0.1:5000", "tcp://127.0.0.1:5001", "5002"])
    assert fleet.addresses == [
        "tcp://127.0.0.1:5000",
        "tcp://127.0.0.1:5001",
        "tcp://127.0.0.1:5002",
    ]
    assert [e.state for e in fleet.endpoints] == ["restarting"] * 3  # not reached yet
    assert [e.num_envs for e in fleet.endpoints] == [None] * 3
    assert [e.index for e in fleet.endpoints] == [0, 1, 2]
    with pytest.raises(ValueError, match="at least one"):
        Fleet.from_addresses([])
    with pytest.raises(ValueError, match="duplicate"):
        Fleet.from_addresses(["127.0.0.1:5000", "tcp://127.0.0.1:5000"])
    with pytest.raises(ValueError, match="concrete port"):
        Fleet.from_addresses(["127.0.0.1:0"])
    with pytest.raises(ValueError, match="unsupported address scheme"):
        Fleet.from_addresses(["http://127.0.0.1:5000"])


def test_from_dns_names_the_statefulset_pods() -> None:
    fleet = Fleet.from_dns("rlmesh-envs", replicas=3, port=50051, namespace="rl")
    assert fleet.addresses == [
        f"tcp://rlmesh-envs-{i}.rlmesh-envs.rl.svc.cluster.local:50051" for i in range(3)
    ]
    assert fleet.endpoints[1].node == "rlmesh-envs-1.rlmesh-envs.rl.svc.cluster.local"
    default = Fleet.from_dns("envs", 1, 7000)
    assert default.addresses == ["tcp://envs-0.envs.default.svc.cluster.local:7000"]
    for bad in ({"replicas": 0}, {"port": 0}, {"port": 70000}, {"service": "a b"}):
        kwargs: dict[str, Any] = {"service": "envs", "replicas": 2, "port": 50051, **bad}
        with pytest.raises(ValueError):
            Fleet.from_dns(**kwargs)


def test_health_reports_each_endpoint_within_its_deadline(pair: list[str]) -> None:
    dead = f"127.0.0.1:{_free_port()}"
    with Fleet.from_addresses([*pair, dead]) as fleet:
        report = fleet.health(timeout_seconds=2.0)
        assert [h.serving for h in report] == [True, True, False]
        assert [h.status for h in report[:2]] == ["SERVING", "SERVING"]
        assert "unreachable" in (report[2].error or "")
        assert [e.num_envs for e in fleet.endpoints] == [2, 3, None]
        assert [e.state for e in fleet.endpoints] == ["serving", "serving", "restarting"]
        with pytest.raises(TimeoutError, match=dead.split(":")[1]):
            fleet.wait_ready(1.0, probe_timeout_seconds=0.5)
        with pytest.raises(ValueError):
            fleet.health(timeout_seconds=0)
    with pytest.raises(RuntimeError, match="closed"):
        fleet.health()


def test_run_merges_every_seed_exactly_once(
    pair: list[str], reference: dict[int, tuple[Any, ...]]
) -> None:
    seeds = [7, 3, 19, 0, 11, 5, 2, 13, 17, 1, 4]  # 11 seeds over 2 + 3 lanes: fillers
    with Fleet.from_addresses(pair) as fleet:
        fleet.wait_ready(30)
        result = fleet.run(MODEL, seeds=seeds)
    assert isinstance(result, FleetRunResult)
    assert [e.seed for e in result.episodes] == seeds
    assert [e.index for e in result.episodes] == list(range(len(seeds)))
    assert [_key(e) for e in result.episodes] == [reference[s] for s in seeds]
    assert {s.endpoint for s in result.shards} == {0, 1}
    for shard in result.shards:  # every shard in whole rounds of its endpoint's lanes
        assert len(shard.seeds) % (2 if shard.endpoint == 0 else 3) == 0
    assert result.discarded == sum(len(s.seeds) for s in result.shards) - len(seeds)
    assert result.num_episodes == len(seeds)
    assert result.total_steps == sum(reference[s][1] for s in seeds)
    real = result.as_run_result()
    assert isinstance(real, rlmesh.RunResult)
    assert real.episodes == result.episodes


def test_run_with_repeated_seeds_keeps_each_occurrence(pair: list[str]) -> None:
    with Fleet.from_addresses(pair) as fleet:
        result = fleet.run(MODEL, seeds=[4, 4, 9, 4])
    assert [e.seed for e in result.episodes] == [4, 4, 9, 4]
    assert len({_key(e) for e in result.episodes if e.seed == 4}) == 1


def test_run_forwards_user_hooks_once_per_kept_episode(pair: list[str]) -> None:
    class Hooks(rlmesh.RunHooks):  # type: ignore[misc]
        def __init__(self) -> None:
            self.ended: list[int] = []
            self.starts = 0
            self.run_end: list[Any] = []

        def on_run_start(self, context: Any) -> None:
            self.starts += 1

        def on_episode_end(self, result: Any) -> None:
            self.ended.append(result.index)

        def on_run_end(self, result: Any) -> None:
            self.run_end.append(result)

    hooks = Hooks()
    with Fleet.from_addresses(pair) as fleet:
        result = fleet.run(MODEL, seeds=list(range(7)), hooks=hooks)
    assert sorted(hooks.ended) == list(range(7))
    assert hooks.starts == len(result.shards)
    assert len(hooks.run_end) == 1 and hooks.run_end[0].episodes == result.episodes


def test_run_refuses_what_it_cannot_honour(pair: list[str]) -> None:
    with Fleet.from_addresses(pair) as fleet:
        for kwargs in ({"episodes": 3}, {"close_env": True}):
            with pytest.raises(TypeError):
                fleet.run(MODEL, seeds=[0, 1, 2], **kwargs)
        with pytest.raises(ValueError, match="trial_index_base"):
            fleet.run(MODEL, seeds=[0], trial_index_base=5)
        with pytest.raises(ValueError, match="seed"):
            fleet.run(MODEL, seeds=[0, -1])
        with pytest.raises(TypeError):
            fleet.run(MODEL, seeds=5)  # type: ignore[arg-type]
        assert fleet.run(MODEL, seeds=[]).episodes == ()
    with (
        Fleet.from_addresses(pair, auth_token="s3cret") as fleet,
        pytest.raises(FleetError, match="token"),
    ):
        fleet.run(MODEL, seeds=[0])


def test_killed_endpoint_its_unfinished_seeds_move_to_the_other(servers: ServerPool) -> None:
    victim = servers.fresh("ours", CARTPOLE_2)
    survivor = servers.fresh("ours", CARTPOLE_2)
    seeds = list(range(16))

    class KillOnSeed(rlmesh.RunHooks):  # type: ignore[misc]
        killed = False

        def on_episode_start(self, *, episode: int, seed: int | None) -> None:
            if seed == 3 and not self.killed:  # seeds 0-7 are the first endpoint's
                self.killed = True
                os.kill(victim.pid, signal.SIGKILL)

    hooks = KillOnSeed()
    with Fleet.from_addresses([victim.address, survivor.address]) as fleet:
        result = fleet.run(MODEL, seeds=seeds, hooks=hooks, recover_timeout_seconds=1.0)
        assert hooks.killed
        assert fleet.endpoints[0].state == "restarting"  # never came back: out of the run
        assert fleet.endpoints[1].state == "serving"
    assert [e.seed for e in result.episodes] == seeds
    failed = [s for s in result.shards if s.error is not None]
    assert [s.endpoint for s in failed] == [0]
    moved = [s for s in result.shards if s.error is None and set(s.seeds) & set(range(8))]
    assert moved and all(s.endpoint == 1 for s in moved)
    # Only what the killed run had not finished ran again (fillers aside).
    moved_seeds = {seed for s in moved for seed in s.seeds} & set(range(8))
    assert failed[0].kept == 8 - len(moved_seeds)
    assert len(result.retries) == 1 and result.retries[0].endpoint == 0
    # rlmesh.run lists episodes as they end (lanes race); the fleet's are in seed order.
    reference = {e.seed: _key(e) for e in rlmesh.run(MODEL, survivor.address, seeds=seeds).episodes}
    assert [_key(e) for e in result.episodes] == [reference[s] for s in seeds]


def hang_on_lane_1(marker: Path) -> ServerConfig:
    """CartPole x2 whose lane 1 hangs at the third step of every episode in the one
    process that claims ``marker`` (support.fleet_envs); the soak's flags: thread lanes,
    truncate, a short lane timeout, abandoned threads tolerated far beyond the hangs."""
    return ServerConfig(
        entrypoint="support.fleet_envs:make_hang_on_lane",
        num_envs=2,
        ours_args=(
            "--kwargs-json",
            json.dumps({"marker": str(marker)}),
            "--on-lane-fault",
            "truncate",
            "--lane-timeout-seconds",
            "0.2",
            "--max-abandoned-lanes",
            "64",
        ),
    )


def test_an_endpoint_whose_lane_is_given_up_is_reported_not_serving_and_left_out(
    servers: ServerPool, tmp_path: Path
) -> None:
    """The soak's endpoint: lane 1 hangs until the server gives it up (9 threads left
    behind, far fewer than --max-abandoned-lanes 64); every whole-vector request of that
    endpoint fails from then on. Its health says NOT_SERVING (before max_given_up_lanes
    it stayed SERVING and took its shards, every one of them failing), so the fleet
    reports it and runs on the other endpoint alone. A static fleet restarts nothing
    itself: its orchestrator does, on the same health (the Kubernetes recipe's probes);
    the Ray fleet's supervisor does, in tests/test_fleet_ray.py."""
    marker = tmp_path / "claimed"
    config = hang_on_lane_1(marker)
    lost, other = servers.fresh("ours", config), servers.fresh("ours", config)
    with Fleet.from_addresses([lost.address, other.address]) as fleet:
        fleet.wait_ready(30)
        refused = wire.run(give_up_lane(lost.address))
        assert refused.error is not None and not refused.error.is_recoverable, refused
        assert "lane 1 is given up" in refused.error.message, refused
        assert int(marker.read_text()) == lost.pid

        report = fleet.health()
        assert (report[0].serving, report[0].status) == (False, "NOT_SERVING")
        assert report[1].serving
        assert [e.state for e in fleet.endpoints] == ["restarting", "serving"]
        found = probe(lost.address, timeout_seconds=5.0)
        assert found.lane_states == ("serving", "dead") and not found.serving

        seeds = list(range(8))
        result = fleet.run(MODEL, seeds=seeds, recover_timeout_seconds=1.0)
        assert {s.endpoint for s in result.shards} == {1}
        assert result.retries == () and all(s.error is None for s in result.shards)
    reference = rlmesh.run(MODEL, other.address, seeds=seeds)
    assert [_key(e) for e in result.episodes] == [
        {e.seed: _key(e) for e in reference.episodes}[s] for s in seeds
    ]


def test_map_runs_shards_in_order_and_retries_failures(pair: list[str]) -> None:
    calls: list[tuple[str, int]] = []
    lock = threading.Lock()
    failed_once: set[int] = set()

    def fn(address: str, shard: int) -> int:
        with lock:
            calls.append((address, shard))
            fail = shard == 3 and shard not in failed_once
            failed_once.add(shard)
        if fail:
            raise ConnectionError("flaky")
        time.sleep(0.01)  # long enough for both endpoints to take shards
        return shard * shard

    with Fleet.from_addresses(pair) as fleet:
        assert fleet.map(fn, range(8)) == [i * i for i in range(8)]
        assert len(fleet.retries) == 1
        retry = fleet.retries[0]
        assert retry.units == 1 and retry.attempt == 1 and "flaky" in retry.error
        assert {address for address, _ in calls} == set(fleet.addresses)
        assert sorted(shard for _, shard in calls) == sorted([*range(8), 3])

        def always(address: str, shard: int) -> int:
            if shard == 1:
                raise RuntimeError("bad shard")
            return shard

        with pytest.raises(FleetError, match="bad shard") as caught:
            fleet.map(always, range(3), retries=1)
        assert caught.value.partial == [0, None, 2]
        assert len(caught.value.retries) == 1
        with pytest.raises(ValueError, match="retries"):
            fleet.map(always, [], retries=-1)


def test_map_with_no_endpoint_left_raises(servers: ServerPool) -> None:
    dead = [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"]
    with Fleet.from_addresses(dead) as fleet:
        with pytest.raises(FleetError, match="no endpoint left") as caught:
            fleet.map(lambda address, shard: shard, range(3), recover_timeout_seconds=0.5)
        assert caught.value.partial == [None, None, None]


def test_without_recording_a_failed_shard_runs_again_whole(servers: ServerPool) -> None:
    victim = servers.fresh("ours", CARTPOLE_2)
    survivor = servers.fresh("ours", CARTPOLE_2)
    gains = np.array([0.0, 0.0, 1.0, 0.5])  # full 500-step episodes: the run is long
    model = rlmesh.numpy.Model(lambda obs: (np.asarray(obs) @ gains > 0).astype(np.int64))
    seeds = list(range(8))
    # Whether the kill lands before or during the victim's run, none of its episodes
    # is known (no hooks), so all of its seeds run again on the survivor.
    timer = threading.Timer(0.3, os.kill, (victim.pid, signal.SIGKILL))
    with Fleet.from_addresses([victim.address, survivor.address]) as fleet:
        timer.start()
        try:
            result = fleet.run(
                model, seeds=seeds, record_episodes=False, recover_timeout_seconds=1.0
            )
        finally:
            timer.join()
    assert [e.seed for e in result.episodes] == seeds
    assert all(e.steps == 500 for e in result.episodes)
    (failed,) = [s for s in result.shards if s.error is not None]
    assert failed.endpoint == 0 and failed.kept == 0
    moved = {seed for s in result.shards if s.error is None and s.endpoint == 1 for seed in s.seeds}
    assert set(failed.seeds) <= moved


def test_without_recording_results_merge_the_same(
    pair: list[str], reference: dict[int, tuple[Any, ...]]
) -> None:
    with Fleet.from_addresses(pair) as fleet:
        result = fleet.run(MODEL, seeds=list(range(12)), record_episodes=False)
    assert [_key(e) for e in result.episodes] == [reference[s] for s in range(12)]


@pytest.mark.timeout(60)
def test_run_does_not_wait_for_a_down_endpoint_once_the_work_is_done(
    pair: list[str], reference: dict[int, tuple[Any, ...]]
) -> None:
    dead = f"127.0.0.1:{_free_port()}"
    with Fleet.from_addresses([dead, pair[0]]) as fleet:
        # recover_timeout_seconds far beyond the test's timeout: the run must end with the work.
        result = fleet.run(MODEL, seeds=[0, 1, 2, 3], recover_timeout_seconds=600.0)
        assert fleet.endpoints[0].state == "restarting"
    assert [_key(e) for e in result.episodes] == [reference[s] for s in range(4)]
    assert {s.endpoint for s in result.shards} == {1}


def test_cli_fleet_refuses_bad_arguments_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rlmesh_trio._cli import main

    base = ["fleet", "--env", "CartPole-v1"]
    assert main([*base]) == 2  # --endpoints is required
    assert main([*base, "--endpoints", "0"]) == 2
    assert main([*base, "--endpoints", "2", "--no-auth", "--auth-token", "x"]) == 2
    assert "contradicts" in capsys.readouterr().err
    assert main([*base, "--endpoints", "2", "--cpus-per-endpoint", "0"]) == 2
    assert main([*base, "--endpoints", "2", "--max-restarts", "-2"]) == 2
    assert main([*base, "--endpoints", "2", "--ready-fd", "987"]) == 2
    assert "--ready-fd 987" in capsys.readouterr().err
    assert main([*base, "--endpoints", "2", "--bind", "not a host"]) == 2
    assert "not a host" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("envs.example.org", False),
    ],
)
def test_the_ray_fleets_loopback_rule_is_the_addresses(host: str, loopback: bool) -> None:
    """``launch`` and ``rlmesh-trio fleet`` require a token beyond loopback by the same
    rule the server warns by: ``_address``'s, for a bare host as for an address."""
    from rlmesh_trio._address import is_loopback, is_loopback_host, parse_address

    assert is_loopback_host(host) is loopback
    shown = f"[{host}]" if ":" in host else host
    assert is_loopback(parse_address(f"tcp://{shown}:1")) is loopback


def _serving(index: int, num_envs: int | None) -> Any:
    from rlmesh_trio.fleet._records import Health

    return Health(index, f"tcp://127.0.0.1:{5000 + index}", True, "SERVING", num_envs=num_envs)


@pytest.mark.parametrize(
    ("lanes", "count", "tasks", "owners"),
    [
        # two endpoints of 2 and 1 lanes, 7 seeds: 3 rounds each, in order
        ([2, 1], 7, [[0, 1, 2, 3, 4, 5], [6]], [0, 1]),
        # fewer seeds than one round: the second endpoint gets nothing
        ([4, 4], 3, [[0, 1, 2]], [0]),
        # a Handshake not answered yet counts as one lane
        ([None, 2], 5, [[0, 1], [2, 3, 4]], [0, 1]),
        # none serving yet: one task, for whichever endpoint comes up first
        ([], 4, [[0, 1, 2, 3]], None),
    ],
)
def test_run_shards_seeds_in_whole_rounds_of_each_endpoints_lanes(
    lanes: list[int | None], count: int, tasks: list[list[int]], owners: list[int] | None
) -> None:
    from rlmesh_trio.fleet._run import shard

    serving = [_serving(i, n) for i, n in enumerate(lanes)]
    assert shard(serving, count) == (tasks, owners)
