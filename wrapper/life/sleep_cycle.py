"""When a sleep is due, and a sleep's cycle: fall asleep, wait asleep, wake (wrapper/life/server_life.py does each).

Falling asleep is a stop that goes on listening: what clients poll is remembered first, `on_will_stop` saves the
slots (`slots.save`), llama-server stops, `on_stopped` runs (both with `sleep` true in their context). Asleep, the
gate holds a request that needs the server and wakes it: a new generation (with a reload asked while asleep)
fitted as at a start, `on_will_start`, the start, `on_startup` (`slots.restore`); then the held requests go.
A wake that fails answers them 503 with the reason and stays asleep; the next request tries again.
"""

from __future__ import annotations

import asyncio
import contextlib

from wrapper.aio import first_of
from wrapper.configuration.sections import SLEEP
from wrapper.life.server_life import ServerLife
from wrapper.life.sleeping import LOOK_EVERY_S
from wrapper.lifecycle import State


def why_sleep(ready: bool, asked: str | None, after: float | None, idle_s: float) -> str | None:
    """Why a sleep is due now, else None: asked for (`asked`: POST /wrapper/sleep, the pool), or idle for
    `sleep.after`; never while not ready to sleep (starting, restarting, in the middle of a reload)."""
    if not ready:
        return None
    if asked is not None:
        return asked
    if after is not None and idle_s >= after:
        return f"idle for sleep.after ({after:g}s)"
    return None


async def due(life: ServerLife) -> str:
    """Wait until a sleep is due (see why_sleep; an ask that comes while not ready waits until it is); why."""
    sleep = life.sleep
    while True:
        ready = life.state is State.READY and life.watch.reloading is None
        asked = sleep.asked_why if sleep.asked.is_set() else None
        why = why_sleep(ready, asked, SLEEP.of(life.current.config).after, life.idle_s())
        if why is not None:
            sleep.asked.clear()
            return why
        if asked is not None:  # asked while a reload runs: once it is done
            await asyncio.sleep(LOOK_EVERY_S)
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sleep.asked.wait(), LOOK_EVERY_S)


async def cycle(life: ServerLife, why: str, stop: asyncio.Event) -> bool:
    """Fall asleep, then wait asleep until a wake brings llama-server back (True) or a stop is asked for (False:
    the stop finds the slots kept already). True also when the sleep was given up (a request was in flight)."""
    if not await life.fall_asleep(why):
        return True
    sleep = life.sleep
    if life.serving.gate.held:  # a request came while it fell asleep (one that comes later wakes it itself)
        sleep.wake()
    while True:
        await first_of(sleep.woken.wait(), stop.wait())
        if stop.is_set():
            return False
        sleep.woken.clear()
        waking = asyncio.ensure_future(life.wake())
        await first_of(waking, stop.wait())  # a stop cancels the wake: a server it started is stopped
        if stop.is_set() or waking.cancelled() or not waking.done():
            waking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waking
            return False
        if waking.result():
            return True
