"""Noticing that llama-server is lost, and how often it may be started again.

Lost is dead on its own (an exit nobody asked for, a signal the wrapper did not send) or hung: `/health`
unanswered for `watchdog.health_timeout` (llama-server answers it from its HTTP threads, also in the middle of a
long prefill: only a stopped or wedged process leaves it unanswered), or a request in flight that hears nothing
while no slot makes progress (no task taken, no prompt token processed, no token decoded) for `watchdog.stall`. A
prefill is progress at each batch it finishes (2,048 prompt tokens: `n_prompt_tokens_processed` moves only then),
so the stall must outlast the slowest batch: seconds on a GPU, a minute for a large model on a small card, minutes
for a 70B model on a CPU.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from wrapper.child import Exit
from wrapper.generation import Generation
from wrapper.lifecycle import State
from wrapper.llama import LlamaError
from wrapper.sections import WatchdogSettings


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


def progress(slots: list[dict[str, Any]]) -> tuple[Any, ...]:
    """What changes while a slot works: its task, the prompt tokens processed, the tokens decoded."""
    return tuple((s.get("id"), s.get("id_task"), s.get("n_prompt_tokens_processed"),
                  tuple(t.get("n_decoded") for t in s.get("next_token") or [] if isinstance(t, dict)))
                 for s in slots if isinstance(s, dict))


async def hung(watched: Watched, settings: WatchdogSettings, clock: Callable[[], float] = time.monotonic) -> Lost:
    """Return when the generation that serves hangs (never while the wrapper is not ready: a reload or a restart
    answers for its own server). One look every `poll` seconds, its probes at once and each no longer than a
    look: a hang is noticed within its rule's time and one look more."""
    poll = max(0.2, min(5.0, settings.health_timeout / 3, settings.stall / 3))
    healthy_at = progressed_at = clock()
    seen: tuple[Any, ...] | None = None
    began = clock()
    while True:
        await asyncio.sleep(max(0.0, began + poll - clock()))  # a look that waited out its probes waits less
        began = clock()
        generation = watched.current
        if watched.state is not State.READY or not generation.alive:
            healthy_at = progressed_at = clock()
            seen = None
            continue
        if not watched.in_flight:
            progressed_at, seen = clock(), None
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
            return Lost("hang", f"{watched.in_flight} request(s) in flight heard nothing and no slot made progress "
                                f"for {settings.stall:g}s (watchdog.stall)")


async def _slots(generation: Generation, within: float) -> list[dict[str, Any]] | None:
    try:
        return await asyncio.wait_for(generation.client.slots(), within)
    except (LlamaError, TimeoutError):
        return None


async def _nothing() -> None:
    return None
