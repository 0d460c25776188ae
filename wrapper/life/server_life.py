"""The one owner of llama-server's life: it starts, restarts, puts to sleep, wakes, drains and stops the server, and it
is the only code that changes the wrapper's state (wrapper/lifecycle.py) — the reloader's moves too, which it asks
for (`hold`, `install`, `release`).

A server comes up one way (`_up`: the state held, on_will_start, the start, on_startup surviving a server that dies
under a restore, ready, the built-ins' background work) and goes down one way (`_down`: the drain, on_will_stop,
the stop, on_stopped); wrapper/life/occasions.py says what each occasion changes. Every restart spends one budget
(watchdog.restarts within watchdog.window): after a crash, a hang, or a restore the server died under.

It is also the `Host` the built-ins are given: what serves, a reload, a sleep soon, and a step that may lose the
server (reported to the one watch, wrapper/life/watch.py, and restarted as for a crash).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, TypeVar

import structlog

from wrapper import built_ins
from wrapper.actions import HookRun
from wrapper.configuration.config import Config, ConfigError
from wrapper.configuration.reload_plan import BUSY_RELOADING, Refusal, ReloadRefused
from wrapper.configuration.sections import WATCHDOG
from wrapper.launching.launch import Asks, Launch
from wrapper.life.hooks_running import Hooks
from wrapper.life.notify import Notifier
from wrapper.life.occasions import Occasion, down, up
from wrapper.life.reloader import NextGeneration, Reloader
from wrapper.life.sleeping import Sleep, remember
from wrapper.life.watch import Watch
from wrapper.life.watchdog import Budget, Lost
from wrapper.lifecycle import State
from wrapper.metrics import METRICS
from wrapper.progress import PROGRESS
from wrapper.server.child import Exit
from wrapper.server.generation import Generation, ServerLost, StartFailed
from wrapper.server.llama import LlamaError
from wrapper.serving import Serving

log = structlog.get_logger()
T = TypeVar("T")


class Ended(Enum):
    """How serving ended, which decides what the stop does and what on_stopped is told."""

    SERVED = "served"  # ready once: drain, on_will_stop
    START_FAILED = "start failed"  # exit 3, result start-failed
    ABORTED = "aborted"  # a signal during the start
    HUNG = "hung"  # served, then llama-server hung and the watchdog, out of restarts, killed it: result watchdog


@dataclass(frozen=True)
class Gone:
    """A server brought down: what on_will_stop said, how the process ended (None: not stopped, or never started),
    and how long the drain took."""

    saved: list[HookRun]
    finished: Exit | None
    drain_s: float


class ServerLife:
    """llama-server's life, from the first start to the last stop, and the built-ins' Host."""

    def __init__(self, serving: Serving, hooks: Hooks, notifier: Notifier) -> None:
        self.serving, self.hooks, self.notifier = serving, hooks, notifier
        serving.lifecycle.followed_by(notifier.follow)
        watching = WATCHDOG.of(serving.current.config)
        self.budget = Budget(watching.restarts, watching.window)  # every restart, whatever lost the server
        self.watch = Watch(serving)
        self.sleep = Sleep()  # the wrapper's sleeps (wrapper/life/sleeping.py)
        serving.gate.wake = self.sleep.wake
        self.started_at = time.monotonic()
        self.ready_at: float | None = None
        self.killed_hung = False  # the watchdog gave up on a hung server and killed it
        self.last_reload: dict[str, Any] | None = None  # the last reload's answer
        self._drain: asyncio.Task[dict[str, Any]] | None = None  # POST /wrapper/drain, asked once
        self._drained = False  # drained and saved: the stop has nothing left to wait for or save
        self._background: list[asyncio.Task[None]] = []
        self._pinging: asyncio.Task[None] | None = None

    # -- what the built-ins are given (wrapper/server/generation.py's Host) -------------------------------------------

    @property
    def current(self) -> Generation:
        return self.serving.current

    @property
    def in_flight(self) -> int:
        return self.serving.in_flight

    @property
    def state(self) -> State:
        return self.serving.state

    async def survive(self, step: Callable[[], Awaitable[T]]) -> T | None:
        return await self.watch.survive(step)

    def sleep_soon(self, why: str, idle_for: float) -> bool:
        """A built-in asks for a sleep now (the pool: another member needs this one's memory); False unless the
        wrapper is ready and idle for `idle_for` seconds."""
        if self.state is not State.READY or self.idle_s() < max(idle_for, 1e-9):
            return False
        self.sleep.ask(why)
        return True

    def idle_s(self) -> float:
        """How long nothing has been asked of llama-server: no request in flight, held or arriving, no reload and
        no built-in's risky step running (0 while any is)."""
        serving = self.serving
        if self.watch.reloading is not None or self.watch.risky or serving.cut_by_loss \
                or serving.seats.status().get("waiting") or self.ready_at is None:
            return 0.0
        return min(serving.gate.idle_s(), time.monotonic() - self.ready_at)  # nothing could ask before it was ready

    # -- the way up ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """The first llama-server, as the launch says (StartFailed)."""
        await self._up(Occasion.START)
        child = self.current.child
        assert child is not None and self.ready_at is not None
        log.info("wrapper.ready", listen=self.current.launch.listen.url, pid=child.pid,
                 start_s=round(self.ready_at - self.started_at, 3))

    async def restart(self, lost: Lost) -> bool:
        """Start llama-server again as at a start, requests held meanwhile (on_startup runs: the slots come back);
        False when it may not be (the watchdog is off for a crash or a hang, or the budget is spent): the wrapper
        then stops with the server's status."""
        serving, settings = self.serving, WATCHDOG.of(self.serving.current.config)
        old = serving.current
        up_s = round(time.monotonic() - (self.ready_at or self.started_at), 3)
        log.error("wrapper.server_lost", reason=lost.reason, why=lost.why,
                  in_flight=serving.in_flight + serving.cut_by_loss,  # those cut by it wait to learn what it was
                  held=serving.gate.held, up_s=up_s, pid=old.child.pid if old.child else None)
        if not (settings.enabled or lost.reason == "restore") or not self.budget.allows():
            self._give_up("watchdog.enabled is false" if not (settings.enabled or lost.reason == "restore") else
                          "watchdog.restarts is 0" if not settings.restarts else
                          f"{settings.restarts} restart(s) within watchdog.window ({settings.window:g}s) already")
            if old.child is not None and old.child.alive:  # hung: no stop it could hear (SIGTERM, the save)
                self.killed_hung = True
                old.child.end_leftovers()
                await old.child.wait()
            return False
        began = time.monotonic()
        self._to(State.RESTARTING)  # requests wait, as during a reload; /health says 503
        self._stop_background()
        if old.child is not None:  # what is left of it (a hung one, its process group)
            old.child.kill()
            await old.child.wait()
        while True:
            try:
                await self._up(Occasion.RESTART, lost=lost)
                break
            except StartFailed as exc:
                log.error("wrapper.restart_failed", error=str(exc), attempt=self.budget.count)
                if not self.budget.allows():
                    self._give_up(f"{settings.restarts} restart(s) within watchdog.window ({settings.window:g}s) "
                                  "already, the last one failed")
                    return False
                lost = Lost("crash", f"the restart failed: {exc}", None)
        log.info("wrapper.server_back", reason=lost.reason, pid=self.current.child.pid if self.current.child else None,
                 restarts=self.budget.count, pause_s=round(time.monotonic() - began, 3))
        return True

    async def wake(self) -> bool:
        """Start llama-server again (with a reload asked while asleep), restore, and let the held requests go (True);
        False when it did not come up: the held requests are answered 503 with the reason, it stays asleep."""
        serving, sleep = self.serving, self.sleep
        old, pending, began = serving.current, sleep.pending, time.monotonic()
        held = serving.gate.held
        self._to(State.WAKING)
        METRICS.asleep.set(0)
        log.info("sleep.waking", held=held, reload=pending.plan.changes if pending is not None else None)
        self.notifier.status("waking: starting llama-server, restoring slots; requests held")
        try:
            built_ins.slept(old, False)
            await self._up(Occasion.WAKE, pending.config if pending is not None else None)
        except (StartFailed, ConfigError, LlamaError, OSError) as exc:
            why = str(exc) + ("; the reload asked while asleep is dropped" if pending is not None else "")
            await self._not_woken(old, why, began)
            return False
        sleep.pending = None
        wake_s = sleep.woke(time.monotonic() - began)
        log.info("sleep.woken", wake_s=wake_s, held=serving.gate.held, pid=self.current.child.pid
                 if self.current.child else None, reload=pending.plan.changes if pending is not None else None)
        return True

    async def _up(self, occasion: Occasion, config: Config | None = None, lost: Lost | None = None) -> None:
        """Bring a llama-server up for `occasion` (StartFailed; a server started that did not come up is stopped):
        the restart budget spent for what was `lost`, its generation (the first one at a start; fitted again from
        `config` or the current one's when the table says so), on_will_start, the start, installed, on_startup,
        ready, the built-ins' background work."""
        recipe, serving, old = up(occasion), self.serving, self.serving.current
        if serving.state is not recipe.held:
            self._to(recipe.held)
        if recipe.spends and lost is not None:
            self._spend(lost)
        new = old
        try:  # a server started that did not come up is stopped (installed: the stop reports its exit)
            if recipe.fits:
                PROGRESS.begin(f"{recipe.doing}: fitting")  # a pool member may wait here for the others to give
                fitted = config if config is not None else old.config
                launch = await asyncio.to_thread(built_ins.launch_for, fitted, old.shared)
                new = serving.new_generation(fitted, replace(launch, listen=old.launch.listen))
            elif occasion is not Occasion.START:
                new = serving.new_generation(old.config, old.launch)
            if recipe.will_start:
                PROGRESS.begin(f"{recipe.doing}: on_will_start")
                await self.hooks.run("on_will_start", new, sleep=recipe.asleep)
            PROGRESS.begin(f"{recipe.doing}: loading the model")
            await new.start(built_ins.server_output)
            serving.install(new)
            self.notifier.status(f"{recipe.doing}: running on_startup (restoring slots)")
            PROGRESS.begin(f"{recipe.doing}: on_startup (restoring slots)")
            await self.survived(new, lambda: self.hooks.run("on_startup", new, sleep=recipe.asleep))
        except BaseException:
            if new.child is not None:
                serving.install(new)  # the stop reports its exit status
            if new.alive:
                await new.stop()
            raise
        finally:
            PROGRESS.end()
        self._to(State.READY)  # the held requests go to the new server
        self.ready_at = time.monotonic()
        self._start_background()

    async def survived(self, generation: Generation, step: Callable[[], Awaitable[T]]) -> T:
        """Run a step on a started generation (its on_startup, a reload's take-over); when llama-server dies under
        it (ServerLost: the built-in set the culprit aside), start it again, spending the restart budget, and run the
        step again (StartFailed once the budget is spent)."""
        while True:
            try:
                return await step()
            except ServerLost as exc:
                await generation.stop()
                lost = Lost("restore", str(exc))
                if not self.budget.allows():
                    raise StartFailed(f"llama-server died under a restore {self.budget.count + 1} times "
                                      f"within watchdog.window: {exc}") from exc
                self._spend(lost)
                await generation.start(built_ins.server_output)

    def _spend(self, lost: Lost) -> None:
        self.budget.spend(lost)
        METRICS.server_restarts.labels(reason=lost.reason).inc()
        self.notifier.status(f"restarting llama-server ({lost.reason}: {lost.why})")
        log.warning("wrapper.restarting_server", on=lost.reason, why=lost.why, attempt=self.budget.count)

    def _give_up(self, why: str) -> None:
        settings = WATCHDOG.of(self.current.config)
        log.error("wrapper.giving_up", restarts=self.budget.count, within_s=settings.window, why=why,
                  hint="the wrapper stops with the server's exit status: llama-swap or systemd take over")

    # -- the way down -------------------------------------------------------------------------------------------

    async def stop(self, ended: Ended) -> Gone:
        """The wrapper's last stop: drained and saved when it served (unless a drain did both already), llama-server
        stopped, on_stopped told the result."""
        if self._pinging is not None:
            self._pinging.cancel()
        served = ended is Ended.SERVED and not await self._drain_settled()
        gone = await self._down(Occasion.STOP, served, self.current.config.drain_timeout,
                                lambda finished: result(finished, ended))
        assert gone is not None  # a stop's drain cuts what is left: it is never given up
        await self.hooks.end_leftovers()
        return gone

    async def fall_asleep(self, why: str) -> bool:
        """Keep every slot and stop llama-server; False when requests in flight did not finish within
        server.drain_timeout (the sleep is given up, nothing stopped, the held requests go on)."""
        serving, sleep, generation, began = self.serving, self.sleep, self.current, time.monotonic()
        await remember(self.serving, generation)
        in_flight = serving.in_flight
        log.info("sleep.falling_asleep", why=why, in_flight=in_flight)
        gone = await self._down(Occasion.SLEEP, True, generation.config.drain_timeout, lambda _: "success")
        if gone is None:
            log.info("sleep.given_up", why=why, in_flight=serving.in_flight,
                     reason=f"requests in flight did not finish within server.drain_timeout "
                            f"({generation.config.drain_timeout:g}s)")
            sleep.answer({"asleep": False, "why": "requests in flight did not finish within server.drain_timeout"})
            return False
        built_ins.slept(generation, True)
        sleep.fell_asleep(why, "; ".join(f"{r.action}: {r.detail or r.outcome}" for r in gone.saved) or None)
        METRICS.asleep.set(1)
        took_s = round(time.monotonic() - began, 3)
        log.info("sleep.asleep", why=why, took_s=took_s, kept=sleep.kept, held=serving.gate.held)
        self.notifier.status(f"asleep since {time.strftime('%H:%M:%S')} ({why}): the next request wakes llama-server")
        sleep.answer({"asleep": True, "why": why, "took_s": took_s, "kept": sleep.kept})
        return True

    async def drain_before_stop(self, timeout: float) -> dict[str, Any]:
        """POST /wrapper/drain: the stop's first half now (ReloadRefused unless ready or asleep, whose slots were kept
        already); a second call waits for the same drain."""
        if self._drain is None:
            if self.state not in (State.READY, State.ASLEEP):
                raise ReloadRefused(f"llama-wrapper is {self.state}: it drains only when ready", 409, Refusal.NOT_READY)
            self._drain = asyncio.ensure_future(self._drained_and_saved(timeout))
        return await asyncio.shield(self._drain)

    async def _drained_and_saved(self, timeout: float) -> dict[str, Any]:
        began, in_flight = time.monotonic(), self.in_flight
        log.info("wrapper.drain", in_flight=in_flight, timeout_s=timeout)
        gone = await self._down(Occasion.DRAIN, self.state is not State.ASLEEP, timeout)
        assert gone is not None
        self._drained = True
        saved = [run.as_dict() for run in gone.saved]
        answer = {"drained": True, "in_flight": in_flight, "left_in_flight": self.in_flight,
                  "drain_s": round(gone.drain_s, 3), "total_s": round(time.monotonic() - began, 3),
                  "on_will_stop": saved}
        log.info("wrapper.drained", **{k: v for k, v in answer.items() if k != "on_will_stop"},
                 hooks=[f"{r['action']}: {r['outcome']}" for r in saved])
        self.notifier.status("drained: waiting for the stop")
        return answer

    async def _drain_settled(self) -> bool:
        """At the stop: let a drain that runs finish (a signal came during it); whether it left nothing to do."""
        if self._drain is not None and not self._drain.done():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(self._drain)
        return self._drained

    async def _down(self, occasion: Occasion, served: bool, timeout: float,
                    told: Callable[[Exit | None], str] | None = None) -> Gone | None:
        """Bring the server down for `occasion`: the requests in flight drained (when it `served`), on_will_stop (the
        save) while it is alive, then (as the table says) llama-server stopped and on_stopped told `told(exit)`. None
        when a drain that may not cut did not finish: the state is ready again, nothing stopped (a sleep given up).
        A second signal skips what is left of the drain and the hooks."""
        recipe, serving, generation, forced = down(occasion), self.serving, self.current, self.hooks.forced
        self._to(recipe.held)
        self._stop_background()
        began = time.monotonic()
        if served and not forced.is_set():
            if serving.in_flight:
                self.notifier.status(f"{recipe.doing}: waiting for {serving.in_flight} request(s) in flight")
            PROGRESS.begin(f"{recipe.doing}: requests in flight")
            if not await serving.drain(timeout, forced, recipe.cuts) and not recipe.cuts:
                PROGRESS.end()
                self._to(State.READY)
                self._start_background()
                return None
        drain_s = time.monotonic() - began
        saved: list[HookRun] = []
        if served and generation.alive and not forced.is_set():
            self.notifier.status(f"{recipe.doing}: running on_will_stop (saving slots)")
            PROGRESS.begin(f"{recipe.doing}: on_will_stop (saving slots)")
            saved = await self.hooks.run("on_will_stop", generation, sleep=recipe.asleep)
        finished = None
        if recipe.stops:
            self.notifier.status(f"{recipe.doing}: stopping llama-server")
            PROGRESS.begin(f"{recipe.doing}: stopping llama-server")
            finished = await generation.stop()
            PROGRESS.end()
            await self.hooks.run("on_stopped", generation, result=told(finished) if told else "success",
                                 finished=finished, sleep=recipe.asleep)  # skipped after a second signal
        PROGRESS.end()
        if recipe.then is not None:
            self._to(recipe.then)
        return Gone(saved, finished, drain_s)

    async def _not_woken(self, old: Generation, why: str, began: float) -> None:
        serving = self.serving
        if serving.current is not old:
            await serving.current.stop()
        serving.install(old)
        self.sleep.pending = None
        built_ins.slept(old, True)
        self.sleep.last_wake_error = why
        self._stop_background()
        self._to(State.ASLEEP)
        METRICS.asleep.set(1)
        held = serving.gate.held
        serving.gate.turn_away(why)
        log.error("sleep.wake_failed", error=why, held=held, after_s=round(time.monotonic() - began, 3),
                  hint="the wrapper stays asleep; the next request tries to wake llama-server again")
        self.notifier.status(f"asleep: the last wake failed ({why})")

    # -- a reload (wrapper/life/reloader.py runs its cycle; these are its moves) --------------------------------------

    async def reload(self, body: dict[str, Any], why: str | None = None,
                     asks: Asks | None = None, cut: bool = True) -> dict[str, Any]:
        """Reconfigure the running llama-server (see wrapper/life/reloader.py); one at a time, only when ready (while
        asleep: settled now, applied at the wake)."""
        if self.watch.reloading is not None:
            raise ReloadRefused(BUSY_RELOADING, 409, Refusal.BUSY)
        if self.state is State.ASLEEP:
            return self._reload_at_wake(Reloader(self).settle(body, why, asks, cut))
        if self.state is not State.READY:
            raise ReloadRefused(f"llama-wrapper is {self.state}: it reloads only when ready", 409, Refusal.NOT_READY)
        reloader = Reloader(self)
        nxt = reloader.settle(body, why, asks, cut)  # refusals come before anything stops
        task = asyncio.ensure_future(self._reloaded(reloader.run(nxt)))
        self.watch.reload_began(task)
        return await asyncio.shield(task)  # a client that hangs up does not stop the reload

    def _reload_at_wake(self, nxt: NextGeneration) -> dict[str, Any]:
        self.sleep.pending = nxt
        built_ins.slept(self.current, True)  # its fit (a pool member's share) is taken at the wake, not now
        answer = {"success": True, "n_ctx": None, "downtime_ms": 0.0, "drain_ms": 0.0, "changes": nxt.plan.changes,
                  "message": "asleep: the new settings apply when the next request wakes llama-server",
                  "at_wake": True, "overlap": False, "overlap_why": "asleep: no server runs to overlap with",
                  "context": None, "save": None, "restore": None, "slots": []}
        log.info("reload.at_wake", changes=nxt.plan.changes)
        self.last_reload = answer
        return answer

    async def _reloaded(self, cycle: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        self.last_reload = answer = await cycle
        await self.hooks.run("on_reload", self.current, reload=answer)
        return answer

    async def abandon_reload(self) -> None:
        """At a stop: cancel a reload that runs (the stop then saves what is there)."""
        reloading = self.watch.reloading
        if reloading is not None and not reloading.done():
            reloading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reloading

    def hold(self) -> None:
        """A reload's downtime begins: requests are held."""
        self._to(State.RELOADING)

    def release(self) -> None:
        """A reload is done (or given up, or rolled back): the held requests go to what serves now."""
        self._to(State.READY)

    def new_generation(self, config: Config, launch: Launch) -> Generation:
        return self.serving.new_generation(config, launch)

    def install(self, generation: Generation) -> None:
        self.serving.install(generation)

    async def drain(self, timeout: float, cut: bool = True) -> bool:
        """Let the requests in flight finish within `timeout` (a second signal ends the wait), cut the rest (unless
        not `cut`); whether none is left."""
        return await self.serving.drain(timeout, self.hooks.forced, cut)

    def carry_streams(self) -> int:
        """Cut the streams in flight that go on on the next server (a reload's hand-over); how many."""
        return self.serving.gate.carry_streams()

    # -- the state and the background work -----------------------------------------------------------------------

    def _to(self, state: State) -> None:
        self.serving.lifecycle.to(state)

    def _start_background(self) -> None:
        """The built-ins' work from ready until the server goes down (cancelled by a restart, a sleep, a stop), and
        systemd's watchdog ping, started once: it goes on through a restart and a sleep."""
        self._stop_background()
        self._background = [asyncio.ensure_future(each) for each in built_ins.background(self)]
        if self.notifier.watchdog_s is not None and self._pinging is None:
            self._pinging = asyncio.ensure_future(self._ping(self.notifier.watchdog_s))

    def _stop_background(self) -> None:
        for task in self._background:
            task.cancel()
        self._background = []

    async def _ping(self, every: float) -> None:
        """WATCHDOG=1 while llama-server answers, and while the wrapper brings it back or it sleeps (each bounded by
        its own timeouts), so that systemd does not kill the wrapper for a model that loads slowly."""
        while True:
            if self.state in (State.RELOADING, State.RESTARTING, State.SLEEPING, State.ASLEEP, State.WAKING) \
                    or await self.current.client.healthy(timeout=every):
                self.notifier.watchdog()
            await asyncio.sleep(every)


def result(finished: Exit | None, ended: Ended) -> str:
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
