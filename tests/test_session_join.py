"""The sans-IO Join session: events in, actions out. No loop, no thread, no socket."""

from __future__ import annotations

import itertools
from typing import Any

import gymnasium as gym
import numpy as np
import outcome
import pytest

from rlmesh_trio._codec import Candidate, SpaceCodec, from_meta_map, to_meta_map
from rlmesh_trio._errors import ActionError, InvalidRequestError, LaneError, PolicyViolation
from rlmesh_trio._jobs import (
    EnvContract,
    LaneFault,
    LaneReply,
    Phases,
    RenderJob,
    RenderResult,
    ResetJob,
    ResetResult,
    StepJob,
    StepResult,
)
from rlmesh_trio._proto.rlmesh.core import v1 as core_v1
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1
from rlmesh_trio._proto.rlmesh.spaces import v1 as spaces_v1
from rlmesh_trio._session import (
    CancelTimer,
    Endpoint,
    EndStream,
    Post,
    Report,
    Send,
    Session,
    StartTimer,
    Wedged,
)
from rlmesh_trio._session._results import CONFORMANCE_KEY

Code = env_v1.EnvErrorCode

OBS = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
ACT = gym.spaces.Discrete(2)


def make_contract() -> EnvContract:
    return EnvContract(
        env_id="Fake-v0",
        action_space=ACT,
        observation_space=OBS,
        action_codec=SpaceCodec(ACT),
        observation_codec=SpaceCodec(OBS),
        metadata=to_meta_map({"render_fps": 4}),
        render_mode="",
    )


class _Driven:
    """A session whose Post actions are performed (as the transport's Join driver does):
    the job is kept for the test to answer, or refused at once for a lane that does not
    exist; what is left are the actions the transport would see."""

    def __init__(self, session: Session, harness: Harness) -> None:
        self._session = session
        self._harness = harness

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._session, name)
        if name.startswith("on_") and callable(attr):

            def event(*args: Any) -> list[Any]:
                return self._harness.perform(attr(*args))

            return event
        return attr


class Harness:
    """A session wired to fake lanes: posted jobs are kept for the test to answer."""

    def __init__(self, num_envs: int = 1, **endpoint_kwargs: Any) -> None:
        self.endpoint = Endpoint(make_contract(), num_envs, **endpoint_kwargs)
        self.posted: list[tuple[int, Any]] = []
        self.reports: list[Report] = []
        self.num_envs = num_envs
        self.clock = itertools.count(1_000, 1_000)
        self.session: Any = _Driven(
            Session(
                self.endpoint,
                clock_ns=lambda: next(self.clock),
                wall_ns=lambda: 1_700_000_000_000_000_000,
            ),
            self,
        )

    def perform(self, actions: list[Any]) -> list[Any]:
        left: list[Any] = []
        for act in actions:
            if isinstance(act, Report):
                self.reports.append(act)
            elif not isinstance(act, Post):
                left.append(act)
            elif act.lane >= self.num_envs:
                error = LaneError(f"lane {act.lane} out of range for {self.num_envs} lanes")
                refusal = LaneReply(act.job.id, act.lane, outcome.Error(error), Phases())
                left.extend(self.session.on_lane_reply(refusal))
            else:
                self.posted.append((act.lane, act.job))
        return left

    def request(self, **kind: Any) -> list[Any]:
        rid = kind.pop("request_id", "r")
        return self.session.on_request(env_v1.JoinRequest(request_id=rid, **kind))

    def take(self) -> list[tuple[int, Any]]:
        jobs, self.posted = self.posted, []
        return jobs

    def answer(self, lane: int, job: Any, value: Any, phases: Phases | None = None) -> list[Any]:
        result = value if isinstance(value, outcome.Outcome) else outcome.Value(value)
        return self.session.on_lane_reply(
            LaneReply(job.id, lane, result, phases or Phases(1, 2, 30, 4))
        )


def obs_leaf(*values: float) -> list[bytes]:
    return [np.asarray(values, dtype=np.float32).tobytes()]


def reset_result(x: float = 0.0, **info: Any) -> ResetResult:
    return ResetResult(observation=obs_leaf(x, x), info=to_meta_map(info), obs_warning=None)


def step_result(
    x: float = 0.5,
    reward: float = 1.0,
    terminated: bool = False,
    truncated: bool = False,
    action_warning: Candidate | None = None,
    obs_warning: Candidate | None = None,
    **info: Any,
) -> StepResult:
    return StepResult(
        observation=obs_leaf(x, x),
        reward=reward,
        terminated=terminated,
        truncated=truncated,
        info=to_meta_map(info),
        action_warning=action_warning,
        obs_warning=obs_warning,
    )


def action(*values: int) -> spaces_v1.SpaceValue:
    return spaces_v1.SpaceValue(leaves=[np.asarray(values, dtype=np.int64).tobytes()])


def sends(actions: list[Any]) -> list[env_v1.JoinResponse]:
    return [a.response for a in actions if isinstance(a, Send)]


def only(actions: list[Any]) -> env_v1.JoinResponse:
    responses = sends(actions)
    assert len(responses) == 1, actions
    return responses[0]


def error_of(actions: list[Any]) -> tuple[Code, str, bool]:
    err = only(actions).error
    assert err is not None
    return err.code, err.message, err.is_recoverable


# ----------------------------------------------------------------- handshake / shutdown


def test_handshake_compatible_carries_contract() -> None:
    endpoint = Endpoint(make_contract(), 3)
    req = env_v1.HandshakeRequest(
        base=core_v1.HandshakeRequest(protocol_generation="rlmesh-wire-v1")
    )
    resp = endpoint.handshake(req)
    assert resp.base is not None and resp.base.compatible
    assert resp.base.capabilities == {"subset_step": "true"}
    assert resp.base.supported_workflow_editions == ["2026.06"]
    assert resp.base.preferred_workflow_edition == "2026.06"
    assert resp.base.error_message is None
    contract = resp.env_contract
    assert contract is not None and contract.num_envs == 3
    assert contract.autoreset_mode == core_v1.AutoresetMode.DISABLED
    assert contract.spec is not None and contract.spec.id == "Fake-v0"
    assert from_meta_map(contract.spec.metadata) == {"render_fps": 4}


@pytest.mark.parametrize("generation", ["", "rlmesh-wire-v2"])
def test_handshake_mismatch_is_an_answer(generation: str) -> None:
    endpoint = Endpoint(make_contract(), 1)
    req = env_v1.HandshakeRequest(base=core_v1.HandshakeRequest(protocol_generation=generation))
    resp = endpoint.handshake(req)
    assert resp.base is not None and not resp.base.compatible
    assert resp.base.error_message == (
        f"protocol generation {generation} not compatible with server rlmesh-wire-v1"
    )
    assert resp.env_contract is None
    # compatible=false is omitted on the wire
    assert b"\x08\x01" not in bytes(resp.base)[:2]


