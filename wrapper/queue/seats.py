"""The slots' queue: a request that decodes takes a seat (one per llama-server slot) before its steps run, and
holds it until it is answered. When every seat is taken, interactive requests go first, first come first served
within a class; a background request keeps its place (its first arrival) when it waits again after a pause.

Preemption: an interactive request that finds no free seat asks a background one to pause — the one cheapest
to resume (the fewest tokens in its slot), that is in an exchange it can be resumed from, and was paused fewer
than `max_pauses` times. The paused request keeps its state (a built-in's `keep`), leaves its seat, and waits
for one again ahead of later background requests (wrapper/answers/forwarding.py, wrapper/answers/answering.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from wrapper.asked import Asked, Class
from wrapper.metrics import METRICS
from wrapper.steps import SlotUse

log = structlog.get_logger()


@dataclass(frozen=True)
class Why:
    """Why a running request is not paused for an interactive one: a code (the metric's `reason` label) and words."""

    code: str
    words: str


INTERACTIVE = Why("interactive", "an interactive request is never paused")
BETWEEN = Why("between", "between its passes (its steps, or waiting at the gate): asked once it is under way")
BEGUN = Why("begun", "its answer began reasoning or a tool call, which no prefix goes on from")


class UnderWay(Protocol):
    """How far the exchange a seat may be paused from got (wrapper/answers/events.py's Events)."""

    @property
    def tokens(self) -> int:
        """The tokens generated in its slot so far."""
        ...

    @property
    def plain(self) -> bool:
        """Its answer so far is text an assistant prefix can go on from."""
        ...


@dataclass(eq=False)
class Seat:
    """One request's place: in the queue, then in a slot."""

    asked: Asked  # who asks, its class and path
    arrived: float = field(default_factory=time.monotonic)  # its first arrival: its place in its class
    use: SlotUse = field(default_factory=SlotUse)  # what it takes of its slot, as the steps learn it
    unpausable: Why | None = None  # why its request can never be paused (a background one), when it cannot
    under_way: UnderWay | None = None  # the exchange it may be paused from, while it runs (wrapper/answers/passes.py)
    pause: asyncio.Event = field(default_factory=asyncio.Event)  # set: stop the exchange, keep, wait again
    asked_at: float | None = None  # when it was last asked to pause
    since: float = field(default_factory=time.monotonic)  # when it began to wait, or to be seated
    behind: list[dict[str, Any]] = field(default_factory=list)  # waiting: what runs that it is not paused for, why

    @property
    def klass(self) -> Class:
        return self.asked.klass

    @property
    def path(self) -> str:
        return self.asked.path

    @property
    def pauses(self) -> int:
        return self.use.pauses

    def cost(self) -> int:
        """What resuming it costs: the tokens its slot holds."""
        return self.use.tokens + (self.under_way.tokens if self.under_way is not None else 0)


class Seats:
    def __init__(self, total: int = 1) -> None:
        self.total = max(1, total)
        self.running: list[Seat] = []
        self.waiting: list[Seat] = []
        self._changed = asyncio.Event()
        self.preempt = False  # whether paused states are kept now (the conversation cache is on)
        self.preempt_off = Why("preempt_off", "nothing is paused")  # why not, when not
        self.lane = 0  # seats background requests may not take (priority.lane: kept for interactive ones)
        self.lane_why = ""
        self.max_pauses = 3
        self.paused = 0  # background generations paused, resumed, and let go (their client hung up while paused)
        self.resumed = 0
        self.gone = 0

    def resize(self, total: int) -> None:
        if max(1, total) != self.total:
            self.total = max(1, total)
            self.changed()

    def changed(self) -> None:
        """Something a waiter or a pause depends on moved: look again."""
        self._changed.set()
        self._changed = asyncio.Event()
        self._ask_pauses()

    async def take(self, seat: Seat) -> None:
        """Wait for a seat (cancelled: the place is given up)."""
        seat.since = time.monotonic()
        self.waiting.append(seat)
        METRICS.background_queue.set(self._background_waiting())
        queued = False
        try:
            while not self._granted(seat):
                queued = True
                changed = self._changed
                self._ask_pauses()
                await changed.wait()
        finally:
            if seat in self.waiting:
                self.waiting.remove(seat)
            METRICS.background_queue.set(self._background_waiting())
        waited = time.monotonic() - seat.since
        if seat.klass is Class.INTERACTIVE:
            METRICS.interactive_wait.observe(waited)
        if queued:
            METRICS.waited(seat.asked.name, waited)
        seat.since = time.monotonic()
        seat.pause.clear()
        seat.behind = []
        self.running.append(seat)
        self.changed()

    def leave(self, seat: Seat) -> None:
        seat.under_way = None
        if seat in self.running:
            self.running.remove(seat)
            self.changed()

    def _order(self) -> list[Seat]:
        return sorted(self.waiting, key=lambda s: (s.klass is not Class.INTERACTIVE, s.arrived))

    def _granted(self, seat: Seat) -> bool:
        """Whether `seat` is among those the free seats go to now: interactive ones first, first come first served
        within a class, and background ones only while the lane stays free."""
        free = self.total - len(self.running)
        background = self.total - self.lane - sum(1 for s in self.running if s.klass is Class.BACKGROUND)
        for waiting in self._order():
            if free <= 0:
                return False
            if waiting.klass is Class.BACKGROUND:
                if background <= 0:
                    continue
                background -= 1
            if waiting is seat:
                return True
            free -= 1
        return False

    def _background_waiting(self) -> int:
        return sum(1 for s in self.waiting if s.klass is Class.BACKGROUND)

    def _ask_pauses(self) -> None:
        """As many background seats asked to pause as interactive requests wait beyond the free seats; an interactive
        request that waits with none to ask is told why each running one is not (`behind`), and the log once."""
        free = max(0, self.total - len(self.running))
        waiting = [s for s in self._order()[free:] if s.klass is Class.INTERACTIVE]
        asked = sum(1 for s in self.running if s.pause.is_set())
        while asked < len(waiting) and self.preempt:
            candidates = [s for s in self.running if self.why_not_paused(s) is None and not s.pause.is_set()]
            if not candidates:
                break
            chosen = min(candidates, key=lambda s: (s.cost(), -s.since))
            chosen.asked_at = time.monotonic()
            chosen.pause.set()
            asked += 1
        for seat in waiting[asked:]:
            self._not_paused_for(seat)

    def why_not_paused(self, seat: Seat) -> Why | None:
        """Why a running seat is not paused for an interactive request (None: it may be)."""
        if seat.klass is Class.INTERACTIVE:
            return INTERACTIVE
        if not self.preempt:
            return self.preempt_off
        if seat.unpausable is not None:
            return seat.unpausable
        if seat.pauses >= self.max_pauses:
            return Why("max_pauses", f"paused priority.max_pauses ({self.max_pauses}) times already: it runs to its "
                       "end")
        if seat.under_way is None:
            return BETWEEN
        return None if seat.under_way.plain else BEGUN

    def _not_paused_for(self, seat: Seat) -> None:
        behind = [(s, why) for s in self.running if not s.pause.is_set() and (why := self.why_not_paused(s))]
        told = bool(seat.behind)
        seat.behind = [{"path": s.path, "class": s.klass.value, "slot": s.use.slot, "session": s.asked.session,
                        "reason": why.code, "why": why.words} for s, why in behind]
        if not told and seat.behind:
            for _, why in behind:
                METRICS.not_paused.labels(reason=why.code).inc()
            log.info("priority.not_paused", path=seat.path, session=seat.asked.session, behind=seat.behind)

    def status(self) -> dict[str, Any]:
        now = time.monotonic()

        def shown_of(seat: Seat) -> dict[str, Any]:
            shown: dict[str, Any] = {"class": seat.klass.value, "path": seat.path, "slot": seat.use.slot,
                                     "pauses": seat.pauses, "tokens": seat.cost(), "s": round(now - seat.since, 3)}
            if seat.asked.session is not None:
                shown["session"] = seat.asked.session
            if seat in self.running and (why := self.why_not_paused(seat)) is not None:
                shown["not_paused"] = why.code
            if seat in self.waiting and seat.behind:
                shown["behind"] = seat.behind
            return shown

        return {"slots": self.total, "lane": {"slots": self.lane, "why": self.lane_why}, "preempt": self.preempt,
                "max_pauses": self.max_pauses,
                "paused": self.paused, "resumed": self.resumed, "gone": self.gone,
                "running": [shown_of(s) for s in self.running], "waiting": [shown_of(s) for s in self._order()]}
