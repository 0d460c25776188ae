"""Sleep: after `sleep.after` with no request in flight or arriving, the wrapper keeps every slot, stops llama-server
(its memory is free) and goes on listening; the next request that needs the server wakes it (a start and a
restore, that request and every one arriving meanwhile held). What a client polls (`/health`, `/v1/models`,
`/models`, `/props`) is answered while asleep without waking it, from what the server said while awake.

This module holds the section, what a sleep keeps for /wrapper/status and those answers; the supervisor
(wrapper/supervisor.py) runs the sleep and the wake.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import yaml

from wrapper import paths
from wrapper.settings import Kind, Section, setting
from wrapper.units import parse_duration
from wrapper.yamlread import Reader

ANSWERED_ASLEEP = paths.DESCRIBING  # GETs answered from memory while asleep (and never keeping the server awake)
LOOK_EVERY_S = 1.0  # how often the idle clock is looked at (a sleep comes at most this late)


def _duration_or_off(r: Reader, node: yaml.Node, what: str) -> float | None:
    """A duration > 0, or off (`off`, `false`, null: the default)."""
    value = r.value(node)
    if isinstance(node, yaml.ScalarNode) and (value is None or value is False or value in ("", "~", "off")):
        return None
    seconds = r.converted(node, what, parse_duration)
    if seconds is not None and not seconds > 0:
        r.error(node, f"{what} must be more than 0s, or off")
        return None
    return float(seconds) if seconds is not None else None


DURATION_OR_OFF = Kind("duration | off", _duration_or_off, lambda v: "off" if v is None else f"{v:g}s")


@dataclass(frozen=True)
class SleepSettings:
    after: float | None = setting(None, DURATION_OR_OFF, "fall asleep after this long with no request in flight or "
                                  "arriving: every slot kept, llama-server stopped (its memory free); the next "
                                  "request wakes it (off: never on its own; POST /wrapper/sleep still works)")
    when_asked: float | None = setting(None, DURATION_OR_OFF, "in a pool (degrade.pool): fall asleep when another "
                                       "member needs more than the others' ladders give, once idle this long, and "
                                       "give it the whole share (off: never asked)")


SLEEP = Section("sleep", SleepSettings, "an idle model gives its memory back and wakes with every conversation")


@dataclass
class Answer:
    """What llama-server answered a GET while awake (status, JSON body)."""

    status: int
    payload: Any


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
    answers: dict[str, Answer] = field(default_factory=dict)
    asked: asyncio.Event = field(default_factory=asyncio.Event)  # sleep now (POST /wrapper/sleep, the pool)
    asked_why: str = ""
    woken: asyncio.Event = field(default_factory=asyncio.Event)  # wake now (a request, POST /wrapper/wake)
    pending: Any = None  # a reload settled while asleep (wrapper/reloader.py NextGeneration): applied at the wake
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


def idle_for(active_at: float, in_flight: int, held: int) -> float:
    """How long nothing has come or gone (0 while something is in flight or held)."""
    return 0.0 if in_flight or held else max(0.0, time.monotonic() - active_at)