def test_handshake_and_shutdown_missing_base() -> None:
    endpoint = Endpoint(make_contract(), 1)
    with pytest.raises(InvalidRequestError, match=r"^handshake request missing base$"):
        endpoint.handshake(env_v1.HandshakeRequest())
    with pytest.raises(InvalidRequestError, match=r"^shutdown request missing base$"):
        endpoint.shutdown(env_v1.ShutdownRequest())


def test_shutdown_refused_and_accepted() -> None:
    req = env_v1.ShutdownRequest(base=core_v1.ShutdownRequest(reason="done"))
    refused, stop = Endpoint(make_contract(), 1).shutdown(req)
    assert not stop and refused.base is not None and not refused.base.accepted
    assert refused.base.message == "remote shutdown is disabled for this environment endpoint"
    allowed = Endpoint(make_contract(), 1, allow_remote_shutdown=True)
    accepted, stop = allowed.shutdown(req)
    assert stop and accepted.base is not None and accepted.base.accepted
    assert accepted.base.message == "shutdown accepted: done"
    bare, _ = allowed.shutdown(env_v1.ShutdownRequest(base=core_v1.ShutdownRequest()))
    assert bare.base is not None and bare.base.message == "shutdown accepted"


# ----------------------------------------------------------------- configure / unknown


@pytest.mark.parametrize("edition", ["2026.06", "", "2026.06-dev.abc"])
def test_configure_accepted(edition: str) -> None:
    h = Harness()
    resp = only(h.request(request_id="c", configure=env_v1.ConfigureEnvRequest(edition)))
    assert resp.request_id == "c" and resp.configure is not None
    assert b"\x3a\x00" in bytes(resp)  # configure {} is on the wire even though empty
    assert resp.endpoint_total_ns and resp.user_ns is None


def test_configure_unknown_edition_ends_stream() -> None:
    h = Harness()
    actions = h.request(configure=env_v1.ConfigureEnvRequest("1999.01"))
    assert error_of(actions) == (
        Code.INVALID_ACTION,
        'runtime pinned this env to workflow edition "1999.01", which this env build does not '
        'implement (implements ["2026.06"])',
        False,
    )
    assert isinstance(actions[-1], EndStream)
    assert h.request(reset=env_v1.ResetRequest()) == []
    assert h.session.finished


def test_unknown_kind_is_recoverable() -> None:
    h = Harness()
    actions = h.session.on_request(env_v1.JoinRequest(request_id="x"))
    assert error_of(actions) == (
        Code.UNSUPPORTED,
        "empty or unrecognized Join request (a newer-edition arm this build does not implement?)",
        True,
    )
    assert not any(isinstance(a, EndStream) for a in actions)
    resp = only(actions)
    assert resp.endpoint_total_ns and resp.decode_ns is None and resp.queue_ns is None


# ----------------------------------------------------------------- reset / step


def test_whole_reset_seeds_and_infos_on_two_lanes() -> None:
    h = Harness(2)
    assert h.request(reset=env_v1.ResetRequest(seeds=[5], episode_ids=["a", "b", "c"])) == []
    jobs = h.take()
    assert [lane for lane, _ in jobs] == [0, 1]
    assert [job.seed for _, job in jobs] == [5, None]
    assert all(isinstance(job, ResetJob) and job.options is None for _, job in jobs)
    assert h.answer(1, jobs[1][1], reset_result(0.25, lane=1)) == []
    resp = only(h.answer(0, jobs[0][1], reset_result(0.5, lane=0)))
    assert resp.reset is not None
    assert resp.reset.observation is not None
    assert resp.reset.observation.leaves == [np.array([0.5, 0.5, 0.25, 0.25], np.float32).tobytes()]
    assert from_meta_map(resp.reset.infos) == {
        "final_info": [{"lane": 0}, {"lane": 1}],
        "_final_info": [True, True],
    }
    assert resp.lane_skew_ns == 0  # two lanes, both took 30 ns of user time
    assert resp.user_ns == 30 and resp.encode_ns == 8 and resp.queue_ns == 1


def test_reset_options_reach_every_lane() -> None:
    h = Harness(2)
    options = to_meta_map({"difficulty": 3, "name": "x"})
    h.request(reset=env_v1.ResetRequest(options=options, env_indices=[1]))
    ((lane, job),) = h.take()
    assert lane == 1 and job.options == {"difficulty": 3, "name": "x"}


def test_one_lane_endpoint_step_passes_infos_through() -> None:
    h = Harness(1)
    h.request(reset=env_v1.ResetRequest())
    h.answer(0, h.take()[0][1], reset_result())
    h.request(request_id="s", step=env_v1.StepRequest(action=action(1)))
    ((_lane, job),) = h.take()
    assert isinstance(job, StepJob) and (job.n, job.row, job.validated) == (1, 0, False)
    resp = only(h.answer(0, job, step_result(t=1)))
    assert resp.request_id == "s" and resp.step is not None
    assert resp.step.rewards == [1.0]
    assert resp.step.terminated_mask == b"\x00" and resp.step.truncated_mask == b"\x00"
    assert from_meta_map(resp.step.infos) == {"t": 1}
    assert resp.step.env_indices == []
    assert resp.decode_ns == 2 and resp.lane_skew_ns is None


def test_lane_scoped_steps_answer_out_of_order() -> None:
    h = Harness(3)
    h.request(request_id="a", step=env_v1.StepRequest(action=action(1), env_indices=[2]))
    h.request(request_id="b", step=env_v1.StepRequest(action=action(0), env_indices=[0]))
    jobs = h.take()
    assert [lane for lane, _ in jobs] == [2, 0]  # both posted at once
    first = only(h.answer(0, jobs[1][1], step_result()))
    assert first.request_id == "b" and first.step is not None and first.step.env_indices == [0]
    second = only(h.answer(2, jobs[0][1], step_result()))
    assert second.request_id == "a" and second.step is not None and second.step.env_indices == [2]


def test_lane_scoped_multi_lane_step_validates_first_and_echoes_order() -> None:
    h = Harness(3)
    h.request(request_id="s", step=env_v1.StepRequest(action=action(1, 0), env_indices=[2, 0]))
    jobs = h.take()
    assert [(lane, job.row, job.n, job.validated) for lane, job in jobs] == [
        (2, 0, 2, True),
        (0, 1, 2, True),
    ]
    h.answer(0, jobs[1][1], step_result(0.0, reward=2.0, terminated=True), Phases(5, 0, 10, 1))
    resp = only(h.answer(2, jobs[0][1], step_result(1.0, reward=3.0), Phases(7, 0, 40, 1)))
    assert resp.step is not None
    assert resp.step.env_indices == [2, 0]
    assert resp.step.rewards == [3.0, 2.0]
    assert resp.step.terminated_mask == b"\x00\x01"
    assert from_meta_map(resp.step.infos)["_final_info"] == [False, True]
    assert resp.lane_skew_ns == 30 and resp.user_ns == 40 and resp.queue_ns == 7


