"""The supervisor: start, serve, reload, stop; hooks at each moment; exit status as documented.

A generation (wrapper/generation.py) is one llama-server process with its argv and starts and stops itself; a
reload (wrapper/reloader.py) replaces it while the supervisor, its listener and the hooks' notion of the
wrapper's life go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from enum import Enum
from typing import Any

import aiohttp
import structlog

from wrapper import actions, extensions, hook_context, logs, status
from wrapper.actions import HookFailed, HookRunner
from wrapper.aio import first_of
from wrapper.child import Exit
from wrapper.config import Config
from wrapper.exits import EXIT_OK, EXIT_START_FAILED
from wrapper.gate import Gate
from wrapper.generation import Generation, StartFailed, surviving
from wrapper.launch import Launch
from wrapper.lifecycle import Lifecycle, State
from wrapper.llama import LlamaClient, LlamaError
from wrapper.metrics import METRICS
from wrapper.notify import Notifier
from wrapper.progress import PROGRESS
from wrapper.proxy import Observer
from wrapper.reload_plan import BUSY_RELOADING, Refusal, ReloadRefused
from wrapper.reloader import Reloader

log = structlog.get_logger()

PROGRESS_EVERY_S = 2.0
STOP_BUDGET = 10.0  # llama-swap's default unloadTimeout: warn when a stop comes close to it
KEEPALIVE_S = 4.0
SAME_SIGNAL_S = 0.1  # the same signal again within this is one delivered twice (make passes it on), not a second
START_EVENTS = ("on_will_start", "on_startup")  # a failure here aborts the start; elsewhere it is logged
SLOT_EVENTS = ("on_startup", "on_will_stop", "on_reload")  # the context shows the server's slots then


class Ended(Enum):
    """How the start ended, which decides what the stop does."""

    SERVED = "served"  # ready once: drain, on_will_stop
    START_FAILED = "start failed"  # exit 3, result start-failed
    ABORTED = "aborted"  # a signal during the start


Serve = Callable[["Supervisor"], AbstractAsyncContextManager[None]]


class Supervisor:
    def __init__(self, config: Config, launch: Launch, shared: dict[str, Any] | None = None) -> None:
        self._first = (config, launch)
        self.shared: dict[str, Any] = shared if shared is not None else {}  # the built-ins' lifelong state
        self._background: list[asyncio.Task[None]] = []
        self.gate = Gate(config.reload_hold_timeout)
        self.notifier = Notifier(os.environ)
        self.lifecycle = Lifecycle(self.gate.follow, self.notifier.follow, METRICS.follow)
        self.started_at = time.monotonic()
        self.ready_at: float | None = None
        self.result: str | None = None
        self._signals = 0
        self._first_signal: signal.Signals | None = None
        self._first_signal_at = 0.0
        self._stop_requested = asyncio.Event()
        self._reload_started = asyncio.Event()
        self.force = asyncio.Event()  # set by a second signal
        self._hook_task: asyncio.Task[None] | None = None
        self._reload_task: asyncio.Task[dict[str, Any]] | None = None
        self.last_reload: dict[str, Any] | None = None
        self._drain_task: asyncio.Task[dict[str, Any]] | None = None
        self._drained = False  # a drain saved everything: the stop has nothing left to wait for or save
        self.session: aiohttp.ClientSession
        self.runner: HookRunner
        self.generation: Generation

    @property
    def config(self) -> Config:
        return self.generation.config if hasattr(self, "generation") else self._first[0]

    @property
    def launch(self) -> Launch:
        return self.generation.launch if hasattr(self, "generation") else self._first[1]

    @property
    def current(self) -> Generation:
        return self.generation

    @property
    def in_flight(self) -> int:
        return self.gate.in_flight

    # -- the whole life ------------------------------------------------------------------------------------

    async def run(self, serve: Serve) -> int:
        """`serve(supervisor)` is the public listener: listening while inside it."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
        async with self._client_session() as session:
            self.session = session
            self.generation = self.new_generation(*self._first)
            self.runner = HookRunner(session, self._builtin)
            for note in self.launch.notes:
                log.info("argv.rewritten", **note)
            for warning in self.config.warnings:
                log.warning("config.warning", note=warning)
            if self.launch.admin.token_file is not None and (off := self.launch.admin.read()[1]) is not None:
                log.warning("admin.off", why=off)
            log.info("wrapper.starting", listen=self.launch.listen.url, server=self.launch.url,
                     argv=self.launch.shown_argv, model=self.launch.model.as_dict())
            listening = serve(self)
            try:
                await listening.__aenter__()
            except OSError as exc:
                taken = exc.errno == errno.EADDRINUSE
                log.error("wrapper.listen_failed", listen=self.launch.listen.url, error=str(exc),
                          hint=(f"{self.launch.listen.url} is taken by another program: choose another --listen "
                                "(or stop what holds it)") if taken else "choose another --listen")
                return await self._stop(Ended.START_FAILED)
            try:
                return await self._live()
            finally:
                await listening.__aexit__(None, None, None)

    @contextlib.asynccontextmanager
    async def _client_session(self) -> AsyncIterator[aiohttp.ClientSession]:
        # Idle connections are dropped before llama-server's own 5 s keep-alive ends them under a new request.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        # auto_decompress off: the proxy passes compressed bodies through as they are.
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
            yield session

    def new_generation(self, config: Config, launch: Launch) -> Generation:
        return Generation(config, launch, LlamaClient(launch.url, self.session, launch.api_key), shared=self.shared)

    async def _progress(self) -> None:
        """Long work says how far it is, every PROGRESS_EVERY_S while it lasts (from PROGRESS_EVERY_S on)."""
        logged: tuple[str | None, float] = (None, 0.0)
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S / 4)
            shown = PROGRESS.snapshot()
            if shown is None or shown["for_s"] < PROGRESS_EVERY_S:
                continue
            if shown["phase"] != logged[0] or time.monotonic() - logged[1] >= PROGRESS_EVERY_S:
                log.info("progress", **shown, in_flight=self.gate.in_flight, held=self.gate.held)
                logged = (shown["phase"], time.monotonic())

    async def _live(self) -> int:
        ticker = asyncio.ensure_future(self._progress())
        try:
            return await self._lifetime()
        finally:
            ticker.cancel()

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
        while True:
            child = self.generation.child
            assert child is not None
            await first_of(child.wait(), self._stop_requested.wait(), self._reload_started.wait())
            if self._stop_requested.is_set():
                break
            if self._reload_started.is_set():  # a reload replaces the child: wait for it, then watch the new one
                self._reload_started.clear()
                if self._reload_task is not None:
                    await first_of(asyncio.wait([self._reload_task]), self._stop_requested.wait())
                continue
            if child is self.generation.child:
                break  # llama-server died on its own
        if self._reload_task is not None and not self._reload_task.done():
            self._reload_task.cancel()  # SIGTERM mid-reload: the stop then saves what is there
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reload_task
        return await self._stop(Ended.SERVED)

    # -- starting ------------------------------------------------------------------------------------------

    async def _start(self) -> None:
        self.lifecycle.to(State.STARTING)
        PROGRESS.begin("starting: on_will_start")
        await self._hook("on_will_start")
        PROGRESS.begin("starting: loading the model")
        await self.generation.start(self.server_line)
        self.notifier.status("starting: running on_startup (restoring slots)")
        PROGRESS.begin("starting: on_startup (restoring slots)")
        await surviving(self.generation, self.server_line, lambda: self._hook("on_startup"))
        PROGRESS.end()
        self.lifecycle.to(State.READY)
        self.ready_at = time.monotonic()
        self._background = [asyncio.ensure_future(work) for work in extensions.background(self)]
        if self.notifier.watchdog_s is not None:
            self._background.append(asyncio.ensure_future(self._watchdog(self.notifier.watchdog_s)))
        assert self.generation.child is not None
        log.info("wrapper.ready", listen=self.launch.listen.url, pid=self.generation.child.pid,
                 start_s=round(self.ready_at - self.started_at, 3))

    # -- reloading -----------------------------------------------------------------------------------------

    async def reload(self, body: dict[str, Any], why: str | None = None,
                     asks: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Reconfigure the running llama-server (see wrapper/reloader.py); one at a time, only when ready."""
        if self._reload_task is not None:
            raise ReloadRefused(BUSY_RELOADING, 409, Refusal.BUSY)
        if self.lifecycle.state is not State.READY:
            raise ReloadRefused(f"llama-wrapper is {self.lifecycle.state}: it reloads only when ready", 409,
                                Refusal.NOT_READY)
        reloader = Reloader(self)
        nxt = reloader.settle(body, why, asks)  # refusals come before anything stops
        task = asyncio.ensure_future(reloader.run(nxt))
        self._reload_task = task
        task.add_done_callback(self._reload_ended)
        self._reload_started.set()
        return await asyncio.shield(task)  # a client that hangs up does not stop the reload

    def _reload_ended(self, task: asyncio.Task[dict[str, Any]]) -> None:
        if self._reload_task is task:
            self._reload_task = None

    async def _watchdog(self, every: float) -> None:
        """WATCHDOG=1 while llama-server answers (a reload's held moments included: the wrapper is alive)."""
        while True:
            if self.lifecycle.state is State.RELOADING or await self.generation.client.healthy(timeout=every):
                self.notifier.watchdog()
            await asyncio.sleep(every)

    def install(self, generation: Generation) -> None:
        """Make a new generation the current one: requests released from now on go to it."""
        self.generation = generation

    async def drain(self, timeout: float) -> None:
        await self.gate.drain(timeout, self.force)

    async def drain_for_stop(self, timeout: float) -> dict[str, Any]:
        """POST /wrapper/drain: refuse new requests at once (/health 503), let those in flight finish within
        `timeout`, run on_will_stop (the save) now; a stop then only stops llama-server. A second call waits for
        the same drain."""
        if self._drain_task is None:
            if self.lifecycle.state is not State.READY:
                raise ReloadRefused(f"llama-wrapper is {self.lifecycle.state}: it drains only when ready", 409,
                                    Refusal.NOT_READY)
            self._drain_task = asyncio.ensure_future(self._drain_now(timeout))
        return await asyncio.shield(self._drain_task)

    async def _drain_now(self, timeout: float) -> dict[str, Any]:
        began = time.monotonic()
        self.lifecycle.to(State.DRAINING)
        in_flight = self.gate.in_flight
        log.info("wrapper.drain", in_flight=in_flight, timeout_s=timeout)
        if in_flight:
            self.notifier.status(f"draining: {in_flight} request(s) in flight")
        PROGRESS.begin("draining: requests in flight")
        await self.drain(timeout)
        drained_s = time.monotonic() - began
        self.notifier.status("draining: running on_will_stop (saving slots)")
        PROGRESS.begin("draining: on_will_stop (saving slots)")
        seen = len(self.runner.history)
        await self._hook("on_will_stop")
        PROGRESS.end()
        saved = [run.as_dict() for run in list(self.runner.history)[seen:]]
        self._drained = True
        answer = {"drained": True, "in_flight": in_flight, "left_in_flight": self.gate.in_flight,
                  "drain_s": round(drained_s, 3), "total_s": round(time.monotonic() - began, 3),
                  "on_will_stop": saved}
        log.info("wrapper.drained", **{k: v for k, v in answer.items() if k != "on_will_stop"},
                 hooks=[f"{r['action']}: {r['outcome']}" for r in saved])
        self.notifier.status("drained: waiting for the stop")
        return answer

    def request_stop(self) -> None:
        """Stop as if signalled (a reload that could bring back no server at all)."""
        self._stop_requested.set()

    # -- stopping ------------------------------------------------------------------------------------------

    async def _stop(self, ended: Ended) -> int:
        stop_began = time.monotonic()
        self.lifecycle.to(State.STOPPING)
        for task in self._background:
            task.cancel()
        if self._drain_task is not None and not self._drain_task.done():
            with contextlib.suppress(asyncio.CancelledError, Exception):  # a signal during a drain: let it finish
                await asyncio.shield(self._drain_task)
        served = ended is Ended.SERVED and not self._drained
        if served and not self.force.is_set():
            if self.gate.in_flight:
                self.notifier.status(f"stopping: draining {self.gate.in_flight} request(s)")
            PROGRESS.begin("stopping: draining")
            await self.drain(self.config.drain_timeout)
        if served and self.generation.alive and not self.force.is_set():
            self.notifier.status("stopping: running on_will_stop (saving slots)")
            PROGRESS.begin("stopping: on_will_stop (saving slots)")
            await self._hook("on_will_stop")
        self.notifier.status("stopping: stopping llama-server")
        PROGRESS.begin("stopping: stopping llama-server")
        finished = await self.generation.stop()
        PROGRESS.end()
        self.result = _result(finished, ended)
        stop_s = time.monotonic() - stop_began
        await self._hook("on_stopped", finished=finished)  # after a second signal: logged as skipped
        if ended_hooks := await self.runner.end_leftovers():
            log.info("hook.leftovers_ended", hooks=ended_hooks)
        self.lifecycle.to(State.STOPPED)
        exit_status = self._exit_status(finished, ended)
        logger = log.warning if stop_s > 0.8 * STOP_BUDGET else log.info
        logger("wrapper.stopped", result=self.result, exit_status=exit_status, stop_s=round(stop_s, 3),
               budget_hint_s=STOP_BUDGET)
        return exit_status

    def _exit_status(self, finished: Exit | None, ended: Ended) -> int:
        if ended is Ended.START_FAILED:
            return EXIT_START_FAILED
        if self._signals or finished is None:
            return EXIT_OK
        return finished.status  # the child died on its own

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
            self.force.set()
            if self._hook_task is not None:
                self._hook_task.cancel()
        log.info("wrapper.signal", signal=sig.name, count=self._signals)

    # -- hooks ---------------------------------------------------------------------------------------------

    async def run_hook(self, event: str) -> None:
        await self._hook(event)

    async def _hook(self, event: str, finished: Exit | None = None) -> None:
        """Run a hook; in a start hook a failure aborts the start (StartFailed), elsewhere it is logged."""
        hook_actions = self.config.hooks[event]
        if not hook_actions:
            return
        if self.force.is_set():
            log.warning("hook.skipped_by_second_signal", hook=event)
            return
        context = await self._context(event, finished)
        self._hook_task = asyncio.ensure_future(self.runner.run(event, hook_actions, context))
        try:
            await self._hook_task
        except HookFailed as exc:
            if event in START_EVENTS:
                raise StartFailed(str(exc)) from exc
            log.warning("hook.failed_during_stop" if event != "on_reload" else "hook.failed", hook=event,
                        error=str(exc))
        except asyncio.CancelledError:
            if not self.force.is_set():
                raise
            log.warning("hook.skipped_by_second_signal", hook=event)
        finally:
            self._hook_task = None

    async def _context(self, event: str, finished: Exit | None) -> dict[str, Any]:
        generation = self.generation
        slots: list[dict[str, Any]] = []
        needs_slots = any(a.kind != "builtin" for a in self.config.hooks[event])
        if needs_slots and generation.alive and event in SLOT_EVENTS:
            with contextlib.suppress(LlamaError):
                slots = await generation.client.slots()
        pid = generation.child.pid if generation.child else None
        return dict(hook_context.build(event, self.launch, pid, slots, self.result, finished, self.last_reload))

    def _builtin(self, name: str, options: Mapping[str, Any]) -> actions.BuiltinFn:
        return extensions.bind(name, options, self.generation)

    def observer(self) -> Observer | None:
        """What watches proxied responses, only while there is something to learn from them."""
        return extensions.observer(self.generation)

    def server_line(self, generation: Generation, line: str) -> None:
        log.log(logs.server_output_level(line, extensions.server_line(generation, line)), "server.output", line=line)

    # -- for the admin endpoints ---------------------------------------------------------------------------

    def metrics(self) -> bytes:
        """The wrapper's families, the gauges read now."""
        METRICS.in_flight.set(self.gate.in_flight)
        METRICS.held.set(self.gate.held)
        extensions.refresh_metrics(self.generation)
        return METRICS.text()

    def status(self) -> dict[str, Any]:
        return status.document(self.lifecycle.state, self.generation, self.gate, self.started_at, self.ready_at,
                               extensions.status(self.generation), list(self.runner.history),
                               self.last_reload)


def _result(finished: Exit | None, ended: Ended) -> str:
    """systemd-style service result for `on_stopped`."""
    if ended is Ended.START_FAILED:
        return "start-failed"
    if finished is None:
        return "success"
    if finished.killed:
        return "timeout"
    if finished.returncode == 0 or (finished.asked and finished.returncode == -signal.SIGTERM):
        return "success"
    return "signal" if finished.signal else "exit-code"
