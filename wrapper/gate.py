"""The request gate: holds requests until the server is ready, counts those in flight, refuses after close."""

from __future__ import annotations

import asyncio

from wrapper.aio import first_of


class Gate:
    def __init__(self) -> None:
        self._opened = asyncio.Event()
        self._closed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0
        self.held = 0

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def open(self) -> None:
        self._opened.set()

    def close(self) -> None:
        """Refuse new requests and release held ones with a refusal; in-flight ones go on."""
        self._closed.set()

    async def enter(self) -> bool:
        """Wait until the gate opens (True) or closes (False); on True the caller must `leave()`."""
        if not self._opened.is_set() and not self._closed.is_set():
            self.held += 1
            try:
                await first_of(self._opened.wait(), self._closed.wait())
            finally:
                self.held -= 1
        if self._closed.is_set():
            return False
        self.in_flight += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drained(self, timeout: float) -> bool:
        """Wait up to `timeout` for in-flight requests to finish; True if none is left."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
