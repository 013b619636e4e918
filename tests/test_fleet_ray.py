"""``rlmesh_trio.fleet.ray`` on a local Ray: launch, run, crash, wedge, death.

One Ray per module (it takes seconds to start): loopback only (node IP 127.0.0.1),
``num_cpus=2``, no dashboard; Ray's workers start at nice 15 and ``launch`` puts the
endpoints at 0 (asserted). Each test launches its own fleet
of K=2 endpoints x N=2 CartPole lanes with ``resources={"CPU": 0.5}``. No wall-clock
thresholds: the tests wait for events, under generous bounds, and log the timings.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Before Ray is imported: it reads them at import (the node IP then is 127.0.0.1).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ray = pytest.importorskip("ray")

import rlmesh  # noqa: E402
import rlmesh.numpy  # noqa: E402
import support.fleet_envs  # noqa: E402
from conftest import leaked_threads  # noqa: E402
from support import wire  # noqa: E402
from support.given_up import give_up_lane  # noqa: E402

from rlmesh_trio import ServeOptions  # noqa: E402
from rlmesh_trio.fleet import FleetRunResult  # noqa: E402
from rlmesh_trio.fleet.ray import RayFleet, launch  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

SEEDS = list(range(16))
FAST = {
    "resources": {"CPU": 0.5},
    "health_period_seconds": 0.5,
    "health_timeout_seconds": 1.0,
    "unhealthy_after": 2,
    "ready_timeout_seconds": 90.0,
}


def _policy(obs: Any) -> Any:
    # Deterministic and mediocre: episodes of 25-55 steps, so seeds give distinct results.
    return (np.asarray(obs)[..., 2] > 0).astype(np.int64)


MODEL = rlmesh.numpy.Model(_policy)


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray.cloudpickle.register_pickle_by_value(support.fleet_envs)
    began = time.monotonic()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    print(f"ray.init: {time.monotonic() - began:.1f} s")
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    """As the suite's check, but Ray's own driver threads (started lazily, kept until
    ``ray.shutdown``) are not ours: only the fleet's threads must be gone."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in leaked_threads(before, 5.0) if t.name.startswith("rlmesh")]
    assert not leaked, f"threads leaked by this test: {[t.name for t in leaked]}"


def _key(episode: Any) -> tuple[Any, ...]:
    return (episode.seed, episode.steps, episode.reward, episode.terminated, episode.truncated)


def _reference(fleet: RayFleet) -> dict[int, tuple[Any, ...]]:
    """The union of single-endpoint runs: seeds 0-7 on endpoint 0, 8-15 on endpoint 1."""
    union: dict[int, tuple[Any, ...]] = {}
    for index, seeds in ((0, SEEDS[:8]), (1, SEEDS[8:])):
        result = rlmesh.run(MODEL, fleet.addresses[index], seeds=seeds)
        for episode in result.episodes:
            assert episode.seed not in union
            union[episode.seed] = _key(episode)
    assert sorted(union) == SEEDS
    return union


def _check_exactly_once(result: FleetRunResult) -> None:
    assert [e.seed for e in result.episodes] == SEEDS
    assert [e.index for e in result.episodes] == list(range(len(SEEDS)))


class KillOnSeed(rlmesh.RunHooks):  # type: ignore[misc]
    """Kill endpoint ``index``'s process when the episode of ``seed`` starts (once)."""

    def __init__(self, fleet: RayFleet, index: int, seed: int) -> None:
        self.pid = fleet.info(index).pid
        self.seed = seed
        self.killed_at: float | None = None
        self.ended: list[int] = []

    def on_episode_start(self, *, episode: int, seed: int | None) -> None:
        if seed == self.seed and self.killed_at is None:
            self.killed_at = time.monotonic()
            os.kill(self.pid, signal.SIGKILL)

    def on_episode_end(self, result: Any) -> None:
        self.ended.append(result.seed)