def test_bad_row_rejects_the_whole_step_before_any_lane_runs() -> None:
    h = Harness(2)
    actions = h.request(step=env_v1.StepRequest(action=action(0, 5)))
    assert error_of(actions) == (Code.INVALID_ACTION, "$: value 5 not in range [0, 2)", True)
    assert h.take() == []


@pytest.mark.parametrize(
    ("leaves", "message"),
    [
        ([b"\x00" * 4], "length mismatch: slab: got 4 bytes, expected 2 lanes * 8"),
        ([b"\x00" * 16, b""], "length mismatch: got 2 leaf slabs, spec expects 1"),
    ],
)
def test_multi_lane_slab_errors(leaves: list[bytes], message: str) -> None:
    h = Harness(2)
    actions = h.request(step=env_v1.StepRequest(action=spaces_v1.SpaceValue(leaves=leaves)))
    assert error_of(actions) == (Code.INVALID_ACTION, message, True)


def test_step_without_action() -> None:
    h = Harness(1)
    assert error_of(h.request(step=env_v1.StepRequest())) == (
        Code.INVALID_ACTION,
        "expected 1 actions, got 0",
        True,
    )


def test_one_lane_action_error_comes_back_from_the_lane() -> None:
    h = Harness(1)
    h.request(step=env_v1.StepRequest(action=action(7)))
    ((_lane, job),) = h.take()
    failure = outcome.Error(ActionError("$: value 7 not in range [0, 2)"))
    actions = h.answer(0, job, failure)
    assert error_of(actions) == (Code.INVALID_ACTION, "$: value 7 not in range [0, 2)", True)
    assert not any(isinstance(a, EndStream) for a in actions)


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        (dict(env_indices=[0, 0]), "partial reset: duplicate env_index 0"),
        (dict(env_indices=[2]), "partial reset: env_index 2 out of range for num_envs 2"),
        (
            dict(env_indices=[0], seeds=[1, 2]),
            "partial reset: seeds length 2 does not match env_indices length 1 (provide one seed "
            "per reset lane, or none)",
        ),
        (
            dict(env_indices=[0, 1], episode_ids=["x"]),
            "partial reset: episode_ids length 1 does not match env_indices length 2 (provide one "
            "episode id per reset lane, or none)",
        ),
    ],
)
def test_partial_reset_validation(request_kwargs: dict[str, Any], message: str) -> None:
    h = Harness(2)
    actions = h.request(reset=env_v1.ResetRequest(**request_kwargs))
    assert error_of(actions) == (Code.INVALID_ACTION, message, True)
    assert h.take() == []


@pytest.mark.parametrize(
    ("indices", "message"),
    [
        ([0, 0], "subset step: duplicate env_index 0"),
        ([5], "subset step: env_index 5 out of range for num_envs 2"),
        ([4294967295], "subset step: env_index 4294967295 out of range for num_envs 2"),
    ],
)
def test_subset_step_validation(indices: list[int], message: str) -> None:
    h = Harness(2)
    actions = h.request(step=env_v1.StepRequest(action=action(0), env_indices=indices))
    assert error_of(actions) == (Code.INVALID_ACTION, message, True)


# ----------------------------------------------------------------- barriers


def test_whole_op_waits_for_lane_ops_and_blocks_later_requests() -> None:
    h = Harness(2)
    h.request(request_id="lane", step=env_v1.StepRequest(action=action(0), env_indices=[1]))
    lane_job = h.take()[0][1]
    # a serial request must wait for the in-flight lane op
    assert h.request(request_id="whole", reset=env_v1.ResetRequest()) == []
    # and so must everything after it, even lane-scoped requests and configure
    assert (
        h.request(request_id="later", step=env_v1.StepRequest(action=action(0), env_indices=[0]))
        == []
    )
    assert h.request(request_id="cfg", configure=env_v1.ConfigureEnvRequest()) == []
    assert h.take() == []
    assert h.session.busy
    actions = h.answer(1, lane_job, step_result())
    assert [r.request_id for r in sends(actions)] == ["lane"]
    reset_jobs = h.take()
    assert [lane for lane, _ in reset_jobs] == [0, 1]  # the whole reset is now posted, alone
    h.answer(0, reset_jobs[0][1], reset_result())
    actions = h.answer(1, reset_jobs[1][1], reset_result())
    # after its reply the next request is read: a lane-scoped step, then configure must wait
    assert [r.request_id for r in sends(actions)] == ["whole"]
    later = h.take()
    assert [lane for lane, _ in later] == [0]
    actions = h.answer(0, later[0][1], step_result())
    assert [r.request_id for r in sends(actions)] == ["later", "cfg"]
    assert not h.session.busy


# ----------------------------------------------------------------- episodes


def test_episode_accounting_completion_and_idle_steps() -> None:
    h = Harness(1)
    h.request(reset=env_v1.ResetRequest(seeds=[42], episode_ids=["ep"]))
    h.answer(0, h.take()[0][1], reset_result())
    for reward in (1.0, 2.0):
        h.request(step=env_v1.StepRequest(action=action(0)))
        resp = only(h.answer(0, h.take()[0][1], step_result(reward=reward)))
        assert resp.step is not None and resp.step.completed_episodes == []
    h.request(step=env_v1.StepRequest(action=action(0)))
    resp = only(h.answer(0, h.take()[0][1], step_result(reward=0.5, terminated=True, why="pole")))
    assert resp.step is not None
    (ep,) = resp.step.completed_episodes
    assert (ep.episode_id, ep.seed, ep.env_index, ep.step_count) == ("ep", 42, 0, 3)
    assert ep.cumulative_reward == 3.5 and ep.terminated and not ep.truncated
    assert from_meta_map(ep.final_info) == {"why": "pole"}
    assert ep.start_timestamp_ns and ep.end_timestamp_ns
    # stepping the finished lane reaches the env but records nothing
    h.request(step=env_v1.StepRequest(action=action(0)))
    resp = only(h.answer(0, h.take()[0][1], step_result(terminated=True)))
    assert resp.step is not None and resp.step.completed_episodes == []
    # natural completion with an empty info still carries an (empty) final_info
    h.request(reset=env_v1.ResetRequest())
    h.answer(0, h.take()[0][1], reset_result())
    h.request(step=env_v1.StepRequest(action=action(0)))
    resp = only(h.answer(0, h.take()[0][1], step_result(truncated=True)))
    assert resp.step is not None
    (ep,) = resp.step.completed_episodes
    assert ep.seed is None and ep.episode_id == "" and ep.truncated
    assert ep.final_info is not None and from_meta_map(ep.final_info) == {}


