"""POST /wrapper/drain: the stop's first half done now, before the SIGTERM (a Kubernetes preStop hook). New
requests are refused at once (/health 503), those in flight finish within a timeout, on_will_stop (the save)
runs; the stop then only stops llama-server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog

from wrapper.hooks_running import Hooks
from wrapper.lifecycle import State
from wrapper.notify import Notifier
from wrapper.progress import PROGRESS
from wrapper.reload_plan import Refusal, ReloadRefused
from wrapper.serving import Serving

log = structlog.get_logger()


class StopDrain:
    """Asked for once (a second ask waits for the same drain); the stop asks whether it left anything to do."""

    def __init__(self, serving: Serving, hooks: Hooks, notifier: Notifier) -> None:
        self._serving, self._hooks, self._notifier = serving, hooks, notifier
        self._task: asyncio.Task[dict[str, Any]] | None = None
        self._saved = False  # drained and saved: the stop has nothing left to wait for or save

    async def ask(self, timeout: float) -> dict[str, Any]:
        """Drain now (ReloadRefused unless ready or asleep: then the slots were kept already); a second call waits
        for the same drain."""
        if self._task is None:
            state = self._serving.lifecycle.state
            if state not in (State.READY, State.ASLEEP):
                raise ReloadRefused(f"llama-wrapper is {state}: it drains only when ready", 409, Refusal.NOT_READY)
            self._task = asyncio.ensure_future(self._drain(timeout))
        return await asyncio.shield(self._task)

    async def settled(self) -> bool:
        """At the stop: let a drain that runs finish (a signal came during it); whether it left nothing to do."""
        if self._task is not None and not self._task.done():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(self._task)
        return self._saved

    async def _drain(self, timeout: float) -> dict[str, Any]:
        serving, notifier = self._serving, self._notifier
        began = time.monotonic()
        asleep = serving.lifecycle.state is State.ASLEEP  # its slots were kept when it fell asleep
        serving.lifecycle.to(State.DRAINING)
        in_flight = serving.in_flight
        log.info("wrapper.drain", in_flight=in_flight, timeout_s=timeout)
        if in_flight:
            notifier.status(f"draining: {in_flight} request(s) in flight")
        PROGRESS.begin("draining: requests in flight")
        await serving.drain(timeout)
        drained_s = time.monotonic() - began
        notifier.status("draining: running on_will_stop (saving slots)")
        PROGRESS.begin("draining: on_will_stop (saving slots)")
        saved = [] if asleep else [run.as_dict() for run in await self._hooks.run("on_will_stop", serving.current)]
        PROGRESS.end()
        self._saved = True
        answer = {"drained": True, "in_flight": in_flight, "left_in_flight": serving.in_flight,
                  "drain_s": round(drained_s, 3), "total_s": round(time.monotonic() - began, 3),
                  "on_will_stop": saved}
        log.info("wrapper.drained", **{k: v for k, v in answer.items() if k != "on_will_stop"},
                 hooks=[f"{r['action']}: {r['outcome']}" for r in saved])
        notifier.status("drained: waiting for the stop")
        return answer
