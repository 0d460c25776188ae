"""The supervisor: the wrapper's life from the start to the exit status, and the signals that end it.

What serves (wrapper/serving.py: the current generation, the gate, the state) is started, watched and stopped
here; a reload (wrapper/reloader.py) replaces the generation while the supervisor, its listener and the hooks'
notion of the wrapper's life go on. The hooks run through wrapper/hooks_running.py.
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
from enum import Enum
from typing import Any

import aiohttp
import structlog

from wrapper import built_ins, sleep_cycle, status
from wrapper.aio import first_of
from wrapper.child import Exit
from wrapper.config import Config
from wrapper.exits import EXIT_OK, EXIT_START_FAILED
from wrapper.gate import Gate
from wrapper.generation import Generation, StartFailed, surviving
from wrapper.hooks_running import Hooks
from wrapper.kept import Kept
from wrapper.launch import Launch
from wrapper.lifecycle import State
from wrapper.metrics import METRICS
from wrapper.notify import Notifier
from wrapper.progress import PROGRESS
from wrapper.serving import Serving
from wrapper.sleeping import SLEEP
from wrapper.stop_drain import StopDrain
from wrapper.watchdog import WATCHDOG, Budget, Lost

log = structlog.get_logger()

PROGRESS_EVERY_S = 2.0
STOP_BUDGET = 10.0  # llama-swap's default unloadTimeout: warn when a stop comes close to it
KEEPALIVE_S = 4.0
SAME_SIGNAL_S = 0.1  # the same signal again within this is one delivered twice (make passes it on), not a second


class Ended(Enum):
    """How the start ended, which decides what the stop does."""

    SERVED = "served"  # ready once: drain, on_will_stop
    START_FAILED = "start failed"  # exit 3, result start-failed
    ABORTED = "aborted"  # a signal during the start
    HUNG = "hung"  # served, then llama-server hung and the watchdog, out of restarts, killed it: result watchdog


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
    """Runs the wrapper from its start to its exit status: signals, the start, watching what serves, the stop."""

    def __init__(self, config: Config, launch: Launch, session: aiohttp.ClientSession,
                 shared: Kept) -> None:
        self.notifier = Notifier(os.environ)
        self.hooks = Hooks(session)
        self.serving = Serving(config, launch, session, shared, self.hooks, self.notifier)
        self.stop_drain = StopDrain(self.serving, self.hooks, self.notifier)
        self.started_at = time.monotonic()
        self.ready_at: float | None = None
        self._background: list[asyncio.Task[None]] = []
        self._pinging: asyncio.Task[None] | None = None
        self._killed_hung = False  # the watchdog gave up on a hung server and killed it
        self._stop_requested = asyncio.Event()
        self._signals = 0
        self._first_signal: signal.Signals | None = None
        self._first_signal_at = 0.0
        watching = WATCHDOG.of(config)
        self.budget = Budget(watching.restarts, watching.window)  # restarts after a crash or a hang

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
        start = asyncio.ensure_future(self._start())
        await first_of(start, self._stop_requested.wait())
        if start.cancelled() or not start.done():  # a stop signal during the start aborted it
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
                if not await sleep_cycle.cycle(self, seen, self._stop_requested):
                    break
                continue
            restart = asyncio.ensure_future(self._restart(seen))
            await first_of(restart, self._stop_requested.wait())
            if not restart.done() or restart.cancelled() or not restart.result():
                break  # a stop asked for (the restart is cancelled), or given up
        await self.serving.abandon_reload()  # SIGTERM mid-reload: the stop then saves what is there
        return await self._stop(Ended.HUNG if self._killed_hung else Ended.SERVED)

    async def _watch(self) -> Lost | str | None:
        """Until a stop is asked for (None), llama-server is lost (dead on its own, or with the watchdog hung), or a
        sleep is due (why)."""
        settings = WATCHDOG.of(self.serving.current.config)
        losing = asyncio.ensure_future(self.serving.lost(settings if settings.enabled else None))
        sleeping = asyncio.ensure_future(sleep_cycle.due(self.serving))
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

    async def _restart(self, lost: Lost) -> bool:
        """Start llama-server again as at a start (on_startup runs: the slots come back), requests held meanwhile;
        False when the watchdog is off or its budget is spent (the wrapper then stops with the server's status)."""
        serving, settings = self.serving, WATCHDOG.of(self.serving.current.config)
        old = serving.current
        up_s = round(time.monotonic() - (self.ready_at or self.started_at), 3)
        in_flight = serving.in_flight + serving.cut_by_loss  # those cut by it already wait to learn what it was
        log.error("wrapper.server_lost", reason=lost.reason, why=lost.why, in_flight=in_flight,
                  held=serving.gate.held, up_s=up_s, pid=old.child.pid if old.child else None)
        if not settings.enabled or not self.budget.allows():
            log.error("wrapper.giving_up", restarts=self.budget.count, within_s=settings.window,
                      why="watchdog.enabled is false" if not settings.enabled else
                      "watchdog.restarts is 0" if not settings.restarts else
                      f"{settings.restarts} restart(s) within watchdog.window ({settings.window:g}s) already",
                      hint="the wrapper stops with the server's exit status: llama-swap or systemd take over")
            if old.child is not None and old.child.alive:  # hung: no stop it could hear (SIGTERM, the save)
                self._killed_hung = True
                old.child.end_leftovers()
                await old.child.wait()
            return False
        began = time.monotonic()
        serving.lifecycle.to(State.RESTARTING)  # requests wait, as during a reload; /health says 503
        for task in self._background:
            task.cancel()
        if old.child is not None:  # what is left of it (a hung one, its process group)
            old.child.kill()
            await old.child.wait()
        while True:
            self.budget.spend(lost)
            METRICS.server_restarts.labels(reason=lost.reason).inc()
            self.notifier.status(f"restarting llama-server ({lost.reason}: {lost.why})")
            log.warning("wrapper.restarting_server", on=lost.reason, why=lost.why, attempt=self.budget.count)
            new = serving.new_generation(old.config, old.launch)
            try:
                await self._bring_up(new)
                break
            except StartFailed as exc:
                log.error("wrapper.restart_failed", error=str(exc), attempt=self.budget.count)
                if new.child is not None:
                    serving.install(new)  # the stop reports its exit status
                if not self.budget.allows():
                    log.error("wrapper.giving_up", restarts=self.budget.count, within_s=settings.window,
                              why=f"{settings.restarts} restart(s) within watchdog.window ({settings.window:g}s) "
                                  "already, the last one failed",
                              hint="the wrapper stops with the server's exit status: llama-swap or systemd take over")
                    return False
                lost = Lost("crash", f"the restart failed: {exc}", None)
            finally:  # a stop during the start: a server that was not installed is not left running
                if new is not serving.current and new.alive:
                    await new.stop()
        serving.lifecycle.to(State.READY)  # the held requests go to the new server
        self.ready_at = time.monotonic()
        self._background = self._background_work()
        log.info("wrapper.server_back", reason=lost.reason, pid=new.child.pid if new.child else None,
                 restarts=self.budget.count, pause_s=round(self.ready_at - began, 3))
        return True

    def stop_background(self) -> None:
        """The built-ins' work ends (a sleep: nothing to watch until the wake)."""
        for task in self._background:
            task.cancel()
        self._background = []

    def start_background(self) -> None:
        self.ready_at = time.monotonic()
        self._background = self._background_work()

    async def bring_up(self, new: Generation) -> None:
        """At a wake (wrapper/sleep_cycle.py): on_startup says `sleep`."""
        await self._bring_up(new, sleep=True)

    async def _bring_up(self, new: Generation, sleep: bool = False) -> None:
        """A new llama-server, installed once it answers, and the start hooks run for it (StartFailed)."""
        await new.start(built_ins.server_output)
        self.serving.install(new)
        await surviving(new, built_ins.server_output, lambda: self.hooks.run("on_startup", new, sleep=sleep))

    async def _start(self) -> None:
        serving, generation = self.serving, self.serving.current
        serving.lifecycle.to(State.STARTING)
        PROGRESS.begin("starting: on_will_start")
        await self.hooks.run("on_will_start", generation)
        PROGRESS.begin("starting: loading the model")
        await generation.start(built_ins.server_output)
        self.notifier.status("starting: running on_startup (restoring slots)")
        PROGRESS.begin("starting: on_startup (restoring slots)")
        await surviving(generation, built_ins.server_output, lambda: self.hooks.run("on_startup", generation))
        PROGRESS.end()
        serving.lifecycle.to(State.READY)
        self.ready_at = time.monotonic()
        self._background = self._background_work()
        assert generation.child is not None
        log.info("wrapper.ready", listen=generation.launch.listen.url, pid=generation.child.pid,
                 start_s=round(self.ready_at - self.started_at, 3))

    def _background_work(self) -> list[asyncio.Task[None]]:
        """The built-ins' work from ready until the stop (again after a restart, which cancels it), and systemd's
        watchdog, started once: it goes on through a restart."""
        work = [asyncio.ensure_future(each) for each in built_ins.background(self.serving)]
        if self.notifier.watchdog_s is not None and self._pinging is None:
            self._pinging = asyncio.ensure_future(self._watchdog(self.notifier.watchdog_s))
        return work

    async def _watchdog(self, every: float) -> None:
        """WATCHDOG=1 while llama-server answers, and while the wrapper brings it back (a reload, a restart: both
        bounded by their own timeouts), so that systemd does not kill the wrapper for a model that loads slowly."""
        serving = self.serving
        while True:
            if serving.lifecycle.state in (State.RELOADING, State.RESTARTING, State.SLEEPING, State.ASLEEP,
                                           State.WAKING) \
                    or await serving.current.client.healthy(timeout=every):
                self.notifier.watchdog()
            await asyncio.sleep(every)

    async def _stop(self, ended: Ended) -> int:
        stop_began = time.monotonic()
        serving, hooks, forced = self.serving, self.hooks, self.hooks.forced
        serving.lifecycle.to(State.STOPPING)
        for task in [*self._background, *([self._pinging] if self._pinging else [])]:
            task.cancel()
        served = ended is Ended.SERVED and not await self.stop_drain.settled()  # a drain saved all already
        if served and not forced.is_set():
            if serving.in_flight:
                self.notifier.status(f"stopping: draining {serving.in_flight} request(s)")
            PROGRESS.begin("stopping: draining")
            await serving.drain(serving.current.config.drain_timeout)
        if served and serving.current.alive and not forced.is_set():
            self.notifier.status("stopping: running on_will_stop (saving slots)")
            PROGRESS.begin("stopping: on_will_stop (saving slots)")
            await hooks.run("on_will_stop", serving.current)
        self.notifier.status("stopping: stopping llama-server")
        PROGRESS.begin("stopping: stopping llama-server")
        finished = await serving.current.stop()
        PROGRESS.end()
        result = _result(finished, ended)
        stop_s = time.monotonic() - stop_began
        await hooks.run("on_stopped", serving.current, result=result, finished=finished)  # skipped if forced
        await hooks.end_leftovers()
        serving.lifecycle.to(State.STOPPED)
        exit_status = _exit_status(finished, ended, self._signals > 0)
        logger = log.warning if stop_s > 0.8 * STOP_BUDGET else log.info
        logger("wrapper.stopped", result=result, exit_status=exit_status, stop_s=round(stop_s, 3),
               budget_hint_s=STOP_BUDGET)
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
        serving = self.serving
        serving.queue()
        return status.document(serving.lifecycle.state, serving.current, serving.gate, self.started_at,
                               self.ready_at, built_ins.status(serving.current), self.hooks.history,
                               serving.last_reload, {"count": self.budget.count, "last": self.budget.last},
                               serving.seats.status(),
                               serving.sleep.status(serving.state is State.ASLEEP, SLEEP.of(serving.current.config)))


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


def _result(finished: Exit | None, ended: Ended) -> str:
    """systemd-style service result for `on_stopped`."""
    if ended is Ended.START_FAILED:
        return "start-failed"
    if finished is None:
        return "success"
    if ended is Ended.HUNG:
        return "watchdog"  # as systemd names a service its watchdog killed
    if finished.killed:
        return "timeout"
    if finished.returncode == 0 or (finished.asked and finished.returncode == -signal.SIGTERM):
        return "success"
    return "signal" if finished.signal else "exit-code"