def test_interrupted_episode_surfaces_on_next_step_of_any_lane_then_close() -> None:
    h = Harness(2)
    h.request(reset=env_v1.ResetRequest(seeds=[1, 2], episode_ids=["a", "b"]))
    for lane, job in h.take():
        h.answer(lane, job, reset_result())
    # reset lane 1 again: its episode "b" is interrupted, not reported in the reset reply
    h.request(reset=env_v1.ResetRequest(env_indices=[1], episode_ids=["b2"]))
    resp = only(h.answer(1, h.take()[0][1], reset_result()))
    assert resp.reset is not None
    # the next step reply, here for lane 0 only, reports it
    h.request(step=env_v1.StepRequest(action=action(0), env_indices=[0]))
    resp = only(h.answer(0, h.take()[0][1], step_result()))
    assert resp.step is not None
    (ep,) = resp.step.completed_episodes
    assert (ep.episode_id, ep.seed, ep.env_index, ep.truncated, ep.final_info) == (
        "b",
        2,
        1,
        True,
        None,
    )
    # close reports the active ones, truncated, with their counts
    actions = h.request(request_id="bye", close=env_v1.CloseEnvsRequest(reason="client close"))
    assert isinstance(actions[-1], EndStream)
    resp = only(actions)
    assert resp.close is not None
    got = sorted(
        (e.episode_id, e.env_index, e.step_count, e.truncated) for e in resp.close.final_episodes
    )
    assert got == [("a", 0, 1, True), ("b2", 1, 0, True)]
    assert h.request(reset=env_v1.ResetRequest()) == []  # after Close nothing is answered


def test_close_without_episodes_is_still_a_close_reply() -> None:
    h = Harness(1)
    actions = h.request(close=env_v1.CloseEnvsRequest())
    resp = only(actions)
    assert resp.close is not None and resp.close.final_episodes == []
    assert b"\x22\x00" in bytes(resp)


def test_stream_end_drops_records() -> None:
    h = Harness(1)
    h.request(reset=env_v1.ResetRequest(episode_ids=["x"]))
    job = h.take()[0][1]
    assert h.session.on_stream_end() == []
    assert h.answer(0, job, reset_result()) == []
    assert not h.session.busy and h.session.finished


# ----------------------------------------------------------------- failures


def test_env_exception_on_serial_request_ends_stream() -> None:
    h = Harness(2)
    h.request(step=env_v1.StepRequest(action=action(0, 1)))
    jobs = h.take()
    h.answer(0, jobs[0][1], step_result())
    actions = h.answer(1, jobs[1][1], outcome.Error(RuntimeError("boom in step")))
    assert error_of(actions) == (Code.INTERNAL, "step failed: RuntimeError: boom in step", False)
    assert isinstance(actions[-1], EndStream)
    assert only(actions).user_ns is None  # errors carry only endpoint_total_ns


def test_env_exception_on_lane_request_keeps_stream() -> None:
    h = Harness(2)
    h.request(reset=env_v1.ResetRequest(seeds=[666], env_indices=[0]))
    actions = h.answer(0, h.take()[0][1], outcome.Error(ValueError("boom in reset (seed 666)")))
    assert error_of(actions) == (
        Code.INTERNAL,
        "reset failed: ValueError: boom in reset (seed 666)",
        False,
    )
    assert not any(isinstance(a, EndStream) for a in actions)
    assert only(h.request(configure=env_v1.ConfigureEnvRequest())).configure is not None


def test_policy_violations_map_by_kind() -> None:
    h = Harness(1)
    h.request(step=env_v1.StepRequest(action=action(0)))
    detail = "$: Box value at element 0 out of bounds: above high bound"
    actions = h.answer(0, h.take()[0][1], outcome.Error(PolicyViolation(detail, "action")))
    assert error_of(actions) == (Code.INVALID_ACTION, detail, True)
    h.request(step=env_v1.StepRequest(action=action(0)))
    actions = h.answer(0, h.take()[0][1], outcome.Error(PolicyViolation(detail)))
    assert error_of(actions) == (Code.INTERNAL, detail, False)


def test_render_rules() -> None:
    h = Harness(2)
    assert error_of(h.request(render=env_v1.RenderRequest(env_indices=[0, 1]))) == (
        Code.UNSUPPORTED,
        "render requests support at most one env_index",
        True,
    )
    assert error_of(h.request(render=env_v1.RenderRequest(env_indices=[1]))) == (
        Code.INVALID_ACTION,
        "single-env render only supports env_index 0, got 1",
        True,
    )
    h.request(request_id="png", render=env_v1.RenderRequest())
    ((lane, job),) = h.take()
    assert lane == 0 and isinstance(job, RenderJob)
    resp = only(h.answer(0, job, RenderResult(frame=b"\x89PNG...")))
    assert resp.render is not None
    assert resp.render.frame == b"\x89PNG..." and resp.render.format == env_v1.RenderFormat.PNG
    assert resp.decode_ns is None and resp.user_ns == 30
    h.request(render=env_v1.RenderRequest())
    resp = only(h.answer(0, h.take()[0][1], RenderResult(frame=None)))
    assert resp.render is not None and resp.render.frame is None
    assert bytes(resp.render) == b""


@pytest.mark.parametrize(("num_envs", "index"), [(1, 1), (2, 3)])
def test_render_out_of_range_is_fatal(num_envs: int, index: int) -> None:
    h = Harness(num_envs)
    actions = h.request(render=env_v1.RenderRequest(env_indices=[index]))
    message = f"lane {index} out of range for {num_envs} lanes"
    assert error_of(actions) == (Code.INTERNAL, message, False)
    assert isinstance(actions[-1], EndStream)


# ----------------------------------------------------------------- deadlines


def test_failures_and_refusals_are_reported_for_the_log() -> None:
    """Report actions: an env failure with its exception (lane, verb, request id), a
    refused request, a timeout; the wire sees none of them."""
    h = Harness(2)
    h.request(request_id="s1", step=env_v1.StepRequest(action=action(0, 1)))
    jobs = h.take()
    boom = RuntimeError("boom in step")
    h.answer(0, jobs[0][1], step_result())
    h.answer(1, jobs[1][1], outcome.Error(boom))
    (fault,) = h.reports
    assert (fault.kind, fault.verb, fault.request_id, fault.lanes) == ("fault", "step", "s1", (1,))
    assert fault.code == Code.INTERNAL and fault.error is boom
    h = Harness(2)
    h.request(request_id="bad", step=env_v1.StepRequest(action=action(0), env_indices=[7]))
    h.session.on_request(env_v1.JoinRequest())  # no kind at all
    kinds = [(r.kind, r.verb, r.request_id, r.code) for r in h.reports]
    assert kinds == [
        ("rejected", "step", "bad", Code.INVALID_ACTION),
        ("rejected", "unknown", "", Code.UNSUPPORTED),
    ]