def test_launch_run_equals_union_of_single_endpoint_runs() -> None:
    began = time.monotonic()
    with launch("CartPole-v1", endpoints=2, num_envs=2, bind="127.0.0.1", **FAST) as fleet:
        print(f"launch K=2 x N=2: {time.monotonic() - began:.2f} s")
        assert len(set(fleet.addresses)) == 2
        assert all(a.startswith("tcp://127.0.0.1:") for a in fleet.addresses)
        assert [h.serving for h in fleet.health()] == [True, True]
        assert [e.num_envs for e in fleet.endpoints] == [2, 2]
        assert [e.state for e in fleet.endpoints] == ["serving", "serving"]
        assert fleet.auth_token is None  # loopback: no token
        infos = [fleet.info(i) for i in range(2)]
        assert [i.niceness for i in infos] == [0, 0]
        assert len({i.pid for i in infos}) == 2
        assert all(i.pid != os.getpid() for i in infos)

        result = fleet.run(MODEL, seeds=SEEDS)
        _check_exactly_once(result)
        assert {s.endpoint for s in result.shards} == {0, 1}
        assert all(s.error is None for s in result.shards)
        assert result.retries == ()
        assert {e.seed: _key(e) for e in result.episodes} == _reference(fleet)
        assert fleet.stats().kills == 0
        with pytest.warns(DeprecationWarning, match=r"info\(timeout=\)"):
            assert fleet.info(0, timeout=30).pid == infos[0].pid  # the 0.1 keyword
        with pytest.warns(DeprecationWarning, match=r"restart\(timeout=\)"):
            restarted = fleet.restart(1, timeout=90)  # waits as timeout_seconds does
        assert restarted.pid != infos[1].pid
        assert [h.serving for h in fleet.health()] == [True, True]
        actors = [fleet.actor(i) for i in range(2)]
    # close() removed the actors
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.info.remote(), timeout=30)


def test_sigkill_mid_run_restarts_and_reruns_only_unfinished_seeds() -> None:
    with launch("CartPole-v1", endpoints=2, num_envs=2, bind="127.0.0.1", **FAST) as fleet:
        before = fleet.addresses[0]
        hooks = KillOnSeed(fleet, 0, seed=3)  # seeds 0-7 are endpoint 0's shard
        result = fleet.run(MODEL, seeds=SEEDS, hooks=hooks)
        assert hooks.killed_at is not None
        _check_exactly_once(result)
        assert sorted(hooks.ended) == SEEDS  # user hooks: one on_episode_end per seed

        failed = [s for s in result.shards if s.error is not None]
        assert len(failed) == 1
        assert failed[0].endpoint == 0
        assert "ConnectionError" in failed[0].error or "Error" in failed[0].error
        assert result.retries and result.retries[0].endpoint == 0
        # Only what the killed run had not finished ran again.
        rerun = [s for s in result.shards if s.error is None and set(s.seeds) & set(SEEDS[:8])]
        rerun_seeds = {seed for s in rerun for seed in s.seeds} - set(SEEDS[8:])
        finished_before = set(SEEDS[:8]) - rerun_seeds
        assert failed[0].kept == len(finished_before)
        assert rerun_seeds == set(SEEDS[:8]) - finished_before

        # The survivor may have finished the moved seeds before Ray had the killed
        # endpoint back: the run does not wait for it, the fleet follows it anyway.
        fleet.wait_ready(90)
        fleet.info(0)  # asks the actor: its new instance is counted as a restart
        endpoint = fleet.endpoints[0]
        assert endpoint.restarts >= 1
        assert endpoint.state == "serving"
        assert fleet.addresses[0] == before  # pinned port, same node
        assert fleet.stats().restarts >= 1
        assert {e.seed: _key(e) for e in result.episodes} == _reference(fleet)


def test_wedged_endpoint_is_detected_by_the_supervisor_and_restarted(tmp_path: Path) -> None:
    marker = tmp_path / "wedged"
    with launch(
        support.fleet_envs.make_wedge_once,
        endpoints=2,
        num_envs=2,
        env_kwargs={"marker": str(marker)},
        bind="127.0.0.1",
        **FAST,
    ) as fleet:
        pids = {fleet.info(i).pid: i for i in range(2)}
        began = time.monotonic()
        result = fleet.run(MODEL, seeds=SEEDS)
        print(f"run with a wedge: {time.monotonic() - began:.2f} s, stats {fleet.stats()}")
        assert marker.exists()
        wedged = pids[int(marker.read_text())]
        _check_exactly_once(result)
        fleet.wait_ready(90)
        fleet.info(wedged)
        stats = fleet.stats()
        assert stats.kills >= 1
        assert fleet.endpoints[wedged].restarts >= 1
        assert fleet.info(wedged).pid not in pids
        assert [e.state for e in fleet.endpoints] == ["serving", "serving"]
        assert any(s.error is not None and s.endpoint == wedged for s in result.shards)
        assert {e.seed: _key(e) for e in result.episodes} == _reference(fleet)


