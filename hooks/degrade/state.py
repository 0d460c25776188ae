"""What degradation keeps: for the wrapper's whole life (`DegradeState`), per generation (`Measuring`), and
the fit a generation runs with (`Fitted`, in its launch)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hooks.degrade import FAMILY, calibration
from hooks.degrade.ladder import RungPlan
from hooks.degrade.memory import Choices, ModelShape
from wrapper.configuration import argv as args
from wrapper.kept import Kept, Key
from wrapper.launching.launch import Launch
from wrapper.server.generation import Generation

_ID_SLOT = re.compile(rb'"id_slot"\s*:\s*(\d+)')


@dataclass
class DegradeState:
    """Lives as long as the wrapper: the budget and rung in force, and what happened. Changed only when a move
    succeeds (control.py), or by the first fit (the budget a start resolves)."""

    budget: int | None = None
    budget_source: str = ""
    rung_in_force: str | None = None  # the rung a growth, relax or budget change moved to (kept by later reloads)
    steps: list[dict[str, Any]] = field(default_factory=list)
    last_activity: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock | None = None
    waiting: list[int] = field(default_factory=list)  # the tokens each request waiting for a growth needs
    shape: ModelShape | None = None
    started: bool = False  # the first fit is done (a start asks the pool for what it needs; later fits do not)
    climb_after: float = 0.0  # with a pool: a failed climb back waits until then (time.monotonic())
    ctx_taken: int = 0  # with a pool: the context the last fit took (a reload degrade did not ask for keeps it)
    looked: tuple[int, int, bool, str, int, int] | None = None  # with a pool: what the last climb looked at
    giving: bool = False  # with a pool: a give is under way (its climb back waits for the answer)
    gave: bool = False  # with a pool: it gave memory to another member and has not climbed back yet
    sleep_asks: list[Any] = field(default_factory=list)  # with a pool: the asks to sleep, answered once asleep


@dataclass(frozen=True)
class Fitted:
    """The fit a generation runs with: its rung of the ladder planned under its budget."""

    rung: str
    index: int
    n_ctx: int
    choices: Choices  # what of its argv changes memory
    rungs: list[RungPlan]
    budget: int
    budget_source: str
    swa_dropped: bool
    verbosity_added: bool
    share: int = 0  # with a pool: the bytes this plan takes of it (at n_ctx, on the pool's device)
    floor: int = 0  # with a pool: the least this member could run with (its last rung at its smallest context)
    pool: str | None = None  # the pool's folder

    def as_dict(self) -> dict[str, Any]:
        return {"rung": self.rung, "n_ctx": self.n_ctx}


@dataclass
class Measuring:
    """What degrade knows of one child: the buffers it reported."""

    measured: calibration.Measured = field(default_factory=calibration.Measured)
    remembered: bool = False


STATE = Key("degrade", DegradeState)  # for the wrapper's life: the budget, the rung, what was measured
MEASURING = Key("degrade.measuring", Measuring)  # for one generation


def state_of(shared: Kept) -> DegradeState:
    return shared.get(STATE)


def fitted(launch: Launch) -> Fitted | None:
    found = launch.fitted.get(FAMILY)
    return found if isinstance(found, Fitted) else None


def measuring(generation: Generation) -> Measuring:
    return generation.state.get(MEASURING)


def context_for(argv: Sequence[str], held: Sequence[int], demands: Sequence[int]) -> int:
    """The `-c` that holds `demands` (the tokens requests need) beside what the other slots hold (`held`: the tokens
    of each slot's conversation, the slot book's). With one KV for all slots (-kvu) their cells add up: the
    demands that can run at once, plus the conversations they do not replace; without it every slot gets
    -c / -np cells, so the largest demand times -np."""
    parallel = max(1, int(args.get(argv, args.PARALLEL) or 1))
    running = sorted(demands, reverse=True)[:parallel]
    if not running:
        return 0
    if parallel == 1:
        return running[0]
    if args.unified_kv(argv):
        others = sorted(held, reverse=True)[len(running):]  # slots the requests do not use
        return sum(running) + sum(others)
    return running[0] * parallel
