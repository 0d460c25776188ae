"""systemd's notify protocol (sd_notify(3)): one datagram of `KEY=VALUE` lines to the AF_UNIX socket named by
$NOTIFY_SOCKET (a leading `@` is the abstract namespace). Nothing is sent when the variable is absent; a socket
that cannot be reached is logged once and never fails the wrapper."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

import structlog

from wrapper.lifecycle import State

log = structlog.get_logger()

_STATE_STATUS = {State.STARTING: "starting: loading the model", State.READY: "ready",
                 State.RELOADING: "reloading", State.RESTARTING: "restarting llama-server: requests held",
                 State.SLEEPING: "falling asleep: saving slots, stopping llama-server",
                 State.ASLEEP: "asleep: llama-server stopped, its memory free; the next request wakes it",
                 State.WAKING: "waking: starting llama-server, restoring slots; requests held",
                 State.DRAINING: "draining: refusing new requests",
                 State.STOPPING: "stopping", State.STOPPED: "stopped"}


class Notifier:
    def __init__(self, env: Mapping[str, str]) -> None:
        path = env.get("NOTIFY_SOCKET") or ""
        self.address = "\0" + path[1:] if path.startswith("@") else path
        self._failed = False
        self.watchdog_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if self.address and usec and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6 / 2  # systemd's advice: ping at half the interval

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *lines: str) -> None:
        if not self.address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)  # a reader that lags (its queue full) never stalls the wrapper's loop
                sock.sendto("\n".join(lines).encode(), self.address)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning("notify.failed", socket=os.environ.get("NOTIFY_SOCKET"), error=str(exc))

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def follow(self, state: State) -> None:
        """The state decides what systemd is told: READY=1 once ready (again after a reload), RELOADING=1 with
        the monotonic time when a reload begins, STOPPING=1 at the stop."""
        status = f"STATUS={_STATE_STATUS[state]}"
        if state is State.READY:
            self.send("READY=1", status)
        elif state is State.RELOADING:
            self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}", status)
        elif state is State.STOPPING:
            self.send("STOPPING=1", status)
        else:
            self.send(status)

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")
