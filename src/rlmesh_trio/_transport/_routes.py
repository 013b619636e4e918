"""Lane replies back to the Join that asked: :class:`ReplyRoutes`, the one reply callback
of every lane job the server posts (loop thread only, but for the inbox's ``put``, which
the lane threads call)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._bridge import Delivery, Gather, ReplyInbox, ToLoop
from .._jobs import Job, LaneReply, ReplyFn

if TYPE_CHECKING:
    from ._join import JoinCall

__all__ = ["ReplyRoutes"]

log = logging.getLogger("rlmesh_trio.transport")


class ReplyRoutes:
    """Lane replies of every Join: one inbox and one reply callback for every job,
    each reply routed to the Join that posted its job, by job id (loop thread only,
    but for the inbox's ``put``, which the lane threads call).

    Job ids are unique over the endpoint's sessions (``Endpoint.tokens``), so a late
    reply of an ended Join is never taken for one of the next Join's; a whole-vector
    request posts one job per lane under one id, so the key is id and lane.
    """

    __slots__ = ("_inbox", "_lanes", "_post", "_reply", "_routes", "_touched")

    def __init__(
        self, post: Callable[[int, Job, ReplyFn], None], lanes: int, to_loop: ToLoop
    ) -> None:
        self._post = post
        self._lanes = lanes
        self._routes: dict[int, JoinCall] = {}  # job id * lanes + lane -> its Join
        self._touched: list[JoinCall] = []  # Joins that got replies in this batch
        self._inbox = ReplyInbox(to_loop, self._route, self._routed)
        self._reply: ReplyFn = self._inbox.put

    def post(self, lane: int, job: Job, call: JoinCall) -> None:
        """Post ``job`` for ``call`` (raises the lane's refusal)."""
        self._post(lane, job, self._reply)
        # After the post: the reply is delivered on this loop, so never before this runs.
        self._routes[job.id * self._lanes + lane] = call

    def gather(self, job_id: int, lanes: list[int], call: JoinCall) -> Gather:
        """Routes for one job posted to ``lanes`` for ``call`` under one id, and the
        :class:`~rlmesh_trio._bridge.Gather` whose ``reply`` each lane's post is to carry
        (:meth:`post_to`): the lanes' replies cross to the loop once, as one batch."""
        routes, width = self._routes, self._lanes
        for lane in lanes:
            routes[job_id * width + lane] = call
        return Gather(len(lanes), self._inbox.put)

    def release(self, gather: Gather) -> list[LaneReply]:
        """Loop: end ``gather`` early (:meth:`Gather.release`); its replies so far, their
        routes used (the caller hands them to their Join itself)."""
        taken = gather.release()
        routes, width = self._routes, self._lanes
        for reply in taken:
            routes.pop(reply.job_id * width + reply.lane, None)
        return taken

    def post_to(self, lane: int, job: Job, reply: ReplyFn) -> None:
        """Post ``job`` with ``reply`` (a gather's; its route is set): raises the lane's
        refusal."""
        self._post(lane, job, reply)

    def _route(self, delivery: Delivery) -> None:
        if isinstance(delivery, list):
            self._route_batch(delivery)
            return
        reply = delivery
        call = self._routes.pop(reply.job_id * self._lanes + reply.lane, None)
        if call is None:
            log.debug("lane reply for job %d, which no Join waits for; dropped", reply.job_id)
            return
        call.on_lane_reply(reply)
        if call not in self._touched:  # one or two Joins: a short list
            self._touched.append(call)

    def _route_batch(self, batch: list[LaneReply]) -> None:
        """A gather's replies (one job id, several lanes): to their Join at once."""
        routes, width = self._routes, self._lanes
        call = None
        for reply in batch:
            call = routes.pop(reply.job_id * width + reply.lane, None)
        if call is None:
            log.debug("lane replies for job %d, which no Join waits for; dropped", batch[0].job_id)
            return
        call.on_lane_replies(batch)
        if call not in self._touched:
            self._touched.append(call)

    def _routed(self) -> None:
        """After a batch of lane replies: each Join that got some flushes once."""
        for call in self._touched:
            call.flush()
        self._touched.clear()