def test_a_timeout_is_reported() -> None:
    h = Harness(1)
    actions = h.request(request_id="slow", reset=env_v1.ResetRequest(timeout_ms=100))
    (timer,) = [a for a in actions if isinstance(a, StartTimer)]
    h.session.on_timer(timer.token)
    (item,) = h.reports
    assert (item.kind, item.verb, item.request_id, item.lanes) == ("timeout", "reset", "slow", (0,))
    assert item.message == "env.reset timed out after 100ms"


def test_timeout_replies_then_env_still_finishes_before_next_serial() -> None:
    h = Harness(1)
    actions = h.request(request_id="slow", reset=env_v1.ResetRequest(timeout_ms=100))
    (timer,) = [a for a in actions if isinstance(a, StartTimer)]
    assert timer.seconds == pytest.approx(0.1)
    job = h.take()[0][1]
    assert error_of(h.session.on_timer(timer.token)) == (
        Code.TIMEOUT,
        "env.reset timed out after 100ms",
        True,
    )
    # the next serial request waits for the env call itself (a Close for at most
    # close_timeout: its own timer)
    (bound,) = h.request(request_id="close", close=env_v1.CloseEnvsRequest())
    assert bound == StartTimer(bound.token, 5.0)
    actions = h.answer(0, job, reset_result())
    assert CancelTimer(bound.token) in actions
    resp = only(actions)
    assert resp.request_id == "close" and resp.close is not None
    (ep,) = resp.close.final_episodes  # the late reset still started its episode
    assert ep.truncated


def test_timer_cancelled_when_lane_answers_in_time() -> None:
    h = Harness(1)
    actions = h.request(step=env_v1.StepRequest(action=action(0), timeout_ms=2500))
    (timer,) = [a for a in actions if isinstance(a, StartTimer)]
    actions = h.answer(0, h.take()[0][1], step_result())
    assert CancelTimer(timer.token) in actions
    assert h.session.on_timer(timer.token) == []


# ----------------------------------------------------------------- conformance


def cand(kind: str, path: str, what: str = "above high bound") -> Candidate:
    return Candidate(kind, path, f"{path}: Box value at element 0 out of bounds: {what}")


def test_conformance_one_lane_reported_once_per_pair_for_the_server() -> None:
    h = Harness(1)
    h.request(step=env_v1.StepRequest(action=action(0)))
    resp = only(
        h.answer(0, h.take()[0][1], step_result(action_warning=cand("action", "$"), own="x"))
    )
    assert resp.step is not None
    info = from_meta_map(resp.step.infos)
    assert info["rlmesh.conformance.warning"] == [
        {
            "kind": "action",
            "path": "$",
            "detail": "$: Box value at element 0 out of bounds: above high bound",
        }
    ]
    assert info["own"] == "x"
    # the same pair again, with another detail: silent, even in a new session
    h2 = _Driven(Session(h.endpoint), h)
    h2.on_request(env_v1.JoinRequest(step=env_v1.StepRequest(action=action(0))))
    job = h.take()[0][1]
    actions = h2.on_lane_reply(
        LaneReply(
            job.id,
            0,
            outcome.Value(step_result(action_warning=cand("action", "$", "below low bound"))),
            Phases(),
        ),
    )
    resp = only(actions)
    assert resp.step is not None and "rlmesh.conformance.warning" not in from_meta_map(
        resp.step.infos
    )


def test_conformance_multi_lane_placement() -> None:
    h = Harness(3)
    h.request(step=env_v1.StepRequest(action=action(0, 0), env_indices=[2, 0]))
    jobs = h.take()
    obs_cand = cand("observation", "$")
    h.answer(2, jobs[0][1], step_result(obs_warning=obs_cand, own="env"))
    resp = only(
        h.answer(
            0, jobs[1][1], step_result(action_warning=cand("action", "$"), obs_warning=obs_cand)
        )
    )
    assert resp.step is not None
    info = from_meta_map(resp.step.infos)
    # reply-level list: actions first, then observations, first lane in reply order
    assert [(e["kind"], e["path"]) for e in info["rlmesh.conformance.warning"]] == [
        ("action", "$"),
        ("observation", "$"),
    ]
    lane2, lane0 = info["final_info"]
    assert [e["kind"] for e in lane2["rlmesh.conformance.warning"]] == ["observation"]
    assert [e["kind"] for e in lane0["rlmesh.conformance.warning"]] == ["action", "observation"]
    assert info["_final_info"] == [False, False]
    # lane 1 now shows the known observation pair in its own map only
    h.request(step=env_v1.StepRequest(action=action(0, 0), env_indices=[1, 0]))
    jobs = h.take()
    h.answer(1, jobs[0][1], step_result(obs_warning=obs_cand))
    resp = only(h.answer(0, jobs[1][1], step_result()))
    assert resp.step is not None
    info = from_meta_map(resp.step.infos)
    assert "rlmesh.conformance.warning" not in info
    assert [e["kind"] for e in info["final_info"][0]["rlmesh.conformance.warning"]] == [
        "observation"
    ]


def test_conformance_one_lane_reply_lists_only_server_new_pairs() -> None:
    h = Harness(2)
    h.request(step=env_v1.StepRequest(action=action(0), env_indices=[0]))
    h.answer(0, h.take()[0][1], step_result(action_warning=cand("action", "$")))
    h.request(step=env_v1.StepRequest(action=action(0), env_indices=[1]))
    resp = only(
        h.answer(
            1,
            h.take()[0][1],
            step_result(action_warning=cand("action", "$"), obs_warning=cand("observation", "$")),
        )
    )
    assert resp.step is not None
    entries = from_meta_map(resp.step.infos)["rlmesh.conformance.warning"]
    assert [e["kind"] for e in entries] == ["observation"]
    assert ("action", "$") in h.endpoint.ledger.lanes[1]


def test_deadline_runs_while_a_request_waits_behind_a_wedged_env() -> None:
    h = Harness(1)
    actions = h.request(
        request_id="stuck", step=env_v1.StepRequest(action=action(0), timeout_ms=50)
    )
    (first,) = [a for a in actions if isinstance(a, StartTimer)]
    job = h.take()[0][1]
    assert error_of(h.session.on_timer(first.token))[0] == Code.TIMEOUT
    # the env is still stuck: the next whole request waits, but its deadline runs
    actions = h.request(request_id="next", reset=env_v1.ResetRequest(timeout_ms=200))
    (second,) = [a for a in actions if isinstance(a, StartTimer)]
    assert second.seconds == pytest.approx(0.2)
    assert h.take() == []
    resp = only(h.session.on_timer(second.token))
    assert resp.request_id == "next"
    assert error_of([Send(resp)]) == (Code.TIMEOUT, "env.reset timed out after 200ms", True)
    # the expired request is never run, even once the env comes back
    assert sends(h.answer(0, job, step_result())) == []
    assert h.take() == []
    assert not h.session.busy


