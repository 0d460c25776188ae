"""The one watch on llama-server: it is lost when it dies on its own, when it hangs (wrapper/life/watchdog.py), or when
a built-in's step on the request path loses it (ServerLost under `Host.survive`: a restore it died under, the culprit
set aside). Each is one report, and the life (wrapper/life/server_life.py) restarts it the one way, under one budget.

A server a reload replaces is not lost, nor one that died under a step a reload then replaced; a reload that brings
no server back at all leaves a dead one current, and that one is."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from wrapper.aio import first_of
from wrapper.configuration.sections import WatchdogSettings
from wrapper.life.watchdog import Lost, died, hung
from wrapper.server.generation import Generation, ServerLost
from wrapper.serving import Serving

T = TypeVar("T")


class Watch:
    """What may lose the server besides the process itself: reloads (which replace it) and built-ins' steps (which
    may lose it, and report it here)."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.reloading: asyncio.Task[object] | None = None  # a reload that runs (wrapper/life/server_life.py starts it)
        self._reload_began = asyncio.Event()
        self.risky = 0  # built-ins' steps that may lose the server, running now
        self._risky_ended = asyncio.Event()
        self._reported: list[tuple[Generation, Lost]] = []  # steps' losses of a server, until the watch takes them
        self._report = asyncio.Event()

    def reload_began(self, task: asyncio.Task[object]) -> None:
        self.reloading = task
        task.add_done_callback(self._reload_ended)
        self._reload_began.set()

    def _reload_ended(self, task: asyncio.Task[object]) -> None:
        if self.reloading is task:
            self.reloading = None

    async def lost(self, watching: WatchdogSettings | None = None) -> Lost:
        """Return when the server that serves is lost: dead on its own, lost under a step (reason `restore`), or
        with `watching`, hung."""
        while True:
            generation = self.serving.current
            child = generation.child
            assert child is not None
            hanging = asyncio.ensure_future(hung(self.serving, watching)) if watching is not None else None
            try:
                await first_of(child.wait(), self._reload_began.wait(), self._report.wait(),
                               *([hanging] if hanging else []))
            finally:
                if hanging is not None and not hanging.done():
                    hanging.cancel()
            self._report.clear()
            if self._reload_began.is_set():  # wait for the reload, then watch the server it leaves
                self._reload_began.clear()
                if self.reloading is not None:
                    await asyncio.wait([self.reloading])
                continue
            if hanging is not None and hanging.done() and not hanging.cancelled() and child.alive \
                    and child is self.serving.current.child:
                return hanging.result()
            while not child.alive and self.risky and not self._of(generation) and not self._reload_began.is_set():
                self._risky_ended.clear()  # it died under a step, which reports it (a restore: the culprit set aside)
                self._report.clear()
                await first_of(self._risky_ended.wait(), self._reload_began.wait(), self._report.wait())
            if self._reload_began.is_set():
                continue
            reported = self._of(generation)
            self._reported.clear()  # those of a server that no longer serves are nobody's
            if generation is self.serving.current and reported is not None:
                return reported
            if child is self.serving.current.child and not child.alive:
                return died(await child.wait())

    def _of(self, generation: Generation) -> Lost | None:
        return next((lost for lost_of, lost in self._reported if lost_of is generation), None)

    async def survive(self, step: Callable[[], Awaitable[T]]) -> T | None:
        """A built-in's step that may lose the server, on the request path (see Host.survive): when it does, the loss
        is reported to the watch and this returns None once the wrapper no longer serves with that server (the
        request then waits at the gate for the one started again)."""
        generation = self.serving.current
        self.risky += 1
        try:
            return await step()
        except ServerLost as exc:
            if generation is self.serving.current:
                self._reported.append((generation, Lost("restore", str(exc))))
                self._report.set()
                await self.serving.moved_on(generation)
            return None
        finally:
            self.risky -= 1
            self._risky_ended.set()
