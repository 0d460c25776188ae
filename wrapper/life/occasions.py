"""The occasions of llama-server's life, and what each one does, as a table (wrapper/life/server_life.py follows it).

A server comes up one way (the hooks, the start, the restore) and goes down one way (the drain, the save, the
stop, `on_stopped`); what differs between a start, a restart and a wake, or between a stop, a sleep and a drain,
is only what this table says. A reload is not here: it runs its own cycle (wrapper/life/reloader.py) and asks the life
to hold, install and release.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from wrapper.lifecycle import State


class Occasion(StrEnum):
    START = "start"  # the wrapper's first server
    RESTART = "restart"  # lost (a crash, a hang, a restore it died under): started again
    WAKE = "wake"  # asleep, and a request came: started again, fitted as at a start
    STOP = "stop"  # the wrapper stops: a signal, a start that failed, a loss given up on
    SLEEP = "sleep"  # idle: every slot kept, llama-server stopped, the wrapper listening on
    DRAIN = "drain"  # POST /wrapper/drain: refusing from now, every slot kept; the stop only stops llama-server


@dataclass(frozen=True)
class Up:
    """How a server comes up."""

    held: State  # the state while it comes up: requests are held
    doing: str  # what the progress and systemd's status say
    fits: bool  # the built-ins' fits run again (a pool member takes its share again)
    will_start: bool  # on_will_start runs
    asleep: bool  # the start hooks say `sleep` (it comes back from one)
    spends: bool  # it spends the restart budget (watchdog.restarts within watchdog.window)


@dataclass(frozen=True)
class Down:
    """How a server goes down."""

    held: State  # the state while it goes down: STOPPING and DRAINING refuse requests, SLEEPING holds them
    doing: str  # what the progress and systemd's status say
    cuts: bool  # answers still in flight at the drain's deadline are cut (a sleep is given up instead)
    stops: bool  # llama-server is stopped and on_stopped runs (a drain leaves both to the stop)
    asleep: bool  # the stop hooks say `sleep`
    then: State | None  # the state once down (None: it stays in `held` until the stop)


UP: dict[Occasion, Up] = {
    Occasion.START: Up(State.STARTING, "starting", fits=False, will_start=True, asleep=False, spends=False),
    Occasion.RESTART: Up(State.RESTARTING, "restarting", fits=False, will_start=False, asleep=False, spends=True),
    Occasion.WAKE: Up(State.WAKING, "waking", fits=True, will_start=True, asleep=True, spends=False),
}

DOWN: dict[Occasion, Down] = {
    Occasion.STOP: Down(State.STOPPING, "stopping", cuts=True, stops=True, asleep=False, then=State.STOPPED),
    Occasion.SLEEP: Down(State.SLEEPING, "falling asleep", cuts=False, stops=True, asleep=True, then=State.ASLEEP),
    Occasion.DRAIN: Down(State.DRAINING, "draining", cuts=True, stops=False, asleep=False, then=None),
}


def up(occasion: Occasion) -> Up:
    """How a server comes up at `occasion` (KeyError for a way down)."""
    return UP[occasion]


def down(occasion: Occasion) -> Down:
    """How a server goes down at `occasion` (KeyError for a way up)."""
    return DOWN[occasion]