def test_an_endpoint_whose_lane_is_given_up_is_restarted_and_runs_resume(
    tmp_path: Path,
) -> None:
    """The soak's endpoint: lane 1 of endpoint 0 hangs until the server gives it up (9
    threads left behind; --max-abandoned-lanes 64 tolerates them all). Its health turns
    NOT_SERVING (max_given_up_lanes, default 0), so the supervisor kills it after
    ``unhealthy_after`` probes and Ray restarts it; a run over the fleet then gives
    what each endpoint gives alone (before the option it stayed SERVING, was never
    restarted, and every whole-vector run on it failed)."""
    marker = tmp_path / "claimed"
    options = ServeOptions(
        on_lane_fault="truncate", lane_timeout_seconds=0.2, max_abandoned_lanes=64
    )
    with launch(
        support.fleet_envs.make_hang_on_lane,
        endpoints=2,
        num_envs=2,
        env_kwargs={"marker": str(marker)},
        options=options,
        bind="127.0.0.1",
        **FAST,
    ) as fleet:
        pids = [fleet.info(i).pid for i in range(2)]
        began = time.monotonic()
        refused = wire.run(give_up_lane(fleet.addresses[0]))
        assert refused.error is not None and "lane 1 is given up" in refused.error.message
        assert int(marker.read_text()) == pids[0]
        fleet.wait_ready(90)  # NOT_SERVING until the supervisor had it restarted
        print(f"given up to serving again: {time.monotonic() - began:.2f} s, {fleet.stats()}")
        assert fleet.info(0).pid != pids[0]  # the restarted process never hangs
        assert fleet.info(1).pid == pids[1]
        assert fleet.stats().kills >= 1
        assert fleet.endpoints[0].restarts >= 1
        assert [e.state for e in fleet.endpoints] == ["serving", "serving"]
        result = fleet.run(MODEL, seeds=SEEDS)
        _check_exactly_once(result)
        assert {s.endpoint for s in result.shards} == {0, 1}
        assert result.retries == () and all(s.error is None for s in result.shards)
        assert {e.seed: _key(e) for e in result.episodes} == _reference(fleet)


def test_max_restarts_exhausted_endpoint_dead_and_its_shard_moved() -> None:
    fast = {**FAST, "max_restarts": 0}
    with launch("CartPole-v1", endpoints=2, num_envs=2, bind="127.0.0.1", **fast) as fleet:
        hooks = KillOnSeed(fleet, 1, seed=9)  # seeds 8-15 are endpoint 1's shard
        result = fleet.run(MODEL, seeds=SEEDS, hooks=hooks, recover_timeout_seconds=30.0)
        _check_exactly_once(result)
        assert fleet.endpoints[1].state == "dead"
        assert fleet.endpoints[0].state == "serving"
        assert fleet.stats().deaths == 1
        failed = [s for s in result.shards if s.error is not None]
        assert [s.endpoint for s in failed] == [1]
        moved = [s for s in result.shards if s.error is None and set(s.seeds) & set(SEEDS[8:])]
        assert moved and all(s.endpoint == 0 for s in moved)
        assert [h.status for h in fleet.health()][1] == "dead"
        fleet.wait_ready(10)  # the live endpoint serves; the dead one is not waited for
        reference = rlmesh.run(MODEL, fleet.addresses[0], seeds=SEEDS)
        assert {e.seed: _key(e) for e in result.episodes} == {
            e.seed: _key(e) for e in reference.episodes
        }


