"""The wrapper's states and the one place where a transition between them is checked."""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

import structlog

log = structlog.get_logger()


class State(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    RELOADING = "reloading"
    RESTARTING = "restarting"  # llama-server was lost (a crash, a hang): started again, requests held meanwhile
    SLEEPING = "sleeping"  # idle for sleep.after: the slots saved, llama-server stopped; requests held
    ASLEEP = "asleep"  # no llama-server, its memory free; the next request that needs it wakes it
    WAKING = "waking"  # llama-server started again and restored; requests held
    DRAINING = "draining"  # POST /wrapper/drain: refusing new requests, saved, waiting for the stop
    STOPPING = "stopping"


_ALLOWED = {
    State.STOPPED: {State.STARTING, State.STOPPING},  # stopping: the public address could not be taken
    State.STARTING: {State.READY, State.STOPPING},
    State.READY: {State.RELOADING, State.RESTARTING, State.SLEEPING, State.DRAINING, State.STOPPING},
    State.SLEEPING: {State.ASLEEP, State.READY, State.STOPPING},  # ready: the sleep was given up (a request came)
    State.ASLEEP: {State.WAKING, State.DRAINING, State.STOPPING},  # draining: nothing in flight, all kept
    State.WAKING: {State.READY, State.ASLEEP, State.STOPPING},  # asleep: the wake failed
    State.RELOADING: {State.READY, State.STOPPING},
    State.RESTARTING: {State.READY, State.STOPPING},
    State.DRAINING: {State.STOPPING},
    State.STOPPING: {State.STOPPED},
}


class IllegalTransition(RuntimeError):
    pass


class Lifecycle:
    def __init__(self, *followers: Callable[[State], None]) -> None:
        self.state = State.STOPPED
        self._followers = list(followers)  # the gate (what a request meets follows from the state alone), systemd

    def followed_by(self, follower: Callable[[State], None]) -> None:
        self._followers.append(follower)

    def to(self, new: State) -> None:
        if new not in _ALLOWED[self.state]:
            raise IllegalTransition(f"{self.state} -> {new}")
        log.info("state.changed", old=str(self.state), new=str(new))
        self.state = new
        for follower in self._followers:
            follower(new)
