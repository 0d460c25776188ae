"""Running the config's hooks at each moment of the wrapper's life, for one generation: their context, the
built-in actions bound to that generation, and a second signal that skips what is left of them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import aiohttp
import structlog

from wrapper import built_ins
from wrapper.actions import BuiltinFn, HookFailed, HookRun, HookRunner
from wrapper.configuration import hook_context
from wrapper.server.child import Exit
from wrapper.server.generation import Generation, StartFailed
from wrapper.server.llama import LlamaError

log = structlog.get_logger()

START_EVENTS = ("on_will_start", "on_startup")  # a failure here aborts the start; elsewhere it is logged
SLOT_EVENTS = ("on_startup", "on_will_stop", "on_reload")  # the context shows the server's slots then

# The generation a hook runs for, read when one of its built-in actions is bound (in the hook's own task).
_FOR: ContextVar[Generation] = ContextVar("hook_generation")


class Hooks:
    """Runs a hook for a generation; a second signal (`force`) cancels what runs and skips what is to come."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._runner = HookRunner(session, _bind)
        self.forced = asyncio.Event()  # a second signal: hooks not begun are skipped, drains end at once
        self._running: set[asyncio.Task[None]] = set()

    @property
    def history(self) -> list[HookRun]:
        return list(self._runner.history)

    def force(self) -> None:
        """A second signal: cancel the hooks that run now and skip the ones to come."""
        self.forced.set()
        for task in self._running:
            task.cancel()

    async def run(self, event: str, generation: Generation, *, result: str | None = None,
                  finished: Exit | None = None, reload: dict[str, Any] | None = None,
                  sleep: bool = False) -> list[HookRun]:
        """Run a hook; in a start hook a failure aborts the start (StartFailed), elsewhere it is logged.
        Returns the records of its actions."""
        hook_actions = generation.config.hooks[event]
        if not hook_actions:
            return []
        if self.forced.is_set():
            log.warning("hook.skipped_by_second_signal", hook=event)
            return []
        context = await _context(event, generation, result, finished, reload, sleep)
        before = self._runner.history[-1] if self._runner.history else None
        bound = _FOR.set(generation)
        try:  # the task copies the context, and with it the generation its built-ins are bound to
            task = asyncio.ensure_future(self._runner.run(event, hook_actions, context))
        finally:
            _FOR.reset(bound)
        self._running.add(task)
        try:
            await task
        except HookFailed as exc:
            if event in START_EVENTS:
                raise StartFailed(str(exc)) from exc
            log.warning("hook.failed_during_stop" if event != "on_reload" else "hook.failed", hook=event,
                        error=str(exc))
        except asyncio.CancelledError:
            if not self.forced.is_set():
                raise
            log.warning("hook.skipped_by_second_signal", hook=event)
        finally:
            self._running.discard(task)
        return _since(self._runner.history, before, event)

    async def end_leftovers(self) -> None:
        """At the wrapper's stop: end every job a hook left running."""
        if ended := await self._runner.end_leftovers():
            log.info("hook.leftovers_ended", hooks=ended)


def _bind(name: str, options: Mapping[str, Any]) -> BuiltinFn:
    return built_ins.bind(name, options, _FOR.get())


def _since(history: Sequence[HookRun], before: HookRun | None, event: str) -> list[HookRun]:
    """The records of `event` after `before` (the history keeps only the last ones: a count would not do;
    another hook may have run meanwhile)."""
    newer: list[HookRun] = []
    for run in reversed(history):
        if run is before:
            break
        if run.hook == event:
            newer.append(run)
    return newer[::-1]


async def _context(event: str, generation: Generation, result: str | None, finished: Exit | None,
                   reload: dict[str, Any] | None, sleep: bool) -> dict[str, Any]:
    slots: list[dict[str, Any]] = []
    needs_slots = any(a.kind != "builtin" for a in generation.config.hooks[event])
    if needs_slots and generation.alive and event in SLOT_EVENTS:
        with contextlib.suppress(LlamaError):
            slots = await generation.while_it_stays(generation.client.slots())
    pid = generation.child.pid if generation.child else None
    return dict(hook_context.build(event, generation.launch, pid, slots, result, finished, reload, sleep))
