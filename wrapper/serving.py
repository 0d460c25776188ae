"""What serves now: the current generation, the gate requests pass to reach it, and the state the gate follows.
A reload installs the next generation here. Forwarding, the reloader and the built-ins (as `Host`) are given this
one object; the supervisor only starts it, watches it and stops it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import aiohttp
import structlog

from wrapper import argv as args
from wrapper import built_ins
from wrapper.aio import first_of
from wrapper.child import Child
from wrapper.config import Config
from wrapper.gate import Gate
from wrapper.generation import Generation, ServerLost, StartFailed, surviving
from wrapper.hooks_running import Hooks
from wrapper.kept import Kept
from wrapper.launch import Asks, Launch
from wrapper.lifecycle import Lifecycle, State
from wrapper.llama import LlamaClient
from wrapper.metrics import METRICS
from wrapper.notify import Notifier
from wrapper.priority import PRIORITY
from wrapper.reload_plan import BUSY_RELOADING, Refusal, ReloadRefused
from wrapper.reloader import NextGeneration, Reloader
from wrapper.seats import Seats
from wrapper.server_context import AUTO_SLOTS
from wrapper.sleeping import Sleep, idle_for
from wrapper.watchdog import WATCHDOG, Loss, Lost, WatchdogSettings, died, hung

log = structlog.get_logger()
T = TypeVar("T")

LOSS_SEEN_S = 2.0  # a cut exchange: how long its server's end may take to be seen


class Serving:
    """The generation that serves now, with the gate and the state in front of it; the reload entry."""

    def __init__(self, config: Config, launch: Launch, session: aiohttp.ClientSession, shared: Kept,
                 hooks: Hooks, notifier: Notifier) -> None:
        self.session = session
        self._shared = shared  # the built-ins' state for the wrapper's whole life
        self.gate = Gate(config.reload_hold_timeout)
        self._changed = asyncio.Event()  # set at every change of state
        self.lifecycle = Lifecycle(self.gate.follow, notifier.follow, METRICS.follow, lambda _: self._changed.set())
        self.current = self.new_generation(config, launch)
        self.last_reload: dict[str, Any] | None = None  # the last reload's answer
        self._hooks = hooks
        self._reloading: asyncio.Task[dict[str, Any]] | None = None
        self._reload_began = asyncio.Event()
        self._risky = 0  # built-ins' steps that may kill the server, running now (Serving.survive)
        self._risky_ended = asyncio.Event()
        self._restart_failed = False
        self.heard_at = time.monotonic()  # a request in flight last sent to llama-server or heard from it
        self.cut_by_loss = 0  # requests whose exchange was cut, waiting to learn whether their server was lost
        self.seats = Seats()  # the slots' queue (wrapper/seats.py), for the wrapper's life
        self.sleep = Sleep()  # the wrapper's sleeps (wrapper/sleeping.py); the supervisor runs them
        self.gate.wake = self.sleep.wake

    def heard(self) -> None:
        """A request in flight sent to llama-server, or a byte of an answer came back (the watchdog's stall)."""
        self.heard_at = time.monotonic()

    @property
    def state(self) -> State:
        return self.lifecycle.state

    @property
    def in_flight(self) -> int:
        return self.gate.in_flight

    @property
    def reloading(self) -> bool:
        """A reload (or a built-in's start again) runs now."""
        return self._reloading is not None

    def idle_s(self) -> float:
        """How long nothing has been asked of llama-server: no request in flight, held or arriving, no reload and
        no built-in's risky step running (0 while any is)."""
        if self._reloading is not None or self._risky or self.cut_by_loss or self.seats.status().get("waiting"):
            return 0.0
        return idle_for(self.gate.active_at, self.gate.in_flight, self.gate.held)

    def sleep_soon(self, why: str, idle_for: float) -> bool:
        """A built-in asks for a sleep now (the pool: another member needs this one's memory); False unless the
        wrapper is ready and idle for `idle_for` seconds."""
        if self.lifecycle.state is not State.READY or self.idle_s() < max(idle_for, 1e-9):
            return False
        self.sleep.ask(why)
        return True

    def queue(self) -> Generation:
        """Set the slots' queue for the generation that serves now (its slots, `priority:`); that generation."""
        generation = self.current
        settings = PRIORITY.of(generation.config)
        self.seats.resize(slot_count(generation))
        self.seats.max_pauses = settings.max_pauses
        self.seats.preempt = built_ins.preemption(generation.config)[0]
        return generation

    def new_generation(self, config: Config, launch: Launch) -> Generation:
        return Generation(config, launch, LlamaClient(launch.url, self.session, launch.api_key), shared=self._shared)

    def install(self, generation: Generation) -> None:
        """Make a new generation the current one: requests released from now on go to it."""
        self.current = generation

    def hand_over(self) -> int:
        """Cut the streams in flight that go on on the next server (a reload's hand-over); how many."""
        return self.gate.hand_over()

    async def drain(self, timeout: float, cut: bool = True) -> bool:
        """Let the requests in flight finish within `timeout` (a second signal ends the wait), cut the rest (unless
        not `cut`); whether none is left."""
        return await self.gate.drain(timeout, self._hooks.forced, cut)

    async def reload(self, body: dict[str, Any], why: str | None = None,
                     asks: Asks | None = None, cut: bool = True) -> dict[str, Any]:
        """Reconfigure the running llama-server (see wrapper/reloader.py); one at a time, only when ready."""
        if self._reloading is not None:
            raise ReloadRefused(BUSY_RELOADING, 409, Refusal.BUSY)
        if self.lifecycle.state is State.ASLEEP:
            return self._reload_at_wake(Reloader(self).settle(body, why, asks, cut))
        if self.lifecycle.state is not State.READY:
            raise ReloadRefused(f"llama-wrapper is {self.lifecycle.state}: it reloads only when ready", 409,
                                Refusal.NOT_READY)
        reloader = Reloader(self)
        nxt = reloader.settle(body, why, asks, cut)  # refusals come before anything stops
        task = asyncio.ensure_future(self._reload(reloader.run(nxt)))
        self._reloading = task
        task.add_done_callback(self._reload_ended)
        self._reload_began.set()
        return await asyncio.shield(task)  # a client that hangs up does not stop the reload

    def _reload_at_wake(self, nxt: NextGeneration) -> dict[str, Any]:
        """A reload while asleep: checked now, applied when the server starts at the wake (the last one asked)."""
        self.sleep.pending = nxt
        built_ins.slept(self.current, True)  # its fit (a pool member's share) is taken at the wake, not now
        answer = {"success": True, "n_ctx": None, "downtime_ms": 0.0, "drain_ms": 0.0, "changes": nxt.plan.changes,
                  "message": "asleep: the new settings apply when the next request wakes llama-server",
                  "at_wake": True, "overlap": False, "overlap_why": "asleep: no server runs to overlap with",
                  "context": None, "save": None, "restore": None, "slots": []}
        log.info("reload.at_wake", changes=nxt.plan.changes)
        self.last_reload = answer
        return answer

    async def _reload(self, cycle: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        self.last_reload = answer = await cycle
        await self._hooks.run("on_reload", self.current, reload=answer)
        return answer

    def _reload_ended(self, task: asyncio.Task[dict[str, Any]]) -> None:
        if self._reloading is task:
            self._reloading = None

    async def survive(self, step: Callable[[], Awaitable[T]]) -> T | None:
        """A built-in's step that may kill llama-server, on the request path (see Host.survive)."""
        generation = self.current
        child = generation.child
        self._risky += 1
        try:
            return await step()
        except ServerLost as exc:
            await self._restart(generation, child, str(exc))
            return None
        finally:
            self._risky -= 1
            self._risky_ended.set()

    async def _restart(self, generation: Generation, child: Child | None, why: str) -> None:
        """Start again the server that died under a step — only that one, once: not one a reload replaced, one
        another step started again meanwhile, or after a start that failed (then the wrapper stops)."""
        if self._reloading is not None:
            await asyncio.wait([self._reloading])
        if (self.current is not generation or generation.child is not child or generation.alive
                or self._restart_failed or self.lifecycle.state is not State.READY):
            return
        task = asyncio.ensure_future(self._started_again(why))
        self._reloading = task
        task.add_done_callback(self._reload_ended)
        self._reload_began.set()
        await asyncio.shield(task)

    async def _started_again(self, why: str) -> dict[str, Any]:
        generation, began = self.current, time.monotonic()
        self.lifecycle.to(State.RELOADING)  # requests wait for it, as for a reload
        log.warning("wrapper.restarting_server", on="request", why=why, attempt=1)
        METRICS.server_restarts.labels(reason="restore").inc()
        try:
            await generation.stop()
            await generation.start(built_ins.server_output)
            await surviving(generation, built_ins.server_output, lambda: self._hooks.run("on_startup", generation))
        except StartFailed as exc:
            self._restart_failed = True
            log.error("wrapper.restart_failed", error=str(exc))  # the server stays dead: the wrapper stops
        # cancelled (a stop): the state stays `reloading` and the stop takes it from there, nothing released
        self.lifecycle.to(State.READY)
        return {"restarted": generation.alive, "s": round(time.monotonic() - began, 3)}

    async def lost(self, watching: WatchdogSettings | None = None) -> Lost:
        """Return when llama-server is lost: dead on its own (one that a reload replaces is not lost, nor one a
        built-in's step starts again; a reload that can bring back no server at all leaves a dead one current),
        or with `watching`, hung."""
        while True:
            child = self.current.child
            assert child is not None
            hanging = asyncio.ensure_future(hung(self, watching)) if watching is not None else None
            try:
                await first_of(child.wait(), self._reload_began.wait(), *([hanging] if hanging else []))
            finally:
                if hanging is not None and not hanging.done():
                    hanging.cancel()
            if hanging is not None and hanging.done() and not hanging.cancelled() and child.alive \
                    and not self._reload_began.is_set() and child is self.current.child:
                return hanging.result()
            while self._risky and not self._reload_began.is_set():  # died under a built-in's step: it may
                self._risky_ended.clear()                          # start the server again (survive)
                await first_of(self._risky_ended.wait(), self._reload_began.wait())
            if self._reload_began.is_set():  # wait for the reload, then watch the server it leaves
                self._reload_began.clear()
                if self._reloading is not None:
                    await asyncio.wait([self._reloading])
                continue
            if child is self.current.child and not child.alive:
                return died(await child.wait())

    async def lost_under(self, generation: Generation, within: float = LOSS_SEEN_S) -> Loss:
        """After an exchange with `generation` was cut: whether its server was lost, and if so whether the watchdog
        starts another (the caller's next pass waits at the gate for it). Its end may be seen a moment after the
        cut. Counted in `cut_by_loss` meanwhile."""
        child = generation.child
        if child is None:
            return Loss.NONE
        self.cut_by_loss += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(child.wait(), within)
            if child.alive and self.lifecycle.state is not State.RESTARTING:
                return Loss.NONE  # it is well: the cut was another failure
            if not WATCHDOG.of(generation.config).enabled:
                return Loss.GONE
            with contextlib.suppress(TimeoutError):  # the supervisor holds the gate before the next pass reaches it
                await asyncio.wait_for(self._moved_on(generation), within)
            serving_again = (State.READY, State.RESTARTING, State.RELOADING)
            return Loss.BACK if self.lifecycle.state in serving_again else Loss.GONE  # given up: it stops
        finally:
            self.cut_by_loss -= 1

    async def _moved_on(self, generation: Generation) -> None:
        """Until the wrapper no longer serves with `generation` as if it were well (restarting, stopping, or
        another generation installed)."""
        while self.lifecycle.state is State.READY and self.current is generation:
            self._changed.clear()
            await self._changed.wait()

    async def abandon_reload(self) -> None:
        """At a stop: cancel a reload that runs (the stop then saves what is there)."""
        if self._reloading is not None and not self._reloading.done():
            self._reloading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reloading


def slot_count(generation: Generation) -> int:
    """The slots a generation's server has: as it said at its start, else its -np (llama-server's automatic count)."""
    if generation.context is not None:
        return generation.context.slots
    given = args.get(generation.launch.argv, args.PARALLEL)
    return int(given) if given is not None and given.strip().isdigit() and int(given) > 0 else AUTO_SLOTS
