"""The request gate: holds requests until the server is ready, tracks those in flight, refuses after close."""

from __future__ import annotations

import asyncio
from typing import Any

from wrapper.aio import first_of


class Gate:
    def __init__(self) -> None:
        self._opened = asyncio.Event()
        self._closed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.in_flight = 0
        self.held = 0
        self._exchanges: set[asyncio.Future[Any]] = set()

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

    def track(self, exchange: asyncio.Future[Any]) -> None:
        """Remember an admitted request's exchange with llama-server, so that `cut()` can end it."""
        self._exchanges.add(exchange)

    def leave(self, exchange: asyncio.Future[Any] | None = None) -> None:
        if exchange is not None:
            self._exchanges.discard(exchange)
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def cut(self) -> int:
        """Cancel every exchange still in flight (llama-server sees its connection close and frees the slot)."""
        pending = [exchange for exchange in self._exchanges if not exchange.done()]
        for exchange in pending:
            exchange.cancel()
        return len(pending)

    async def drained(self, timeout: float) -> bool:
        """Wait up to `timeout` for in-flight requests to finish; True if none is left."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
