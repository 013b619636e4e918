"""Drive one lane of a served :func:`support.fleet_envs.make_hang_on_lane` env until the
server gives it up for good.

Each round resets the lane and steps it until the step that hangs, which the server's
watchdog (``--lane-timeout-seconds``) abandons, answering it as a truncation
(``--on-lane-fault truncate``) and rebuilding the lane on a fresh thread. The round after
:data:`~rlmesh_trio._lanes._supervisor.MAX_LEFT_BEHIND` threads were left behind, the
lane is given up instead of rebuilt: the reset that follows is refused for good.
"""

from __future__ import annotations

from rlmesh_trio._lanes._supervisor import MAX_LEFT_BEHIND
from rlmesh_trio._proto.rlmesh.env import v1 as env_v1

from . import wire


async def give_up_lane(address: str, lane: int = 1, hang_at: int = 3) -> env_v1.JoinResponse:
    """Hang ``lane`` ``MAX_LEFT_BEHIND + 1`` times; return the reset refused after that."""
    async with wire.WireClient(address) as client, client.join() as join:
        for _ in range(MAX_LEFT_BEHIND + 1):
            reply = await join.call(wire.reset(env_indices=[lane]))
            assert reply.reset is not None, reply
            for _ in range(hang_at):  # the last one hangs
                reply = await join.call(wire.step([wire.i64([0])], env_indices=[lane]))
            assert reply.step is not None and reply.step.truncated_mask == b"\x01", reply
        return await join.call(wire.reset(env_indices=[lane]))