def test_launch_refuses_bad_arguments_and_reports_a_failing_env() -> None:
    with pytest.raises(ValueError, match="endpoints"):
        launch("CartPole-v1", endpoints=0, num_envs=1)
    with pytest.raises(ValueError, match="placement"):
        launch("CartPole-v1", endpoints=1, num_envs=1, placement="EVERYWHERE")
    with pytest.raises(RuntimeError, match="failed to start"):
        launch("NoSuchEnv-v9", endpoints=1, num_envs=1, bind="127.0.0.1", **FAST)


def test_token_generated_beyond_loopback_unless_refused() -> None:
    # On this machine the node IP is loopback; require_auth=True forces the token path.
    with launch(
        "CartPole-v1", endpoints=1, num_envs=1, bind="127.0.0.1", require_auth=True, **FAST
    ) as fleet:
        token = fleet.auth_token
        assert token and len(token) >= 32
        assert [h.serving for h in fleet.health()] == [True]  # the fleet sends it
        from rlmesh_trio.client import probe

        anonymous = probe(fleet.addresses[0], timeout_seconds=5.0)
        assert anonymous.health == "SERVING"  # health needs no token
        assert not anonymous.serving and "UNAUTHENTICATED" in (anonymous.error or "")
        with pytest.raises(Exception, match="token"):
            fleet.run(MODEL, seeds=[0])


def test_a_launched_fleet_serves_mtls_from_files_shipped_to_the_actors(
    tmp_path: Path,
) -> None:
    import trustme

    from rlmesh_trio.client import VectorEnv, probe

    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("probe@test")
    paths = {}
    for name, blob in (
        ("ca", ca.cert_pem),
        ("cert", server.cert_chain_pems[0]),
        ("key", server.private_key_pem),
        ("client", client.cert_chain_pems[0]),
        ("client_key", client.private_key_pem),
    ):
        paths[name] = str(tmp_path / f"{name}.pem")
        blob.write_to_path(paths[name])
    import ssl

    context = ssl.create_default_context(cafile=paths["ca"])
    context.load_cert_chain(paths["client"], paths["client_key"])
    with pytest.raises(ValueError, match="give tls= too"):
        launch(
            "CartPole-v1",
            endpoints=1,
            num_envs=1,
            bind="127.0.0.1",
            tls_cert_file=paths["cert"],
            tls_key_file=paths["key"],
            **FAST,
        )
    with launch(
        "CartPole-v1",
        endpoints=1,
        num_envs=2,
        bind="127.0.0.1",
        tls=context,
        tls_cert_file=paths["cert"],
        tls_key_file=paths["key"],
        tls_client_ca_file=paths["ca"],
        **FAST,
    ) as fleet:
        assert [h.serving for h in fleet.health()] == [True]  # the supervisor's probes too
        assert fleet.stats().failed_probes == 0
        address = fleet.addresses[0]
        assert not probe(address, tls=paths["ca"], timeout_seconds=5.0).serving  # no client cert
        env = VectorEnv(address, tls=fleet.tls)
        try:
            assert env.reset(seed=0)[0].shape == (2, 4)
        finally:
            env.close()


def _wait_cpus_free(expected: float, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        free = float(ray.available_resources().get("CPU", 0.0))
        if free >= expected or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def test_cli_fleet_prints_addresses_stays_up_and_stops_on_ctrl_c() -> None:
    import select
    import subprocess
    import sys

    from rlmesh_trio.fleet import Fleet

    assert _wait_cpus_free(2.0) == 2.0  # earlier fleets gave their bundles back
    read_fd, write_fd = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlmesh_trio",
            "fleet",
            "--env",
            "CartPole-v1",
            "--endpoints",
            "2",
            "--num-envs",
            "2",
            "--cpus-per-endpoint",
            "0.5",
            "--bind",
            "127.0.0.1",
            "--ray-address",
            ray.get_runtime_context().gcs_address,
            "--ready-fd",
            str(write_fd),
        ],
        pass_fds=(write_fd,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(write_fd)
    try:
        data = b""
        deadline = time.monotonic() + 120
        with os.fdopen(read_fd, "rb") as ready:
            while time.monotonic() < deadline:
                readable, _, _ = select.select([ready], [], [], 1.0)
                if readable:
                    chunk = os.read(ready.fileno(), 4096)
                    if not chunk:
                        break
                    data += chunk
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        addresses = data.decode().split()
        assert len(addresses) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in addresses)
        with Fleet.from_addresses(addresses) as fleet:
            fleet.wait_ready(30)
            result = fleet.run(MODEL, seeds=[0, 1, 2, 3])
            assert [e.seed for e in result.episodes] == [0, 1, 2, 3]
        assert free_while_up() < 2.0
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    assert out.decode().split() == addresses  # the addresses, one per line, on stdout
    assert b"stopping the fleet" in err
    assert _wait_cpus_free(2.0) == 2.0  # the fleet's actors and placement group are gone


