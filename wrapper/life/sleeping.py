"""Sleep: after `sleep.after` with no request in flight or arriving, the wrapper keeps every slot, stops llama-server
(its memory is free) and goes on listening; the next request that needs the server wakes it (a start and a
restore, that request and every one arriving meanwhile held). What a client polls (`/health`, `/v1/models`,
`/models`, `/props`) is answered while asleep without waking it, from what the server said while awake.

This module holds the section and the record of the sleeps (what the last one kept, the wakes, a reload asked while
asleep); the life (wrapper/life/server_life.py) falls asleep and wakes, and wrapper/life/sleep_cycle.py says when.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from wrapper.configuration.sections import SleepSettings
from wrapper.life.reloader import NextGeneration
from wrapper.paths import ANSWERED_ASLEEP
from wrapper.server.generation import Generation
from wrapper.serving import Remembered, Serving

LOOK_EVERY_S = 1.0  # how often the idle clock is looked at (a sleep comes at most this late)


@dataclass
class Sleep:
    """The wrapper's sleeps for its whole life: what the last one kept, the answers it remembers, the wakes."""

    since: float | None = None  # time.time() of the last fall asleep, while asleep
    began: float | None = None  # monotonic, while asleep
    kept: str | None = None  # what the save before the sleep said
    sleeps: int = 0
    wakes: int = 0
    last_wake_s: float | None = None
    last_wake_error: str | None = None
    why: str = ""  # what made the last sleep: idle, asked (POST /wrapper/sleep), the pool
    asked: asyncio.Event = field(default_factory=asyncio.Event)  # sleep now (POST /wrapper/sleep, the pool)
    asked_why: str = ""
    woken: asyncio.Event = field(default_factory=asyncio.Event)  # wake now (a request, POST /wrapper/wake)
    pending: NextGeneration | None = None  # a reload settled while asleep: applied at the wake
    _waiting: list[asyncio.Future[dict[str, Any]]] = field(default_factory=list)  # POST /wrapper/sleep

    def ask(self, why: str) -> asyncio.Future[dict[str, Any]]:
        """Sleep now: the future is the outcome (asleep, or given up because requests did not finish)."""
        self.asked_why = why
        self.asked.set()
        answered: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting.append(answered)
        return answered

    def answer(self, outcome: dict[str, Any]) -> None:
        """The sleep asked for fell asleep, or was given up."""
        for waiting in self._waiting:
            if not waiting.done():
                waiting.set_result(outcome)
        self._waiting.clear()

    def fell_asleep(self, why: str, kept: str | None) -> None:
        self.since, self.began, self.why, self.kept = time.time(), time.monotonic(), why, kept
        self.sleeps += 1

    def woke(self, took_s: float) -> float:
        self.since = self.began = None
        self.wakes += 1
        self.last_wake_s = round(took_s, 3)
        self.last_wake_error = None
        return self.last_wake_s

    def wake(self) -> None:
        self.woken.set()

    def status(self, asleep: bool, settings: SleepSettings) -> dict[str, Any]:
        return {
            "after_s": settings.after, "when_asked_s": settings.when_asked, "asleep": asleep,
            "since": self.since if asleep else None,
            "for_s": round(time.monotonic() - self.began, 3) if asleep and self.began is not None else None,
            "why": self.why or None, "kept": self.kept, "sleeps": self.sleeps, "wakes": self.wakes,
            "last_wake_s": self.last_wake_s, "last_wake_error": self.last_wake_error,
            "reload_at_wake": list(self.pending.plan.changes) if self.pending is not None else None,
        }


async def remember(serving: Serving, generation: Generation) -> None:
    """What llama-server answers the GETs clients poll, for the sleep (each asked now, while it runs)."""
    headers = {"Accept-Encoding": "identity"}  # the session passes bodies through as they come: plain JSON
    if generation.launch.api_key:
        headers["Authorization"] = f"Bearer {generation.launch.api_key}"
    for path in ANSWERED_ASLEEP:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with serving.session.get(generation.launch.url + path, headers=headers) as reply:
                if reply.status == 200 and reply.content_type == "application/json":
                    serving.remembered[path] = Remembered(reply.status, await reply.json())