def test_waiting_request_keeps_its_deadline_once_dispatched() -> None:
    h = Harness(2)
    h.request(step=env_v1.StepRequest(action=action(0), env_indices=[0]))
    lane_job = h.take()[0][1]
    actions = h.request(request_id="w", reset=env_v1.ResetRequest(timeout_ms=300))
    (timer,) = [a for a in actions if isinstance(a, StartTimer)]
    actions = h.answer(0, lane_job, step_result())
    assert not any(isinstance(a, StartTimer) for a in actions)  # the same deadline goes on
    jobs = h.take()
    assert len(jobs) == 2
    h.answer(0, jobs[0][1], reset_result())
    actions = h.answer(1, jobs[1][1], reset_result())
    assert CancelTimer(timer.token) in actions
    assert only(actions).request_id == "w"


def test_waiting_request_answered_at_once_cancels_its_timer() -> None:
    h = Harness(2)
    h.request(step=env_v1.StepRequest(action=action(0), env_indices=[0]))
    lane_job = h.take()[0][1]
    actions = h.request(request_id="bad", step=env_v1.StepRequest(timeout_ms=300))
    (timer,) = [a for a in actions if isinstance(a, StartTimer)]
    actions = h.answer(0, lane_job, step_result())
    assert [r.request_id for r in sends(actions)] == ["r", "bad"]
    assert CancelTimer(timer.token) in actions


# ----------------------------------------------------------------- supervision


def faulted(
    h: Harness, lane: int, job: Any, exc: BaseException, *, rebuilt: bool = True
) -> list[Any]:
    fault = LaneFault(lane=lane, error=f"{type(exc).__name__}: {exc}", rebuilt=rebuilt)
    return h.session.on_lane_reply(LaneReply(job.id, lane, outcome.Error(exc), Phases(), fault))


def test_an_expired_deadline_tells_the_lanes_which_jobs_overran() -> None:
    h = Harness(2)
    h.request(reset=env_v1.ResetRequest())
    for lane, job in h.take():
        h.answer(lane, job, reset_result())
    actions = h.request(step=env_v1.StepRequest(action=action(0, 1), timeout_ms=250))
    (timer,) = [a for a in actions if isinstance(a, StartTimer)]
    (lane0, job0), (lane1, job1) = h.take()
    h.answer(lane0, job0, step_result())
    actions = h.session.on_timer(timer.token)
    assert [a for a in actions if isinstance(a, Wedged)] == [Wedged(lane1, job1, 0.25)]
    assert error_of(actions) == (Code.TIMEOUT, "env.step timed out after 250ms", True)


def test_truncate_answers_a_faulted_step_as_a_truncation_with_its_last_observation() -> None:
    h = Harness(2, on_lane_fault="truncate")
    h.request(reset=env_v1.ResetRequest(seeds=[7, 8]))
    (l0, r0), (l1, r1) = h.take()
    h.answer(l0, r0, reset_result(1.0))
    h.answer(l1, r1, reset_result(2.0))
    h.request(step=env_v1.StepRequest(action=action(0, 1)))
    (l0, s0), (l1, s1) = h.take()
    h.answer(l0, s0, step_result(3.0))
    actions = faulted(h, l1, s1, RuntimeError("boom"))
    step = only(actions).step
    assert step is not None
    assert list(step.rewards) == [1.0, 0.0] and step.truncated_mask == b"\x00\x01"
    assert np.frombuffer(step.observation.leaves[0], np.float32).tolist() == [3, 3, 2, 2]
    (episode,) = step.completed_episodes
    assert episode.env_index == 1 and episode.seed == 8 and episode.truncated
    assert from_meta_map(episode.final_info) == {
        "rlmesh_trio.lane_fault": {"error": "RuntimeError: boom", "lane": 1, "rebuilt": True}
    }
    (report,) = [r for r in h.reports if r.kind == "truncated"]
    assert report.lanes == (1,) and isinstance(report.error, RuntimeError)


def test_truncate_answers_a_wedged_step_at_its_deadline() -> None:
    h = Harness(1, on_lane_fault="truncate")
    h.request(reset=env_v1.ResetRequest(seeds=[7]))
    ((lane, job),) = h.take()
    h.answer(lane, job, reset_result(1.0))
    actions = h.request(step=env_v1.StepRequest(action=action(0), timeout_ms=100))
    (timer,) = [a for a in actions if isinstance(a, StartTimer)]
    ((lane, job),) = h.take()
    actions = h.session.on_timer(timer.token)
    assert Wedged(0, job, 0.1) in actions
    step = only(actions).step
    assert step is not None and step.truncated_mask == b"\x01"
    (episode,) = step.completed_episodes
    fault = from_meta_map(episode.final_info)["rlmesh_trio.lane_fault"]
    assert fault["error"] == "TimeoutError: env.step timed out after 100ms"
    # The abandoned call's own answer comes later and changes nothing.
    assert faulted(h, lane, job, RuntimeError("late")) == []


def test_truncate_without_a_last_observation_answers_the_error() -> None:
    h = Harness(1, on_lane_fault="truncate")
    h.request(step=env_v1.StepRequest(action=action(0)))  # no reset in this session
    ((lane, job),) = h.take()
    assert error_of(faulted(h, lane, job, RuntimeError("boom"))) == (
        Code.CRASHED,
        "step failed: RuntimeError: boom (lane 0 faulted and was rebuilt: reset it to go on)",
        True,
    )


def test_rebuild_reports_the_faulted_lanes_episode_as_interrupted() -> None:
    h = Harness(2, on_lane_fault="rebuild")
    h.request(reset=env_v1.ResetRequest(seeds=[7, 8]))
    for lane, job in h.take():
        h.answer(lane, job, reset_result())
    h.request(step=env_v1.StepRequest(action=action(0), env_indices=[1]))
    ((lane, job),) = h.take()
    assert error_of(faulted(h, lane, job, RuntimeError("boom")))[0] == Code.CRASHED
    h.request(step=env_v1.StepRequest(action=action(0), env_indices=[0]))
    ((lane, job),) = h.take()
    step = only(h.answer(lane, job, step_result())).step
    assert step is not None
    (episode,) = step.completed_episodes
    assert (episode.env_index, episode.seed, episode.truncated, episode.step_count) == (
        1,
        8,
        True,
        0,
    )


def test_a_close_waits_for_lane_jobs_at_most_close_timeout() -> None:
    h = Harness(1, close_timeout=0.5)
    h.request(reset=env_v1.ResetRequest(seeds=[1]))
    ((lane, job),) = h.take()
    h.answer(lane, job, reset_result())
    h.request(step=env_v1.StepRequest(action=action(0), env_indices=[0]))
    h.take()  # never answered: the env call hangs
    (bound,) = h.request(request_id="bye", close=env_v1.CloseEnvsRequest())
    assert bound == StartTimer(bound.token, 0.5)
    actions = h.session.on_timer(bound.token)
    reply = only(actions)
    assert reply.request_id == "bye" and reply.close is not None
    (episode,) = reply.close.final_episodes
    assert episode.truncated
    assert any(isinstance(a, EndStream) for a in actions)
    (report,) = [r for r in h.reports if r.verb == "close"]
    assert report.kind == "timeout" and report.lanes == (0,)
    assert report.message == (
        "close waited 0.5 s for env calls still running on lanes 0; answering it without them"
    )


