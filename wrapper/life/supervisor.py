"""The supervisor: the wrapper from its start to its exit status, and the signals that end it.

It asks the life (wrapper/life/server_life.py) to start llama-server, watches what serves (wrapper/life/watch.py: a
loss, and the life restarts it; wrapper/life/sleep_cycle.py: an idle server, and the life puts it to sleep), and asks
the life to stop it once a signal comes or a loss is given up on; the exit status follows from how it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp
import structlog

from wrapper import built_ins
from wrapper.aio import first_of
from wrapper.configuration.config import Config
from wrapper.configuration.exits import EXIT_OK, EXIT_START_FAILED
from wrapper.configuration.sections import SLEEP, WATCHDOG
from wrapper.kept import Kept
from wrapper.launching.launch import Launch
from wrapper.life import sleep_cycle, status
from wrapper.life.hooks_running import Hooks
from wrapper.life.notify import Notifier
from wrapper.life.server_life import Ended, ServerLife, result
from wrapper.life.watchdog import Lost
from wrapper.lifecycle import State
from wrapper.metrics import METRICS
from wrapper.progress import PROGRESS
from wrapper.queue.gate import Gate
from wrapper.server.child import Exit
from wrapper.server.generation import StartFailed
from wrapper.serving import Serving

log = structlog.get_logger()

PROGRESS_EVERY_S = 2.0
KEEPALIVE_S = 4.0
SAME_SIGNAL_S = 0.1  # the same signal again within this is one delivered twice (make passes it on), not a second


Serve = Callable[["Supervisor"], AbstractAsyncContextManager[None]]


async def supervise(config: Config, launch: Launch, shared: Kept, serve: Serve) -> int:
    """The wrapper's whole life, in one HTTP client session for all it asks of llama-server and hooks."""
    # Idle connections are dropped before llama-server's own 5 s keep-alive ends them under a new request.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    # auto_decompress off: the proxy passes compressed bodies through as they are.
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        return await Supervisor(config, launch, session, shared).run(serve)


