"""A client that half-closes the Join (END_STREAM on its last request, as a gRPC client
does when its request iterator ends) gets every reply, then the trailers -- as from the
reference (issue 19, finding 4: before, 1 of 2 and 1 of 10 replies)."""

from __future__ import annotations

from typing import Any

import pytest
from support import scripts, wire
from support.params import PEERS
from support.refserver import ServerConfig, ServerPool

pytestmark = [pytest.mark.interop, pytest.mark.timeout(120)]


def config() -> ServerConfig:
    return ServerConfig(entrypoint=scripts.ENTRYPOINTS["cartpole"], num_envs=4)


def scenario_requests(name: str) -> list[wire.env_v1.JoinRequest]:
    configure = wire.configure(request_id="c")
    reset = wire.reset(seeds=[1, 2, 3, 4], request_id="r")
    if name == "configure-reset":
        return [configure, reset]
    # One request per lane in flight: the reference runs two pipelined requests for one
    # lane in either order (seen both ways), so the comparison keeps to one per lane
    # between barriers.
    lane_steps = [
        wire.step([wire.i64([i % 2])], env_indices=[i], request_id=f"s{i}") for i in range(4)
    ]
    if name == "lane-steps":
        barrier = wire.step([wire.i64([1, 1, 0, 0])], request_id="barrier")
        again = [wire.step([wire.i64([1])], env_indices=[i], request_id=f"t{i}") for i in range(4)]
        return [configure, reset, *lane_steps, barrier, *again]
    if name == "whole-steps":
        return [
            configure,
            reset,
            *[wire.step([wire.i64([1, 0, 1, 0])], request_id=f"w{i}") for i in range(5)],
        ]
    if name == "lane-resets":
        return [
            configure,
            reset,
            *[wire.reset(seeds=[9 + i], env_indices=[i], request_id=f"lr{i}") for i in range(4)],
            wire.step([wire.i64([0, 1, 0, 1])], request_id="after"),
        ]
    raise AssertionError(name)


async def pipelined_then_half_closed(address: str, name: str) -> dict[str, Any]:
    """Send every request at once, END_STREAM on the last; read until the end."""
    requests = scenario_requests(name)
    async with wire.WireClient(address) as client, client.join() as join:
        for index, request in enumerate(requests):
            if index == len(requests) - 1:
                await client._send(join.stream, bytes(request), end=True)
            else:
                await join.send(request)
        replies = []
        while (reply := await join.recv(timeout=30)) is not None:
            replies.append(reply)
        end = join.end
    return {
        "replies": sorted((r.request_id, wire.reply_kind(r), wire.plain(r)) for r in replies),
        "end": end,
    }


@pytest.mark.parametrize("name", ["configure-reset", "lane-steps", "whole-steps", "lane-resets"])
@pytest.mark.parametrize("peer", PEERS)
def test_half_close_answers_everything_then_ends(servers: ServerPool, peer: str, name: str) -> None:
    expected, got = servers.on_both(peer, config(), pipelined_then_half_closed, name)
    assert len(expected["replies"]) == len(scenario_requests(name))
    assert expected["end"] == wire.CallEnd(0, None)
    assert got["end"] == expected["end"]
    assert [r[:2] for r in got["replies"]] == [r[:2] for r in expected["replies"]]
    wire.assert_same(expected["replies"], got["replies"])