# ----------------------------------------------------------------- half-close


def test_half_close_answers_what_was_read_then_ends() -> None:
    h = Harness(2)
    h.request(request_id="r", reset=env_v1.ResetRequest(seeds=[1, 2]))
    for lane, job in h.take():
        h.answer(lane, job, reset_result())
    h.request(request_id="a", step=env_v1.StepRequest(action=action(0), env_indices=[0]))
    h.request(request_id="b", step=env_v1.StepRequest(action=action(1), env_indices=[1]))
    assert h.session.on_half_close() == []  # two lane steps still running
    (first, second) = h.take()
    actions = h.answer(*first, step_result())
    assert [r.request_id for r in sends(actions)] == ["a"]
    assert not any(isinstance(a, EndStream) for a in actions)
    actions = h.answer(*second, step_result())
    assert [r.request_id for r in sends(actions)] == ["b"]
    assert isinstance(actions[-1], EndStream)  # then the trailers
    assert h.session.finished


def test_half_close_with_nothing_in_flight_ends_at_once() -> None:
    h = Harness(1)
    assert isinstance(h.session.on_half_close()[-1], EndStream)
    assert h.session.on_request(env_v1.JoinRequest(request_id="late")) == []


def test_half_close_does_not_wait_for_a_timed_out_env_call() -> None:
    """A request answered TIMEOUT counts as answered: the stream ends although its env
    call still runs (every wait is bounded)."""
    h = Harness(1)
    actions = h.request(request_id="slow", reset=env_v1.ResetRequest(timeout_ms=100))
    (timer,) = [a for a in actions if isinstance(a, StartTimer)]
    assert h.session.on_half_close() == []
    actions = h.session.on_timer(timer.token)
    assert error_of([a for a in actions if not isinstance(a, EndStream)])[0] == Code.TIMEOUT
    assert isinstance(actions[-1], EndStream)


def test_job_ids_are_unique_over_the_sessions_of_an_endpoint() -> None:
    # The transport routes a lane reply to its session by the job's id: a late reply of
    # an ended session must never carry an id one of the next session's jobs has.
    h = Harness(2)
    h.request(reset=env_v1.ResetRequest())
    first = {job.id for _, job in h.take()}
    assert len(first) == 1  # one request: one id, one job per lane
    later = Session(h.endpoint)
    actions = later.on_request(env_v1.JoinRequest(request_id="r", reset=env_v1.ResetRequest()))
    second = {act.job.id for act in actions if isinstance(act, Post)}
    assert len(second) == 1 and second.isdisjoint(first)


@pytest.mark.parametrize("truncate", [False, True])
def test_the_straight_line_answers_as_the_general_path(truncate: bool) -> None:
    """One lane's steps (the hot path) give the same actions, byte for byte, as the
    general queue and op machinery: episodes that end and interrupt, deadlines, the
    Done of an observed session, a bad action and a faulted env among them."""
    kwargs: dict[str, Any] = {"on_lane_fault": "truncate"} if truncate else {}

    def script(straight: bool) -> list[Any]:
        h = Harness(num_envs=2, **kwargs)
        h.session._session.straight_line = straight
        h.session._session._observe = True
        seen: list[Any] = list(h.request(reset=env_v1.ResetRequest(seeds=[1, 2])))
        for lane, job in h.take():
            seen += h.answer(lane, job, reset_result(float(lane)))
        for i in range(12):
            lane = i % 2
            timeout = 500 if i % 3 == 0 else 0
            seen += h.request(
                request_id=f"s{i}",
                step=env_v1.StepRequest(
                    action=action(lane), env_indices=[lane], timeout_ms=timeout
                ),
            )
            ((posted_lane, job),) = h.take()
            if i == 7:
                answer: Any = outcome.Error(ActionError("$: value 9 not in range [0, 2)"))
            elif i == 9:
                fault = LaneFault(lane=posted_lane, error="RuntimeError: boom")
                seen += h.session.on_lane_reply(
                    LaneReply(
                        job.id, posted_lane, outcome.Error(RuntimeError("boom")), Phases(), fault
                    )
                )
                continue
            else:
                answer = step_result(
                    x=0.1 * i, reward=float(i), terminated=i == 4, truncated=i == 5, k=i
                )
            seen += h.answer(posted_lane, job, answer)
            if i == 5:  # lane 1 starts over; lane 0's episode (ended at 4) too
                seen += h.request(
                    request_id=f"r{i}", reset=env_v1.ResetRequest(env_indices=[0, 1], seeds=[5, 6])
                )
                for reset_lane, reset_job in h.take():
                    seen += h.answer(reset_lane, reset_job, reset_result(1.0))
        seen += h.request(request_id="c", close=env_v1.CloseEnvsRequest())
        return [bytes(a.response) if isinstance(a, Send) else a for a in seen] + [
            (r.kind, r.verb, r.request_id, r.lanes, r.code, r.message) for r in h.reports
        ]

    assert script(straight=True) == script(straight=False)


