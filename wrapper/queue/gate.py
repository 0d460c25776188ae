"""The request gate: it follows the wrapper's state. Requests are held while starting, reloading, falling asleep,
asleep or waking (one that arrives while asleep wakes the server), pass while ready, and are refused once stopping;
those admitted are tracked until they leave, and the last moment one came or went is kept (sleep.after)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

import structlog

from wrapper.aio import first_of
from wrapper.lifecycle import State

log = structlog.get_logger()

CUT_GRACE = 2.0  # how long requests cut at the drain deadline get to unwind


class Admission(Enum):
    ADMITTED = "admitted"  # the caller must `leave()`
    REFUSED = "refused"  # the wrapper is stopping
    TIMED_OUT = "timed out"  # held longer than the hold limit (a reload that takes too long)
    NOT_WOKEN = "not woken"  # held while asleep, and the wake failed (`Gate.wake_failed` says why)


class Gate:
    def __init__(self, reload_hold_timeout: float | None = None) -> None:
        self._opened = asyncio.Event()
        self._refusing = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._reload_hold_timeout = reload_hold_timeout
        self._hold_limit: float | None = None
        self.in_flight = 0
        self.held = 0
        self._exchanges: set[asyncio.Future[Any]] = set()
        self._resumable: dict[asyncio.Future[Any], Callable[[], bool]] = {}  # exchanges that can go on on the next
        # server, each with whether it can at this moment
        self._handed: set[asyncio.Future[Any]] = set()  # those a reload cut to hand them over
        self.active_at = time.monotonic()  # the last moment a request came to the gate or left it
        self.wake: Callable[[], None] | None = None  # called by a request that arrives while asleep
        self._asleep = False
        self._turned_away = asyncio.Event()  # a wake failed: those held for it are answered (a new one per wake)
        self.wake_failed = ""

    @property
    def refusing(self) -> bool:
        """Draining or stopping: every new request is refused."""
        return self._refusing.is_set()

    async def until_refusing(self) -> None:
        await self._refusing.wait()

    def follow(self, state: State) -> None:
        """Called on every state change: the state alone decides what happens to a request."""
        if state is State.READY:
            self._opened.set()
        elif state in (State.DRAINING, State.STOPPING, State.STOPPED):
            self._opened.clear()
            self._refusing.set()
        else:  # starting, reloading, restarting, asleep: hold (a restart's own deadline is server.ready_timeout)
            self._opened.clear()
        self._asleep = state is State.ASLEEP
        self._hold_limit = self._reload_hold_timeout if state is State.RELOADING else None

    async def enter(self, counted: bool = True, active: bool = True) -> Admission:
        """Wait until requests may pass, are refused, or the hold limit passes; while asleep, wake the server and
        wait for it. `counted`: the caller is in flight until it leaves (not counted: it only waited for the gate,
        and a drain does not wait for it); not `active`: it does not keep the server awake (what a client polls)."""
        loop = asyncio.get_running_loop()
        deadline = None if self._hold_limit is None else loop.time() + self._hold_limit
        if active:
            self.active_at = time.monotonic()
        turned_away = self._turned_away
        self.held += 1
        try:
            while not self._opened.is_set() and not self._refusing.is_set() and not turned_away.is_set():
                if self._asleep and self.wake is not None:
                    self.wake()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(deadline):
                        await first_of(self._opened.wait(), self._refusing.wait(), turned_away.wait())
                if deadline is not None and loop.time() >= deadline and not self._opened.is_set():
                    break
        finally:
            self.held -= 1
        if self._refusing.is_set():
            return Admission.REFUSED
        if turned_away.is_set() and not self._opened.is_set():
            return Admission.NOT_WOKEN
        if not self._opened.is_set():
            return Admission.TIMED_OUT
        if not counted:
            return Admission.ADMITTED
        self.in_flight += 1
        self._idle.clear()
        return Admission.ADMITTED

    def idle_s(self) -> float:
        """How long nothing has come or gone (0 while a request is in flight or held)."""
        return 0.0 if self.in_flight or self.held else max(0.0, time.monotonic() - self.active_at)

    def turn_away(self, why: str) -> None:
        """A wake failed: the requests held for it are answered with `why`; the next one wakes the server again."""
        self.wake_failed = why
        self._turned_away.set()
        self._turned_away = asyncio.Event()

    def track(self, exchange: asyncio.Future[Any], resumable: Callable[[], bool] | None = None) -> None:
        """Remember an admitted request's exchange with llama-server, so that `cut()` can end it; `resumable`:
        whether its answer can go on from where it is now on another server (a stream the answer loop continues:
        only text so far, not yet ended)."""
        self._exchanges.add(exchange)
        if resumable is not None:
            self._resumable[exchange] = resumable

    def leave(self, exchange: asyncio.Future[Any] | None = None) -> None:
        if exchange is not None:
            self._exchanges.discard(exchange)
            self._resumable.pop(exchange, None)
            self._handed.discard(exchange)
        self.in_flight -= 1
        self.active_at = time.monotonic()
        if self.in_flight == 0:
            self._idle.set()

    def cut(self) -> int:
        """Cancel every exchange still in flight (llama-server sees its connection close and frees the slot)."""
        pending = [exchange for exchange in self._exchanges if not exchange.done()]
        for exchange in pending:
            exchange.cancel()
        return len(pending)

    def carry_streams(self) -> int:
        """Cut the resumable exchanges for a reload that continues them on the next server (`handed_over()` tells
        them from a cut at a deadline); how many."""
        pending = [exchange for exchange, now in self._resumable.items() if not exchange.done() and now()]
        for exchange in pending:
            self._handed.add(exchange)
            exchange.cancel()
        return len(pending)

    def handed_over(self, exchange: asyncio.Future[Any]) -> bool:
        return exchange in self._handed

    async def drain(self, timeout: float, force: asyncio.Event, cut: bool = True) -> bool:
        """Let requests in flight finish within `timeout` (or until `force`), then cut the rest so that slots are
        idle for a save; without `cut`, leave them be. Whether none is left in flight."""
        if not self.in_flight:
            return True
        log.info("wrapper.draining", in_flight=self.in_flight, timeout_s=timeout)
        await first_of(self.drained(timeout), force.wait())
        if self.in_flight and cut:
            # Cut what is left: llama-server frees those slots, so the save that follows runs on idle ones.
            log.warning("wrapper.drain_timeout", in_flight=self.in_flight, cut=self.cut())
            await self.drained(CUT_GRACE)
        return not self.in_flight

    async def drained(self, timeout: float) -> bool:
        """Wait up to `timeout` for in-flight requests to finish; True if none is left."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