def free_while_up() -> float:
    return float(ray.available_resources().get("CPU", 0.0))


LOUD_SCRIPT = """
import json, sys
import ray
import support.fleet_envs as envs
ray.cloudpickle.register_pickle_by_value(envs)
from rlmesh_trio.client import probe
from rlmesh_trio.fleet.ray import kill_process, launch, ray_output_to_stderr, resolve_bind

with ray_output_to_stderr() as out:
    fleet = launch(  # no bind=, no Ray running: launch starts a local one
        envs.make_loud,
        env_kwargs={"marker": sys.argv[1]},
        endpoints=1,
        num_envs=1,
        resources={"CPU": 0.5},
        health_period_seconds=0.5,
        health_timeout_seconds=1.0,
        unhealthy_after=2,
        ready_timeout_seconds=90.0,
    )
    with fleet:
        anonymous = probe(fleet.addresses[0], timeout_seconds=5.0)  # no token sent
        row = {
            "addresses": fleet.addresses,
            "auth_token": fleet.auth_token,
            "serving": anonymous.serving,
            "auto": resolve_bind(),
        }
        print(json.dumps(row), file=out, flush=True)
        print("a stray print of the driver", flush=True)
        kill_process(fleet, 0)  # Ray tells the driver a worker died
        fleet.wait_ready(90)
        sys.stdin.readline()  # until the test has seen what it waits for on stderr
    ray.shutdown()
"""


def test_the_default_path_binds_loopback_with_no_token_and_keeps_stdout_clean() -> None:
    """A user's first launch: no Ray running, no ``bind``. The endpoints are on
    127.0.0.1 and take no token; stdout carries only the program's own line, while
    the endpoint's output (its env prints, before and after a crash) and Ray's own
    lines reach stderr."""
    import subprocess
    import sys
    import uuid

    marker = f"loud-env-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "RAY_ADDRESS": "local",  # a new local Ray, never one of another test or user
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    seen = threading.Event()
    err_lines: list[str] = []
    with subprocess.Popen(
        [sys.executable, "-c", LOUD_SCRIPT, marker],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=Path(__file__).parent,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None

        def read_stderr() -> None:
            assert proc.stderr is not None
            for raw in proc.stderr:
                err_lines.append(raw.decode(errors="replace"))
                # The env is built twice: at launch, and again after the kill.
                if sum(marker in line for line in err_lines) >= 2:
                    seen.set()

        reader = threading.Thread(target=read_stderr, name="test-stderr", daemon=True)
        reader.start()
        try:
            assert seen.wait(150), "".join(err_lines[-40:])
            proc.stdin.write(b"\n")
            proc.stdin.flush()
            out = proc.stdout.read()
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            reader.join(10)
    assert proc.returncode == 0, "".join(err_lines[-40:])
    lines = out.decode().splitlines()
    assert len(lines) == 1, lines  # nothing of Ray's, nothing of the endpoint's
    row = json.loads(lines[0])
    assert all(a.startswith("tcp://127.0.0.1:") for a in row["addresses"])
    assert row["auth_token"] is None and row["serving"] is True
    assert row["auto"] == "127.0.0.1"
    stderr = "".join(err_lines)
    ray_lines = [line for line in err_lines if "(raylet)" in line or "pid=" in line]
    print(f"Ray's lines, all on stderr: {len(ray_lines)}", *ray_lines[:5], sep="\n")
    assert "a stray print of the driver" in stderr
    assert marker in stderr
