"""What serves now: the current generation, the state the gate follows, the gate and the seats in front of it, what
llama-server answered the GETs clients poll (for a sleep), and what a request whose exchange was cut learns of its
server. The request path (wrapper/answers/forwarding.py) and the server's life (wrapper/life/server_life.py) share
this one object; only the life changes the state and installs a generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

import aiohttp
import structlog

from wrapper import built_ins
from wrapper.configuration import argv as args
from wrapper.configuration.config import Config
from wrapper.configuration.sections import PRIORITY, WATCHDOG
from wrapper.kept import Kept
from wrapper.launching.launch import Launch
from wrapper.lifecycle import Lifecycle, State
from wrapper.metrics import METRICS
from wrapper.queue.gate import Gate
from wrapper.queue.seats import Seats, Why
from wrapper.server.context import AUTO_SLOTS
from wrapper.server.generation import Generation
from wrapper.server.llama import LlamaClient

LOSS_SEEN_S = 2.0  # a cut exchange: how long its server's end may take to be seen
log = structlog.get_logger()

MOVED_ON_S = 120.0  # a dead server: how long the life may take to notice (bounded: a stuck life is not waited for)


class Loss(Enum):
    """What a cut exchange meets once the wrapper has looked at its server."""

    NONE = "none"  # the server is well: the cut was another failure
    BACK = "back"  # it was lost and another serves (or will: the next pass waits at the gate for it)
    GONE = "gone"  # it was lost and is not started again: the wrapper stops


GONE_WHY = ("llama-server was lost and is not started again (watchdog.enabled is false, or watchdog.restarts are "
            "spent): llama-wrapper stops")


@dataclass(frozen=True)
class Remembered:
    """What llama-server answered a GET while awake (its status and JSON body), answered from here while asleep."""

    status: int
    payload: Any


class Serving:
    """The generation that serves now, with the state and the gate in front of it."""

    def __init__(self, config: Config, launch: Launch, session: aiohttp.ClientSession, shared: Kept) -> None:
        self.session = session
        self._shared = shared  # the built-ins' state for the wrapper's whole life
        self.gate = Gate(config.reload_hold_timeout)
        self._changed = asyncio.Event()  # set at every change of state
        self.lifecycle = Lifecycle(self.gate.follow, METRICS.follow, lambda _: self._changed.set())
        self.current = self.new_generation(config, launch)
        self.heard_at = time.monotonic()  # a request in flight last sent to llama-server or heard from it
        self.cut_by_loss = 0  # requests whose exchange was cut, waiting to learn whether their server was lost
        self.seats = Seats()  # the slots' queue (wrapper/queue/seats.py), for the wrapper's life
        self.remembered: dict[str, Remembered] = {}  # the GETs clients poll, as llama-server last answered them
        self._lane_told: Generation | None = None  # the generation whose lane (or its absence) the log said

    def heard(self) -> None:
        """A request in flight sent to llama-server, or a byte of an answer came back (the watchdog's stall)."""
        self.heard_at = time.monotonic()

    @property
    def state(self) -> State:
        return self.lifecycle.state

    def cpu_time(self) -> float | None:
        """The CPU seconds the serving llama-server has used (the watchdog's sign that it computes)."""
        child = self.current.child
        return child.cpu_time() if child is not None else None

    @property
    def in_flight(self) -> int:
        return self.gate.in_flight

    def queue(self) -> Generation:
        """Set the slots' queue for the generation that serves now (its slots, `priority:`); that generation."""
        generation = self.current
        settings = PRIORITY.of(generation.config)
        self.seats.resize(slot_count(generation))
        on, self.seats.lane_why = built_ins.lane_of(generation.launch)
        self.seats.lane = 1 if on and self.seats.total > 1 else 0
        if self._lane_told is not generation:
            self._lane_told = generation
            if not on and settings.lane is None:  # `auto` said no: a person may wait behind an agent
                log.warning("priority.no_lane", why=self.seats.lane_why)
        self.seats.max_pauses = settings.max_pauses
        self.seats.preempt, why = built_ins.preemption(generation.config)
        self.seats.preempt_off = Why("preempt_off", why)
        return generation

    def new_generation(self, config: Config, launch: Launch) -> Generation:
        return Generation(config, launch, LlamaClient(launch.url, self.session, launch.api_key), shared=self._shared)

    def install(self, generation: Generation) -> None:
        """Make a new generation the current one: requests released from now on go to it (the life's to do)."""
        self.current = generation
        self.queue()  # its slots, and whether a lane is kept (said in the log once)

    async def drain(self, timeout: float, force: asyncio.Event, cut: bool = True) -> bool:
        """Let the requests in flight finish within `timeout` (`force` set: at once), cut the rest (unless not
        `cut`); whether none is left."""
        return await self.gate.drain(timeout, force, cut)

    async def lost_under(self, generation: Generation, within: float = LOSS_SEEN_S,
                         moving_on: float = MOVED_ON_S) -> Loss:
        """After an exchange with `generation` was cut: whether its server was lost, and if so whether the watchdog
        starts another (the caller's next pass waits at the gate for it). Its end may be seen a moment after the
        cut (`within`); once it is dead, the wrapper no longer serving with it may take longer (`moving_on`): a busy
        machine runs the watch late, and a pass sent on meanwhile would go to the dead server, a second loss that
        gives the request up. Counted in `cut_by_loss` meanwhile."""
        child = generation.child
        if child is None:
            return Loss.NONE
        self.cut_by_loss += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(child.wait(), within)
            dead = not child.alive or child.exited_now()
            if not dead and self.lifecycle.state is not State.RESTARTING:
                return Loss.NONE  # it is well: the cut was another failure
            if not WATCHDOG.of(generation.config).enabled:
                return Loss.GONE
            with contextlib.suppress(TimeoutError):  # the life holds the gate before the next pass reaches it
                await asyncio.wait_for(self.moved_on(generation), moving_on if dead else within)
            serving_again = (State.READY, State.RESTARTING, State.RELOADING)
            return Loss.BACK if self.lifecycle.state in serving_again else Loss.GONE  # given up: it stops
        finally:
            self.cut_by_loss -= 1

    async def moved_on(self, generation: Generation) -> None:
        """Until the wrapper no longer serves with `generation` as if it were well (restarting, stopping, or
        another generation installed)."""
        while self.lifecycle.state is State.READY and self.current is generation:
            self._changed.clear()
            await self._changed.wait()


def slot_count(generation: Generation) -> int:
    """The slots a generation's server has: as it said at its start, else its -np (llama-server's automatic count)."""
    if generation.context is not None:
        return generation.context.slots
    given = args.get(generation.launch.argv, args.PARALLEL)
    return int(given) if given is not None and given.strip().isdigit() and int(given) > 0 else AUTO_SLOTS
