"""The supervisor: start, serve, reload, stop; hooks at each moment; exit status as documented.

A generation is one llama-server process with its argv; a reload (wrapper/reloader.py) replaces it while the
supervisor, its listener and its hooks' notion of the wrapper's life go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import structlog

from wrapper import actions, extensions
from wrapper.actions import HookFailed, HookRunner
from wrapper.aio import first_of
from wrapper.child import Child, Exit, spawn
from wrapper.config import Config
from wrapper.gate import Gate
from wrapper.generation import Generation
from wrapper.launch import PRIVATE_HOST, Launch
from wrapper.lifecycle import Lifecycle, State
from wrapper.llama import LlamaClient, LlamaError
from wrapper.proxy import Observer
from wrapper.reload_plan import BUSY_RELOADING, ReloadRefused

log = structlog.get_logger()

EXIT_OK, EXIT_START_FAILED = 0, 3
STOP_BUDGET = 10.0  # llama-swap's default unloadTimeout: warn when a stop comes close to it
READY_POLL = 0.1
KEEPALIVE_S = 4.0
CUT_GRACE = 2.0  # how long requests cut at the drain deadline get to unwind


class StartFailed(Exception):
    pass


class Supervisor:
    def __init__(self, config: Config, launch: Launch, shared: dict[str, Any] | None = None) -> None:
        self.config, self.launch = config, launch
        self.shared: dict[str, Any] = shared if shared is not None else {}  # the built-ins' lifelong state
        self._background: list[asyncio.Task[None]] = []
        self.gate = Gate(config.reload_hold_timeout)
        self.lifecycle = Lifecycle(self.gate.follow)
        self.child: Child | None = None
        self.started_at = time.monotonic()
        self.ready_at: float | None = None
        self.result: str | None = None
        self._signals = 0
        self._stop_requested = asyncio.Event()
        self._reload_started = asyncio.Event()
        self._force = asyncio.Event()  # set by a second signal
        self._hook_task: asyncio.Task[None] | None = None
        self._reload_task: asyncio.Task[dict[str, Any]] | None = None
        self.last_reload: dict[str, Any] | None = None
        self.session: aiohttp.ClientSession
        self.runner: HookRunner
        self.runtime: Generation

    # -- the whole life ------------------------------------------------------------------------------------

    async def run(self, serve: Callable[[Supervisor], Awaitable[Callable[[], Awaitable[None]]]]) -> int:
        """`serve(supervisor)` starts the public listener and returns its cleanup coroutine function."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # Idle connections are dropped before llama-server's own 5 s keep-alive ends them under a new request.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        # auto_decompress off: the proxy passes compressed bodies through as they are.
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
            self.session = session
            client = LlamaClient(self.launch.url, session, self.launch.api_key)
            self.runtime = Generation(self.config, self.launch, client, shared=self.shared, host=self)
            self.runner = HookRunner(session, self._builtin)
            for note in self.launch.notes:
                log.info("argv.rewritten", **note)
            for warning in self.config.warnings:
                log.warning("config.warning", note=warning)
            log.info("wrapper.starting", listen=self.launch.listen.url, server=self.launch.url,
                     argv=self.launch.shown_argv, model=self.launch.model.as_dict())
            try:
                cleanup = await serve(self)
            except OSError as exc:
                log.error("wrapper.listen_failed", listen=self.launch.listen.url, error=str(exc))
                return await self._stop(started=False, start_failed=True)
            try:
                return await self._live()
            finally:
                await cleanup()

    async def _live(self) -> int:
        start = asyncio.ensure_future(self._start())
        await first_of(start, self._stop_requested.wait())
        if start.cancelled() or not start.done():  # a stop signal during the start aborted it
            with contextlib.suppress(asyncio.CancelledError, StartFailed):
                await start
            return await self._stop(started=False, start_failed=False)
        if start.exception() is not None:
            log.error("wrapper.start_failed", error=str(start.exception()))
            return await self._stop(started=False, start_failed=True)
        while True:
            child = self.child
            assert child is not None
            await first_of(child.wait(), self._stop_requested.wait(), self._reload_started.wait())
            if self._stop_requested.is_set():
                break
            if self._reload_started.is_set():  # a reload replaces the child: wait for it, then watch the new one
                self._reload_started.clear()
                if self._reload_task is not None:
                    await first_of(asyncio.wait([self._reload_task]), self._stop_requested.wait())
                continue
            if child is self.child:
                break  # llama-server died on its own
        if self._reload_task is not None and not self._reload_task.done():
            self._reload_task.cancel()  # SIGTERM mid-reload: the stop then saves what is there
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reload_task
        return await self._stop(started=True, start_failed=False)

    # -- starting ------------------------------------------------------------------------------------------

    async def _start(self) -> None:
        self.lifecycle.to(State.STARTING)
        await self._hook("on_will_start", start=True)
        self.child = await self.spawn_ready(self.launch, self.runtime)
        await self._hook("on_startup", start=True)
        self.lifecycle.to(State.READY)
        self.ready_at = time.monotonic()
        self._background = [asyncio.ensure_future(work) for work in extensions.background(self)]
        log.info("wrapper.ready", listen=self.launch.listen.url, pid=self.child.pid,
                 start_s=round(self.ready_at - self.started_at, 3))

    async def spawn_ready(self, launch: Launch, runtime: Generation) -> Child:
        """Start a llama-server generation and wait until it answers /health 200; StartFailed otherwise."""
        began = time.monotonic()
        try:
            child = await spawn(launch.argv, launch.env, lambda line: self._on_server_line(runtime, line))
        except OSError as exc:
            raise StartFailed(f"cannot start {launch.argv[0]!r}: {exc.strerror}") from exc
        runtime.child = child
        log.info("child.spawned", pid=child.pid, port=launch.port)
        deadline = began + self.config.ready_timeout
        while not await runtime.client.healthy(timeout=1.0):
            if not child.alive:
                finished = await child.wait()
                raise StartFailed(f"llama-server exited with status {finished.status} before it was ready "
                                  f"(last output: {' | '.join(list(child.tail)[-3:])})")
            if time.monotonic() > deadline:
                await child.stop(self.config.stop_timeout)
                raise StartFailed(f"llama-server was not ready within server.ready_timeout "
                                  f"({self.config.ready_timeout:g}s)")
            await asyncio.sleep(READY_POLL)
        log.info("child.ready", pid=child.pid, load_s=round(time.monotonic() - began, 3))
        return child

    async def drain(self, timeout: float) -> None:
        """Let requests in flight finish within `timeout`, then cut the rest so that slots are idle for a save."""
        if not self.gate.in_flight:
            return
        log.info("wrapper.draining", in_flight=self.gate.in_flight, timeout_s=timeout)
        await first_of(self.gate.drained(timeout), self._force.wait())
        if self.gate.in_flight:
            # Cut what is left: llama-server frees those slots, so the save that follows runs on idle ones.
            log.warning("wrapper.drain_timeout", in_flight=self.gate.in_flight, cut=self.gate.cut())
            await self.gate.drained(CUT_GRACE)

    # -- reloading -----------------------------------------------------------------------------------------

    @property
    def current(self) -> Generation:
        return self.runtime

    @property
    def in_flight(self) -> int:
        return self.gate.in_flight

    async def reload(self, body: dict[str, Any], why: str | None = None) -> dict[str, Any]:
        """Reconfigure the running llama-server (see wrapper/reloader.py); one at a time, only when ready."""
        from wrapper.reloader import Reloader

        if self._reload_task is not None:
            raise ReloadRefused(BUSY_RELOADING, 409)
        if self.lifecycle.state is not State.READY:
            raise ReloadRefused(f"llama-wrapper is {self.lifecycle.state}: it reloads only when ready", 409)
        reloader = Reloader(self)
        prepared = reloader.prepare(body, why)  # refusals come before anything stops
        task = asyncio.ensure_future(reloader.run(prepared))
        self._reload_task = task
        task.add_done_callback(self._reload_ended)
        self._reload_started.set()
        return await asyncio.shield(task)  # a client that hangs up does not stop the reload

    def _reload_ended(self, task: asyncio.Task[dict[str, Any]]) -> None:
        if self._reload_task is task:
            self._reload_task = None

    def install(self, config: Config, launch: Launch, runtime: Generation) -> None:
        """Make a new generation the current one: requests released from now on go to it."""
        self.config, self.launch, self.runtime = config, launch, runtime
        self.child = runtime.child

    def request_stop(self) -> None:
        """Stop as if signalled (a reload that could bring back no server at all)."""
        self._stop_requested.set()

    # -- stopping ------------------------------------------------------------------------------------------

    async def _stop(self, started: bool, start_failed: bool) -> int:
        stop_began = time.monotonic()
        self.lifecycle.to(State.STOPPING)
        for task in self._background:
            task.cancel()
        if started and not self._force.is_set():
            await self.drain(self.config.drain_timeout)
        if started and self.child is not None and self.child.alive and not self._force.is_set():
            await self._hook("on_will_stop", start=False)
        finished = await self.stop_child(self.child) if self.child is not None else None
        self.result = _result(finished, start_failed)
        stop_s = time.monotonic() - stop_began
        if not self._force.is_set():
            await self._hook("on_stopped", start=False, finished=finished)
        if ended := await self.runner.end_leftovers():
            log.info("hook.leftovers_ended", hooks=ended)
        self.lifecycle.to(State.STOPPED)
        status = self._exit_status(finished, start_failed)
        logger = log.warning if stop_s > 0.8 * STOP_BUDGET else log.info
        logger("wrapper.stopped", result=self.result, exit_status=status, stop_s=round(stop_s, 3),
               budget_hint_s=STOP_BUDGET)
        return status

    async def stop_child(self, child: Child) -> Exit:
        if child.alive:
            log.info("child.stopping", pid=child.pid, timeout_s=self.config.stop_timeout)
        finished = await child.stop(self.config.stop_timeout)
        log.info("child.exited", pid=child.pid, code=finished.code, signal=finished.signal_name,
                 killed_after_timeout=finished.killed)
        return finished

    def _exit_status(self, finished: Exit | None, start_failed: bool) -> int:
        if start_failed:
            return EXIT_START_FAILED
        if self._signals or finished is None:
            return EXIT_OK
        return finished.status  # the child died on its own

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            self._stop_requested.set()
        else:  # a second signal: skip what is left of the hooks (and the drain), still stop the child
            self._force.set()
            if self._hook_task is not None:
                self._hook_task.cancel()
        log.info("wrapper.signal", signal=sig.name, count=self._signals)

    # -- hooks ---------------------------------------------------------------------------------------------

    async def run_hook(self, event: str) -> None:
        """Run a hook whose failure is logged, never fatal (on_reload)."""
        await self._hook(event, start=False)

    async def _hook(self, event: str, start: bool, finished: Exit | None = None) -> None:
        hook_actions = self.config.hooks[event]
        if not hook_actions or self._force.is_set():
            return
        context = await self._context(event, finished)
        self._hook_task = asyncio.ensure_future(self.runner.run(event, hook_actions, context))
        try:
            await self._hook_task
        except HookFailed as exc:
            if start:
                raise StartFailed(str(exc)) from exc
            log.warning("hook.failed_during_stop", hook=event, error=str(exc))
        except asyncio.CancelledError:
            if not self._force.is_set():
                raise
            log.warning("hook.skipped_by_second_signal", hook=event)
        finally:
            self._hook_task = None

    async def _context(self, event: str, finished: Exit | None) -> dict[str, Any]:
        child = self.child
        slots: list[dict[str, Any]] = []
        needs_slots = any(a.kind != "builtin" for a in self.config.hooks[event])
        if needs_slots and child is not None and child.alive and event in ("on_startup", "on_will_stop", "on_reload"):
            with contextlib.suppress(LlamaError):
                slots = await self.runtime.client.slots()
        return {
            "event": event,
            "server": {"url": self.launch.url, "host": PRIVATE_HOST, "port": self.launch.port,
                       "pid": child.pid if child else None, "argv": list(self.launch.argv)},
            "listen": {"url": self.launch.listen.url, "host": self.launch.listen.host,
                       "port": self.launch.listen.port},
            "model": self.launch.model.as_dict(),
            "slots": slots,
            "result": self.result,
            "exit_code": finished.code if finished else None,
            "exit_signal": finished.signal_name if finished else None,
            "reload": self.last_reload,
            "env": dict(os.environ),
        }

    def _builtin(self, name: str, options: Mapping[str, Any]) -> actions.BuiltinFn:
        return extensions.bind(name, options, self.runtime)

    def observer(self) -> Observer | None:
        """What watches proxied responses, only while there is something to learn from them."""
        return extensions.observer(self.runtime)

    def _on_server_line(self, runtime: Generation, line: str) -> None:
        if extensions.server_line(runtime, line):
            log.info("server.output", line=line)
        else:
            log.debug("server.output", line=line)

    # -- for the admin endpoints ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        child = self.child
        now = time.monotonic()
        return {
            "state": str(self.lifecycle.state),
            "listen": self.launch.listen.url,
            "server": {"url": self.launch.url, "pid": child.pid if child and child.alive else None,
                       "argv": self.launch.shown_argv},
            "model": self.launch.model.as_dict(),
            "uptime_s": round(now - self.started_at, 3),
            "ready_for_s": round(now - self.ready_at, 3) if self.ready_at else None,
            "requests": {"in_flight": self.gate.in_flight, "held": self.gate.held},
            "argv_changes": self.launch.notes,
            **extensions.status(self.runtime),
            "hooks": [run.as_dict() for run in list(self.runner.history)[-20:]],
            "last_reload": {k: v for k, v in self.last_reload.items() if k != "slots"} if self.last_reload else None,
        }


def _result(finished: Exit | None, start_failed: bool) -> str:
    """systemd-style service result for `on_stopped`."""
    if start_failed:
        return "start-failed"
    if finished is None:
        return "success"
    if finished.killed:
        return "timeout"
    if finished.returncode == 0 or (finished.asked and finished.returncode == -signal.SIGTERM):
        return "success"
    return "signal" if finished.signal else "exit-code"
