"""The Trio side of the transport: the task that owns the transport thread and its loop.

DESIGN.md decision 2: :meth:`TransportService.run` starts one thread running an asyncio
``SelectorEventLoop`` with the grpclib server (:class:`~._server.LoopServer`) on it,
reports when it listens, and stops it. Nothing here blocks the Trio thread: the thread's
last act is to report that it stopped; ``run`` then waits, off the Trio thread and
within the stop bound, for it to have returned (:func:`~.._bridge.thread_gone`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable

import trio

from .._bridge import ToLoop, ToTrio, thread_gone
from ._server import LOOP_CLOSE_TIMEOUT, LoopServer, Wiring

log = logging.getLogger("rlmesh_trio.transport")

THREAD_NAME = "rlmesh-trio-transport"


class TransportService:
    """The gRPC side of one server, on its own thread and asyncio loop.

    ``wiring`` is the server's composition (:func:`rlmesh_trio._serve.compose`), handed
    unchanged to the :class:`~._server.LoopServer`: its ``endpoint`` answers Handshake and
    Shutdown, each Join gets ``session_factory(endpoint)``, its jobs go to ``lanes.post``.
    ``listener`` is a bound, listening socket (TCP or unix) that the service takes over
    and closes. The loop is the one ``wiring.options.event_loop`` names.

    Run it with ``await nursery.start(service.run)``. Stop it with :meth:`request_stop`
    (any thread), a Shutdown RPC the endpoint accepts, the idle timeout, or by cancelling
    ``run``. A stop drains for at most ``drain_timeout`` (skipped for the idle timeout),
    then closes the lanes (``lanes.close()``) -- once, on the transport thread: no new
    request will be served -- and gives a request still in flight up to
    ``close_timeout`` to be answered before the connections are cut.
    ``on_stop_begin()`` is called on the Trio thread when a stop begins, whoever asked
    for it. The whole stop takes at most :attr:`stop_timeout` (the options' stop bound).
    """

    def __init__(
        self,
        wiring: Wiring,
        *,
        listener: socket.socket,
        on_stop_begin: Callable[[], None] | None = None,
    ) -> None:
        self.wiring = wiring
        self.options = wiring.options
        self.on_stop_begin = on_stop_begin
        self._loop_factory = loop_factory_for(wiring.options.event_loop)
        self._listener = listener
        self._lock = threading.Lock()
        self._to_loop: ToLoop | None = None
        self._loop_server: LoopServer | None = None
        self._early_stop: str | None = None
        self._error: BaseException | None = None
        self._stop_reason: str | None = None
        self._ran = False
        self.listening = False
        """True once :meth:`run` called ``task_status.started()``."""

    @property
    def stop_timeout(self) -> float:
        """Upper bound, in seconds, from a stop request until :meth:`run` has returned."""
        return self.options.stop_bound

    @property
    def stop_reason(self) -> str | None:
        """Why the transport stopped (None while it runs)."""
        return self._stop_reason

    def request_stop(self, reason: str = "stop requested") -> None:
        """Begin a graceful stop (GOAWAY, drain, cut); any thread, idempotent, no wait."""
        with self._lock:
            to_loop, server = self._to_loop, self._loop_server
            if to_loop is None or server is None:
                self._early_stop = self._early_stop or reason
                return
        to_loop(server.request_stop, reason)  # False: the loop is closed, stopped anyway

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until stopped. ``task_status.started()`` once the loop serves the socket.

        Raises the transport's startup error (e.g. the loop could not serve the socket) or
        a crash of its loop. On cancellation it requests a graceful stop and waits for the
        thread, shielded but bounded by :attr:`stop_timeout`; a thread still running then
        is abandoned (it is a daemon) and named in the log.
        """
        if self._ran:
            raise RuntimeError("TransportService.run() can only be called once")
        self._ran = True
        to_trio = ToTrio()
        listening = trio.Event()
        stopped = trio.Event()
        changed = trio.Event()
        stop_began = trio.current_time

        def notify(event: trio.Event) -> Callable[[], None]:
            def set_both() -> None:
                event.set()
                changed.set()

            def post() -> None:
                to_trio(set_both)

            return post

        started_stopping: list[float] = []

        def stop_begins() -> None:
            if not started_stopping:
                started_stopping.append(stop_began())
                if self.on_stop_begin is not None:
                    self.on_stop_begin()

        thread = threading.Thread(
            target=self._thread_main,
            args=(notify(listening), notify(stopped), lambda: bool(to_trio(stop_begins))),
            name=THREAD_NAME,
            daemon=True,
        )
        thread.start()
        try:
            await changed.wait()
            if listening.is_set():
                self.listening = True
                task_status.started()
                await stopped.wait()
        finally:
            if not stopped.is_set():
                stop_begins()
                self.request_stop("cancelled")
                left = started_stopping[0] + self.stop_timeout - trio.current_time()
                with trio.move_on_after(max(left, 0.0), shield=True):
                    await stopped.wait()
                if not stopped.is_set():
                    log.error(
                        "transport thread %r did not stop within %.3g s; abandoning it",
                        thread.name,
                        self.stop_timeout,
                    )
            if stopped.is_set():  # its last act ran: wait (within the bound) for it to return
                began = started_stopping[0] if started_stopping else trio.current_time()
                with trio.move_on_at(began + self.stop_timeout, shield=True):
                    await thread_gone(thread)
        if self._error is not None:
            raise self._error

    def _thread_main(
        self,
        on_listening: Callable[[], None],
        on_stopped: Callable[[], None],
        on_stop_begin: Callable[[], None],
    ) -> None:
        loop = self._loop_factory()
        try:
            loop.run_until_complete(self._amain(loop, on_listening, on_stop_begin))
        except Exception as exc:
            self._error = exc
        finally:
            try:
                _close_loop(loop)
            except Exception:
                log.exception("closing the transport loop failed")
            finally:
                with contextlib.suppress(OSError):
                    self._listener.close()
                on_stopped()  # the thread's last act (the Trio side then waits for it to return)

    async def _amain(
        self,
        loop: asyncio.AbstractEventLoop,
        on_listening: Callable[[], None],
        on_stop_begin: Callable[[], None],
    ) -> None:
        server = LoopServer(self.wiring, loop, on_stop_begin=on_stop_begin)
        with self._lock:
            self._to_loop, self._loop_server = server.to_loop, server
            early = self._early_stop
        if early is not None:
            server.request_stop(early)
        try:
            await server.serve(self._listener, on_listening)
        finally:
            self._stop_reason = server.stop_reason or "stopped"
            with self._lock:
                self._loop_server = None


def loop_factory_for(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's loop (measured faster for small messages) or asyncio's selector loop."""
    if kind == "uvloop":
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
        return factory
    return asyncio.SelectorEventLoop


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on the loop (bounded), then close it."""
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.wait(tasks, timeout=LOOP_CLOSE_TIMEOUT))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


__all__ = ["THREAD_NAME", "TransportService"]
