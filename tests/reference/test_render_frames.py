"""Render frames of every shape and dtype an env may return, encoded as the reference
encodes them (SPEC §7.10): RGB, RGBA and gray PNGs with the same pixels, no frame for
other shapes, other dtypes cast as numpy casts, and the same errors. The PNG bytes may
differ (compression), the decoded images may not."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from PIL import Image
from support import envs, scripts, wire
from support.params import PEERS
from support.refserver import ServerConfig, ServerPool

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]


def seen(reply: wire.env_v1.JoinResponse) -> Any:
    """A render reply as comparable data: the decoded image (mode, size, pixels), no
    frame, or the error."""
    if reply.error is not None:
        return ("error", int(reply.error.code), reply.error.message, reply.error.is_recoverable)
    assert reply.render is not None
    if not reply.render.frame:
        return ("no frame",)
    with Image.open(io.BytesIO(reply.render.frame)) as image:
        return ("png", image.mode, image.size, np.asarray(image).tobytes().hex())


async def render_each(address: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with wire.WireClient(address) as client:
        for kind in envs.FRAME_KINDS:
            async with client.join() as join:
                await join.call(wire.configure())
                await join.call(wire.reset(seeds=[1], options={"frame": kind}))
                reply = await join.call(wire.render())
                out[kind] = seen(reply)
                # End from the server's side (a fatal error already did), so that the
                # next Join is admitted at once.
                if reply.error is None and await join.send(wire.close()):
                    while await join.recv() is not None:
                        pass
    return out


@pytest.mark.parametrize("peer", PEERS)
def test_render_frames_of_every_shape_and_dtype(servers: ServerPool, peer: str) -> None:
    config = ServerConfig(entrypoint=scripts.ENTRYPOINTS["frames"], num_envs=1)
    reference, other = servers.on_both(peer, config, render_each)
    assert reference["rgba"][1] == "RGBA" and reference["gray"][1] == "L"
    assert reference["two-channels"] == ("no frame",)
    for kind in envs.FRAME_KINDS:
        assert other[kind] == reference[kind], kind