@pytest.mark.parametrize("on_lane_fault", ["error", "rebuild", "truncate"])
def test_the_straight_line_answers_whole_vector_steps_of_one_lane_as_the_general_path(
    on_lane_fault: str,
) -> None:
    """rlmesh.run at N = 1 sends whole-vector steps: on a one-lane endpoint they take the
    straight line too, and stay serial (a request read meanwhile waits for the answer;
    a fatal error ends the stream), with the same actions, byte for byte, as the general
    path: episodes, deadlines and their expiry, a bad action, a faulted env, a lane
    refusal, and steps pipelined behind one another or behind a lane-scoped one."""

    def script(straight: bool) -> list[Any]:
        h = Harness(num_envs=1, on_lane_fault=on_lane_fault)
        h.session._session.straight_line = straight
        h.session._session._observe = True
        seen: list[Any] = list(h.request(reset=env_v1.ResetRequest(seeds=[1])))
        for lane, job in h.take():
            seen += h.answer(lane, job, reset_result(0.0))
        for i in range(10):
            timeout = 500 if i % 3 == 0 else 0
            step = env_v1.StepRequest(action=action(i % 2), timeout_ms=timeout)
            seen += h.request(request_id=f"s{i}", step=step)
            if i == 2:  # a second step read while the first runs: it waits its turn
                seen += h.request(request_id="s2b", step=env_v1.StepRequest(action=action(1)))
            jobs = h.take()
            if i == 6:  # the deadline runs out before the lane answers
                timers = [a for a in seen if isinstance(a, StartTimer)]
                seen += h.session.on_timer(timers[-1].token)
            for lane, job in jobs:
                if i == 4:
                    answer: Any = outcome.Error(ActionError("$: value 9 not in range [0, 2)"))
                elif i == 8:
                    fault = LaneFault(lane=lane, error="RuntimeError: boom")
                    seen += h.session.on_lane_reply(
                        LaneReply(
                            job.id, lane, outcome.Error(RuntimeError("boom")), Phases(), fault
                        )
                    )
                    continue
                else:
                    answer = step_result(
                        x=0.1 * i, reward=float(i), terminated=i == 5, truncated=i == 7
                    )
                seen += h.answer(lane, job, answer)
            for lane, job in h.take():  # what waited behind
                seen += h.answer(lane, job, step_result(x=0.9, reward=9.0))
            if i == 3:
                lane_step = env_v1.StepRequest(action=action(0), env_indices=[0])
                seen += h.request(request_id="l3", step=lane_step)
                ((lane, held),) = h.take()
                seen += h.request(request_id="s3b", step=env_v1.StepRequest(action=action(0)))
                seen += h.answer(lane, held, step_result(x=0.3))
                for lane, job in h.take():
                    seen += h.answer(lane, job, step_result(x=0.4))
        seen += h.request(request_id="c", close=env_v1.CloseEnvsRequest())
        return [bytes(a.response) if isinstance(a, Send) else a for a in seen] + [
            (r.kind, r.verb, r.request_id, r.lanes, r.code, r.message) for r in h.reports
        ]

    assert script(straight=True) == script(straight=False)


@pytest.mark.parametrize("on_lane_fault", ["error", "rebuild", "truncate"])
def test_the_straight_line_answers_gathered_whole_vector_steps_as_the_general_path(
    on_lane_fault: str,
) -> None:
    """Whole-vector steps of several lanes, answered as a gather hands them over (all
    lanes at once, in the order they finished): the same actions, byte for byte, as the
    general path with each reply on its own -- episodes that end, deadlines (one runs out
    with a lane still out: the rest then come one by one), a bad row, a lane's bad
    action, a warning, a faulted env, a request read meanwhile, a lane-scoped step
    between them, and the Done of an observed session."""
    n = 3

    taken: list[bool] = []  # each whole-vector step answered on the straight line

    def script(straight: bool) -> list[Any]:
        h = Harness(num_envs=n, on_lane_fault=on_lane_fault)
        session = h.session._session
        session.straight_line = straight
        session._observe = True
        done = session._vector_step_done

        def counted(*args: Any) -> Any:
            taken.append(straight)
            return done(*args)

        session._vector_step_done = counted  # type: ignore[method-assign]
        seen: list[Any] = list(h.request(reset=env_v1.ResetRequest(seeds=[1, 2, 3])))
        for lane, job in h.take():
            seen += h.answer(lane, job, reset_result(float(lane)))
        for i in range(10):
            timeout = 500 if i % 3 == 0 else 0
            rows = (9, 0, 1) if i == 2 else (i % 2, 1, 0)
            step = env_v1.StepRequest(action=action(*rows), timeout_ms=timeout)
            seen += h.request(request_id=f"s{i}", step=step)
            if i == 4:  # read while the vector step runs: it waits its turn
                seen += h.request(request_id="s4b", step=env_v1.StepRequest(action=action(1, 1, 1)))
            jobs = h.take()
            replies = []
            for lane, job in jobs:
                result: Any = step_result(
                    x=0.1 * i + lane,
                    reward=float(i + lane),
                    terminated=(i, lane) == (3, 1),
                    truncated=(i, lane) == (5, 2),
                    k=lane,
                )
                fault = None
                if (i, lane) == (7, 0):
                    result = outcome.Error(ActionError("$: value 9 not in range [0, 2)"))
                elif (i, lane) == (8, 2):
                    result = step_result(obs_warning=Candidate("bounds", "$", "out of bounds"))
                elif (i, lane) == (9, 1):
                    result = outcome.Error(RuntimeError("boom"))
                    fault = LaneFault(lane=lane, error="RuntimeError: boom")
                value = result if isinstance(result, outcome.Outcome) else outcome.Value(result)
                replies.append(LaneReply(job.id, lane, value, Phases(1, 2, 30 + lane, 4), fault))
            replies.reverse()  # the last lane finished first
            if i == 6:  # the deadline runs out with one lane still out
                seen += h.session.on_lane_reply(replies[0])
                timers = [a for a in seen if isinstance(a, StartTimer)]
                seen += h.session.on_timer(timers[-1].token)
                for reply in replies[1:]:
                    seen += h.session.on_lane_reply(reply)
            elif replies:
                seen += h.session.on_lane_replies(replies)
            for lane, job in h.take():  # what waited behind
                seen += h.answer(lane, job, step_result(x=0.9, reward=9.0))
            if i == 1:
                lane_step = env_v1.StepRequest(action=action(0), env_indices=[2])
                seen += h.request(request_id="l1", step=lane_step)
                for lane, job in h.take():
                    seen += h.answer(lane, job, step_result(x=0.3))
        seen += h.request(request_id="c", close=env_v1.CloseEnvsRequest())
        return [bytes(a.response) if isinstance(a, Send) else a for a in seen] + [
            (r.kind, r.verb, r.request_id, r.lanes, r.code, r.message) for r in h.reports
        ]

    straight = script(straight=True)
    assert straight == script(straight=False)
    assert sum(isinstance(a, bytes) for a in straight) >= 12  # the steps were answered
    # the straight line did answer clean steps (and the general path none)
    assert taken.count(True) >= 4 and False not in taken


@pytest.mark.parametrize("num_envs", [1, 2])
def test_a_warning_goes_into_the_reply_not_into_the_lanes_info_map(num_envs: int) -> None:
    """The lane's info map is shared (a recorder keeps it by reference, on another
    thread): the conformance entry goes into a new map, on the wire all the same."""
    h = Harness(num_envs=num_envs)
    h.request(reset=env_v1.ResetRequest(seeds=list(range(num_envs))))
    for lane, job in h.take():
        h.answer(lane, job, reset_result(float(lane)))
    h.request(request_id="w", step=env_v1.StepRequest(action=action(*[0] * num_envs)))
    results = []
    sent: list[Any] = []
    for lane, job in h.take():
        result = step_result(obs_warning=Candidate("bounds", "$", "out of bounds"), k=lane)
        results.append(result)
        sent += h.answer(lane, job, result)
    for result in results:
        assert dict(result.info.entries).keys() == {"k"}  # untouched
    (reply,) = [a.response for a in sent if isinstance(a, Send)]
    infos = from_meta_map(reply.step.infos)
    lanes = infos["final_info"] if num_envs > 1 else [infos]
    assert [CONFORMANCE_KEY in lane for lane in lanes] == [True] * num_envs  # sent as before
