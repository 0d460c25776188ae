"""What serves now: the current generation, the gate requests pass to reach it, and the state the gate follows.
A reload installs the next generation here. Forwarding, the reloader and the built-ins (as `Host`) are given this
one object; the supervisor only starts it, watches it and stops it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Mapping
from typing import Any

import aiohttp

from wrapper.aio import first_of
from wrapper.config import Config
from wrapper.gate import Gate
from wrapper.generation import Generation
from wrapper.hooks_running import Hooks
from wrapper.kept import Kept
from wrapper.launch import Launch
from wrapper.lifecycle import Lifecycle, State
from wrapper.llama import LlamaClient
from wrapper.metrics import METRICS
from wrapper.notify import Notifier
from wrapper.reload_plan import BUSY_RELOADING, Refusal, ReloadRefused
from wrapper.reloader import Reloader


class Serving:
    """The generation that serves now, with the gate and the state in front of it; the reload entry."""

    def __init__(self, config: Config, launch: Launch, session: aiohttp.ClientSession, shared: Kept,
                 hooks: Hooks, notifier: Notifier) -> None:
        self.session = session
        self._shared = shared  # the built-ins' state for the wrapper's whole life
        self.gate = Gate(config.reload_hold_timeout)
        self.lifecycle = Lifecycle(self.gate.follow, notifier.follow, METRICS.follow)
        self.current = self.new_generation(config, launch)
        self.last_reload: dict[str, Any] | None = None  # the last reload's answer
        self._hooks = hooks
        self._reloading: asyncio.Task[dict[str, Any]] | None = None
        self._reload_began = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return self.gate.in_flight

    def new_generation(self, config: Config, launch: Launch) -> Generation:
        return Generation(config, launch, LlamaClient(launch.url, self.session, launch.api_key), shared=self._shared)

    def install(self, generation: Generation) -> None:
        """Make a new generation the current one: requests released from now on go to it."""
        self.current = generation

    async def drain(self, timeout: float) -> None:
        """Let the requests in flight finish within `timeout` (a second signal ends the wait), cut the rest."""
        await self.gate.drain(timeout, self._hooks.forced)

    async def reload(self, body: dict[str, Any], why: str | None = None,
                     asks: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Reconfigure the running llama-server (see wrapper/reloader.py); one at a time, only when ready."""
        if self._reloading is not None:
            raise ReloadRefused(BUSY_RELOADING, 409, Refusal.BUSY)
        if self.lifecycle.state is not State.READY:
            raise ReloadRefused(f"llama-wrapper is {self.lifecycle.state}: it reloads only when ready", 409,
                                Refusal.NOT_READY)
        reloader = Reloader(self)
        nxt = reloader.settle(body, why, asks)  # refusals come before anything stops
        task = asyncio.ensure_future(self._reload(reloader.run(nxt)))
        self._reloading = task
        task.add_done_callback(self._reload_ended)
        self._reload_began.set()
        return await asyncio.shield(task)  # a client that hangs up does not stop the reload

    async def _reload(self, cycle: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        self.last_reload = answer = await cycle
        await self._hooks.run("on_reload", self.current, reload=answer)
        return answer

    def _reload_ended(self, task: asyncio.Task[dict[str, Any]]) -> None:
        if self._reloading is task:
            self._reloading = None

    async def lost(self) -> None:
        """Return when llama-server dies on its own: one that a reload replaces is not lost (a reload that can
        bring back no server at all leaves a dead one current)."""
        while True:
            child = self.current.child
            assert child is not None
            await first_of(child.wait(), self._reload_began.wait())
            if self._reload_began.is_set():  # wait for the reload, then watch the server it leaves
                self._reload_began.clear()
                if self._reloading is not None:
                    await asyncio.wait([self._reloading])
                continue
            if child is self.current.child:
                return

    async def abandon_reload(self) -> None:
        """At a stop: cancel a reload that runs (the stop then saves what is there)."""
        if self._reloading is not None and not self._reloading.done():
            self._reloading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reloading