class Supervisor:
    """Runs the wrapper from its start to its exit status: the signals, the start, the watch on what serves (a loss
    restarts the server, an idle one sleeps), the stop. llama-server's life itself is the life's
    (wrapper/life/server_life.py)."""

    def __init__(self, config: Config, launch: Launch, session: aiohttp.ClientSession,
                 shared: Kept) -> None:
        self.notifier = Notifier(os.environ)
        self.hooks = Hooks(session)
        self.serving = Serving(config, launch, session, shared)
        self.life = ServerLife(self.serving, self.hooks, self.notifier)
        self._stop_requested = asyncio.Event()
        self._signals = 0
        self._first_signal: signal.Signals | None = None
        self._first_signal_at = 0.0

    async def run(self, serve: Serve) -> int:
        """`serve(supervisor)` is the public listener: listening while inside it."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
        config, launch = self.serving.current.config, self.serving.current.launch
        for note in launch.notes:
            log.info("argv.rewritten", **note)
        for warning in [*config.warnings, *built_ins.warnings(config)]:
            log.warning("config.warning", note=warning)
        if launch.admin.token_file is not None and (off := launch.admin.read()[1]) is not None:
            log.warning("admin.off", why=off)
        log.info("wrapper.starting", listen=launch.listen.url, server=launch.url, argv=launch.shown_argv,
                 model=launch.model.as_dict())
        async with contextlib.AsyncExitStack() as listening:
            try:
                await listening.enter_async_context(serve(self))
            except OSError as exc:
                taken = exc.errno == errno.EADDRINUSE
                log.error("wrapper.listen_failed", listen=launch.listen.url, error=str(exc),
                          hint=(f"{launch.listen.url} is taken by another program: choose another --listen "
                                "(or stop what holds it)") if taken else "choose another --listen")
                return await self._stop(Ended.START_FAILED)
            async with _progress(self.serving.gate):
                return await self._lifetime()

    async def _lifetime(self) -> int:
        start = asyncio.ensure_future(self.life.start())
        await first_of(start, self._stop_requested.wait())
        if start.cancelled() or not start.done():  # a stop signal during the start aborted it
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError, StartFailed):
                await start
            METRICS.starts.labels(outcome="aborted").inc()
            return await self._stop(Ended.ABORTED)
        if start.exception() is not None:
            log.error("wrapper.start_failed", error=str(start.exception()))
            METRICS.starts.labels(outcome="failed").inc()
            return await self._stop(Ended.START_FAILED)
        METRICS.starts.labels(outcome="ready").inc()
        while (seen := await self._watch()) is not None:
            if isinstance(seen, str):  # a sleep is due: back when woken, or a stop came while asleep
                if not await sleep_cycle.cycle(self.life, seen, self._stop_requested):
                    break
                continue
            restart = asyncio.ensure_future(self.life.restart(seen))
            await first_of(restart, self._stop_requested.wait())
            if not restart.done() or restart.cancelled() or not restart.result():
                restart.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await restart
                break  # a stop asked for (the restart is cancelled), or given up
        await self.life.abandon_reload()  # SIGTERM mid-reload: the stop then saves what is there
        return await self._stop(Ended.HUNG if self.life.killed_hung else Ended.SERVED)

    async def _watch(self) -> Lost | str | None:
        """Until a stop is asked for (None), llama-server is lost (dead on its own, with the watchdog hung, or under a
        built-in's step), or a sleep is due (why)."""
        settings = WATCHDOG.of(self.serving.current.config)
        losing = asyncio.ensure_future(self.life.watch.lost(settings if settings.enabled else None))
        sleeping = asyncio.ensure_future(sleep_cycle.due(self.life))
        try:
            await first_of(losing, sleeping, self._stop_requested.wait())
        finally:
            for task in (losing, sleeping):
                if not task.done():
                    task.cancel()
        if self._stop_requested.is_set() or not (losing.done() or sleeping.done()):
            return None
        if losing.done() and not losing.cancelled():
            return losing.result()
        return sleeping.result() if sleeping.done() and not sleeping.cancelled() else None

    async def _stop(self, ended: Ended) -> int:
        began = time.monotonic()
        gone = await self.life.stop(ended)
        told, exit_status = result(gone.finished, ended), _exit_status(gone.finished, ended, self._signals > 0)
        stop_s, budget = time.monotonic() - began, self.serving.current.config.stop_budget
        logger = log.warning if stop_s > 0.8 * budget else log.info
        logger("wrapper.stopped", result=told, exit_status=exit_status, stop_s=round(stop_s, 3),
               budget_hint_s=budget)
        return exit_status

    def _on_signal(self, sig: signal.Signals) -> None:
        now = time.monotonic()
        if self._signals == 1 and sig == self._first_signal and now - self._first_signal_at < SAME_SIGNAL_S:
            # the same group signal delivered twice: by the kill of the process group and by a parent that
            # passes it on (make does) — one request to stop, not a second signal
            log.info("wrapper.signal_repeated", signal=sig.name,
                     after_ms=round((now - self._first_signal_at) * 1000, 3))
            return
        self._signals += 1
        if self._signals == 1:
            self._first_signal, self._first_signal_at = sig, now
            self._stop_requested.set()
        else:  # a second signal: skip what is left of the hooks (and the drain), still stop the child
            self.hooks.force()
        log.info("wrapper.signal", signal=sig.name, count=self._signals)

    def status(self) -> dict[str, Any]:
        """GET /wrapper/status."""
        serving, life = self.serving, self.life
        serving.queue()
        return status.document(serving.state, serving.current, serving.gate, life.started_at, life.ready_at,
                               built_ins.status(serving.current), self.hooks.history, life.last_reload,
                               {"count": life.budget.count, "last": life.budget.last}, serving.seats.status(),
                               life.sleep.status(serving.state is State.ASLEEP, SLEEP.of(serving.current.config)))


@contextlib.asynccontextmanager
async def _progress(gate: Gate) -> AsyncIterator[None]:
    """Long work says how far it is, every PROGRESS_EVERY_S while it lasts (from PROGRESS_EVERY_S on)."""

    async def ticker() -> None:
        logged: tuple[str | None, float] = (None, 0.0)
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S / 4)
            shown = PROGRESS.snapshot()
            if shown is None or shown["for_s"] < PROGRESS_EVERY_S:
                continue
            if shown["phase"] != logged[0] or time.monotonic() - logged[1] >= PROGRESS_EVERY_S:
                log.info("progress", **shown, in_flight=gate.in_flight, held=gate.held)
                logged = (shown["phase"], time.monotonic())

    ticking = asyncio.ensure_future(ticker())
    try:
        yield
    finally:
        ticking.cancel()


def _exit_status(finished: Exit | None, ended: Ended, signalled: bool) -> int:
    if ended is Ended.START_FAILED:
        return EXIT_START_FAILED
    if signalled or finished is None:
        return EXIT_OK
    return finished.status  # the child died on its own
