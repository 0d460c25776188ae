"""A sleep and its wake, run by the supervisor between watching what serves (wrapper/supervisor.py).

Falling asleep is a stop that goes on listening: what clients poll is remembered first, `on_will_stop` saves the
slots (`slots.save`), llama-server stops, `on_stopped` runs (both with `sleep` true in their context). Asleep, the
gate holds a request that needs the server and wakes it: a new generation (with a reload asked while asleep)
fitted as at a start, `on_will_start`, the start, `on_startup` (`slots.restore`); then the held requests go.
A wake that fails answers them 503 with the reason and stays asleep; the next request tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace
from typing import Protocol

import aiohttp
import structlog

from wrapper import built_ins
from wrapper.aio import first_of
from wrapper.config import ConfigError
from wrapper.generation import Generation, StartFailed
from wrapper.hooks_running import Hooks
from wrapper.lifecycle import State
from wrapper.llama import LlamaError
from wrapper.metrics import METRICS
from wrapper.notify import Notifier
from wrapper.progress import PROGRESS
from wrapper.serving import Serving
from wrapper.sleeping import ANSWERED_ASLEEP, LOOK_EVERY_S, SLEEP, Answer

log = structlog.get_logger()


class Sleeper(Protocol):
    """What a sleep needs of the supervisor."""

    serving: Serving
    hooks: Hooks
    notifier: Notifier

    def stop_background(self) -> None: ...

    def start_background(self) -> None: ...

    async def bring_up(self, new: Generation) -> None: ...


async def due(serving: Serving) -> str:
    """Wait until a sleep is due: idle for `sleep.after` while ready, or asked for (POST /wrapper/sleep, the pool);
    why."""
    sleep = serving.sleep
    while True:
        ready = serving.state is State.READY and not serving.reloading  # never in the middle of a reload
        if ready and sleep.asked.is_set():
            sleep.asked.clear()
            return sleep.asked_why
        after = SLEEP.of(serving.current.config).after
        if ready and after is not None and serving.idle_s() >= after:
            return f"idle for sleep.after ({after:g}s)"
        if sleep.asked.is_set():  # asked while a reload runs: once it is done
            await asyncio.sleep(LOOK_EVERY_S)
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sleep.asked.wait(), LOOK_EVERY_S)


async def cycle(host: Sleeper, why: str, stop: asyncio.Event) -> bool:
    """Fall asleep, then wait asleep until a wake brings llama-server back (True) or a stop is asked for (False:
    the stop finds the slots kept already). True also when the sleep was given up (a request was in flight)."""
    if not await fall_asleep(host, why):
        return True
    sleep = host.serving.sleep
    if host.serving.gate.held:  # a request came while it fell asleep (one that comes later wakes it itself)
        sleep.wake()
    while True:
        await first_of(sleep.woken.wait(), stop.wait())
        if stop.is_set():
            return False
        sleep.woken.clear()
        waking = asyncio.ensure_future(wake(host))
        await first_of(waking, stop.wait())  # a stop cancels the wake: a server it started is stopped
        if stop.is_set() or waking.cancelled() or not waking.done():
            waking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waking
            return False
        if waking.result():
            return True


async def fall_asleep(host: Sleeper, why: str) -> bool:
    """Keep every slot and stop llama-server; False when requests in flight did not finish within
    server.drain_timeout (an asked sleep: nothing stopped, the held requests go on)."""
    serving, sleep = host.serving, host.serving.sleep
    generation, began = serving.current, time.monotonic()
    await _remember(serving, generation)
    serving.lifecycle.to(State.SLEEPING)  # requests are held from here; one held now wakes it again at once
    in_flight = serving.in_flight
    if in_flight and not await serving.drain(generation.config.drain_timeout, cut=False):
        log.info("sleep.given_up", why=why, in_flight=serving.in_flight,
                 reason=f"requests in flight did not finish within server.drain_timeout "
                        f"({generation.config.drain_timeout:g}s)")
        serving.lifecycle.to(State.READY)
        sleep.answer({"asleep": False, "why": "requests in flight did not finish within server.drain_timeout"})
        return False
    log.info("sleep.falling_asleep", why=why, in_flight=in_flight)
    host.stop_background()
    host.notifier.status("falling asleep: running on_will_stop (saving slots)")
    PROGRESS.begin("falling asleep: on_will_stop (saving slots)")
    saved = await host.hooks.run("on_will_stop", generation, sleep=True)
    PROGRESS.begin("falling asleep: stopping llama-server")
    finished = await generation.stop()
    PROGRESS.end()
    await host.hooks.run("on_stopped", generation, result="success", finished=finished, sleep=True)
    built_ins.slept(generation, True)
    sleep.fell_asleep(why, "; ".join(f"{r.action}: {r.detail or r.outcome}" for r in saved) or None)
    serving.lifecycle.to(State.ASLEEP)
    METRICS.asleep.set(1)
    took_s = round(time.monotonic() - began, 3)
    log.info("sleep.asleep", why=why, took_s=took_s, kept=sleep.kept, held=serving.gate.held)
    host.notifier.status(f"asleep since {time.strftime('%H:%M:%S')} ({why}): the next request wakes llama-server")
    sleep.answer({"asleep": True, "why": why, "took_s": took_s, "kept": sleep.kept})
    return True


async def wake(host: Sleeper) -> bool:
    """Start llama-server again, restore, and let the held requests go (True); False when it did not come up:
    the held requests are answered 503 with the reason, the wrapper stays asleep."""
    serving, sleep = host.serving, host.serving.sleep
    old, pending, began = serving.current, sleep.pending, time.monotonic()
    held = serving.gate.held
    serving.lifecycle.to(State.WAKING)
    METRICS.asleep.set(0)
    log.info("sleep.waking", held=held, reload=pending.plan.changes if pending is not None else None)
    host.notifier.status("waking: starting llama-server, restoring slots; requests held")
    config = pending.config if pending is not None else old.config
    new: Generation | None = None
    try:
        built_ins.slept(old, False)
        PROGRESS.begin("waking: fitting")  # a pool member may wait here for the others to give
        launch = await asyncio.to_thread(built_ins.launch_for, config, old.shared)
        new = serving.new_generation(config, replace(launch, listen=old.launch.listen))
        PROGRESS.begin("waking: on_will_start")
        await host.hooks.run("on_will_start", new, sleep=True)
        PROGRESS.begin("waking: loading the model, on_startup (restoring slots)")
        await host.bring_up(new)
    except (StartFailed, ConfigError, LlamaError, OSError) as exc:
        why = str(exc) + ("; the reload asked while asleep is dropped" if pending is not None else "")
        return await _not_woken(host, old, new, why, began)
    finally:
        PROGRESS.end()
        if new is not None and new is not serving.current and new.alive:
            await new.stop()
    sleep.pending = None
    serving.lifecycle.to(State.READY)
    host.start_background()
    wake_s = sleep.woke(time.monotonic() - began)
    log.info("sleep.woken", wake_s=wake_s, held=serving.gate.held, pid=new.child.pid if new.child else None,
             reload=pending.plan.changes if pending is not None else None)
    return True


async def _not_woken(host: Sleeper, old: Generation, new: Generation | None, why: str, began: float) -> bool:
    serving, sleep = host.serving, host.serving.sleep
    if new is not None:
        await new.stop()
    serving.install(old)
    sleep.pending = None
    built_ins.slept(old, True)
    sleep.last_wake_error = why
    serving.lifecycle.to(State.ASLEEP)
    METRICS.asleep.set(1)
    held = serving.gate.held
    serving.gate.turn_away(why)
    log.error("sleep.wake_failed", error=why, held=held, after_s=round(time.monotonic() - began, 3),
              hint="the wrapper stays asleep; the next request tries to wake llama-server again")
    host.notifier.status(f"asleep: the last wake failed ({why})")
    return False


async def _remember(serving: Serving, generation: Generation) -> None:
    """What llama-server answers the GETs clients poll, for the sleep (each asked now, while it runs)."""
    headers = {"Accept-Encoding": "identity"}  # the session passes bodies through as they come: ask for plain JSON
    if generation.launch.api_key:
        headers["Authorization"] = f"Bearer {generation.launch.api_key}"
    for path in ANSWERED_ASLEEP:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with serving.session.get(generation.launch.url + path, headers=headers) as reply:
                if reply.status == 200 and reply.content_type == "application/json":
                    serving.sleep.answers[path] = Answer(reply.status, await reply.json())
