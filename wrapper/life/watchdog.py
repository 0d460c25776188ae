"""Noticing that llama-server is lost, and how often it may be started again.

Lost is dead on its own (an exit nobody asked for, a signal the wrapper did not send) or hung: `/health`
unanswered for `watchdog.health_timeout` (llama-server answers it from its HTTP threads, also in the middle of a
long prefill: only a stopped or wedged process leaves it unanswered), or a request in flight that hears nothing
while llama-server makes no progress for `watchdog.stall`. Progress is a slot's (a task taken, a prompt token
processed, a token decoded) or, on Linux, its CPU time moving: utime + stime of /proc/PID/stat, all its threads,
by at least BUSY of the wall time between two looks. A slot shows a prefill's progress only at the end of each
batch (`n_prompt_tokens_processed` moves then, and `/slots` waits for it), which takes minutes for a large model on
a CPU; but a batch that computes burns CPU (measured: 0.5 to 0.95 s a second for `-t 1` on a loaded 2-core machine)
where a stopped or blocked server burns none (polled as the watchdog polls it: under 1 ms a second; 50 requests a
second: 37 ms). So a short stall is safe. A wedge that spins (a thread in a busy loop) looks like a batch that
computes and is not noticed by this rule. Without /proc (not Linux) only a slot's progress counts, and the stall
must outlast the slowest batch.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from wrapper.configuration.sections import WatchdogSettings
from wrapper.lifecycle import State
from wrapper.server.child import Exit
from wrapper.server.generation import Generation
from wrapper.server.llama import LlamaError

BUSY = 0.05  # the share of a core's time between two looks that counts as computing (see computed())
BUSY_MIN_S = 0.02  # and at least this much CPU time (two ticks of /proc's 1/100 s)


@dataclass(frozen=True)
class Lost:
    """llama-server lost: `reason` crash or hang, `why` in words, how it ended (None while it hangs)."""

    reason: str
    why: str
    exit: Exit | None = None


def died(finished: Exit) -> Lost:
    why = f"killed by {finished.signal_name}" if finished.signal is not None else f"exit status {finished.code}"
    return Lost("crash", why, finished)


class Budget:
    """At most `restarts` in any `window` seconds."""

    def __init__(self, restarts: int, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.restarts, self.window, self._clock = restarts, window, clock
        self._at: deque[float] = deque()
        self.count = 0  # for the wrapper's whole life
        self.last: dict[str, Any] | None = None

    def allows(self) -> bool:
        now = self._clock()
        while self._at and now - self._at[0] > self.window:
            self._at.popleft()
        return len(self._at) < self.restarts

    def spend(self, lost: Lost) -> None:
        self._at.append(self._clock())
        self.count += 1
        self.last = {"reason": lost.reason, "why": lost.why, "at": round(time.time(), 3)}


class Watched(Protocol):
    """What the watch needs of what serves."""

    @property
    def current(self) -> Generation: ...

    @property
    def state(self) -> State: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def heard_at(self) -> float:
        """When a request in flight last sent to llama-server or heard from it (time.monotonic())."""
        ...

    def cpu_time(self) -> float | None:
        """The CPU seconds the serving llama-server has used so far, all its threads; None where that cannot be
        read (no /proc)."""
        ...


def progress(slots: list[dict[str, Any]]) -> tuple[Any, ...]:
    """What changes while a slot works: its task, the prompt tokens processed, the tokens decoded."""
    return tuple((s.get("id"), s.get("id_task"), s.get("n_prompt_tokens_processed"),
                  tuple(t.get("n_decoded") for t in s.get("next_token") or [] if isinstance(t, dict)))
                 for s in slots if isinstance(s, dict))


def computed(before: tuple[float, float | None], after: tuple[float, float | None]) -> bool:
    """Whether llama-server computed between two readings of (time.monotonic(), its CPU seconds): its CPU time
    moved by at least BUSY of the wall time between them, and by BUSY_MIN_S. Not when either is unknown."""
    (then, used_then), (now, used_now) = before, after
    if used_then is None or used_now is None:
        return False
    return round(used_now - used_then, 6) >= max(BUSY_MIN_S, BUSY * (now - then))  # 10.02 - 10.0 < 0.02


async def hung(watched: Watched, settings: WatchdogSettings, clock: Callable[[], float] = time.monotonic) -> Lost:
    """Return when the generation that serves hangs (never while the wrapper is not ready: a reload or a restart
    answers for its own server). One look every `poll` seconds, its probes at once and each no longer than a
    look: a hang is noticed within its rule's time and one look more."""
    poll = max(0.2, min(5.0, settings.health_timeout / 3, settings.stall / 3))
    healthy_at = progressed_at = clock()
    seen: tuple[Any, ...] | None = None
    began = clock()
    cpu = (began, watched.cpu_time())
    while True:
        await asyncio.sleep(max(0.0, began + poll - clock()))  # a look that waited out its probes waits less
        began = clock()
        cpu, before = (began, watched.cpu_time()), cpu
        generation = watched.current
        if watched.state is not State.READY or not generation.alive:
            healthy_at = progressed_at = clock()
            seen = None
            continue
        if not watched.in_flight:
            progressed_at, seen = clock(), None
        elif computed(before, cpu):  # a prompt batch: no slot shows progress until it is done
            progressed_at = began
        looks_quiet = watched.in_flight and clock() - max(watched.heard_at, progressed_at) >= min(poll,
                                                                                                settings.stall / 2)
        healthy, slots = await asyncio.gather(generation.client.healthy(timeout=poll),
                                              _slots(generation, poll) if looks_quiet else _nothing())
        if healthy:
            healthy_at = began
        elif clock() - healthy_at >= settings.health_timeout:
            return Lost("hang", f"/health unanswered for {clock() - healthy_at:.0f}s (watchdog.health_timeout "
                                f"{settings.health_timeout:g}s)")
        if not looks_quiet:
            continue
        now_seen = progress(slots) if slots is not None else None  # no answer is no sign of progress
        if now_seen is not None and now_seen != seen:
            seen, progressed_at = now_seen, began
        elif clock() - max(watched.heard_at, progressed_at) >= settings.stall:
            still = "" if cpu[1] is None else " and its CPU time stood still"
            return Lost("hang", f"{watched.in_flight} request(s) in flight heard nothing and no slot made progress"
                                f"{still} for {settings.stall:g}s (watchdog.stall)")


async def _slots(generation: Generation, within: float) -> list[dict[str, Any]] | None:
    try:
        return await asyncio.wait_for(generation.client.slots(), within)
    except (LlamaError, TimeoutError):
        return None


async def _nothing() -> None:
    return None
