"""``serve_env`` in a test's own Trio run: :func:`served`."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from rlmesh_trio import ServeOptions, serve_env

__all__ = ["served"]


@asynccontextmanager
async def served(
    make_env: Any,
    num_envs: int = 2,
    env_kwargs: dict[str, Any] | None = None,
    *,
    close_timeout_seconds: float | None = 2.0,
    **options: Any,
) -> AsyncIterator[str]:
    """``serve_env(make_env, ...)`` under a nursery, with ``options`` as
    :class:`ServeOptions` fields (``close_timeout_seconds=None``: the server's own
    default); yields its address. Leaving the block stops the server
    (``serve_env`` has closed its lanes and recorders when the block is left)."""
    async with trio.open_nursery() as nursery:
        info = await nursery.start(
            functools.partial(
                serve_env,
                make_env,
                num_envs=num_envs,
                env_kwargs=env_kwargs,
                options=ServeOptions(close_timeout_seconds=close_timeout_seconds, **options),
            )
        )
        try:
            yield info.address
        finally:
            nursery.cancel_scope.cancel()
