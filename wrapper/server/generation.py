"""A generation: one llama-server process with its config, argv, client and the built-ins' state for it. It
starts and stops itself; a reload replaces one generation with the next. Built-in hooks see the running
wrapper only through a generation and the small `Host` protocol."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import structlog

from wrapper.configuration import argv as args
from wrapper.configuration.config import Config
from wrapper.kept import Kept
from wrapper.launching.launch import Asks, Launch
from wrapper.server.child import Child, Exit, spawn
from wrapper.server.context import ServerContext, server_context, training_context, with_context
from wrapper.server.llama import LlamaClient, LlamaError

log = structlog.get_logger()

READY_POLL = 0.1
T = TypeVar("T")


class ServerLeaving(LlamaError):
    """llama-server began to exit by itself while something was asked of it (Generation.while_it_stays)."""


class StartFailed(Exception):
    """llama-server did not come up (or a start hook failed)."""


class ServerLost(Exception):
    """llama-server died under a built-in's step (a restore it could not survive). The built-in has set aside
    what caused it; the wrapper starts the server again (as after a crash, under the same restart budget)."""


class Host(Protocol):
    """What built-ins may ask of the wrapper around them (what serves: wrapper/serving.py)."""

    @property
    def current(self) -> Generation:
        """The generation that serves now (a reload replaces it)."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests being served now."""
        ...

    async def reload(self, body: dict[str, Any], why: str | None = None,
                     asks: Asks | None = None, cut: bool = True) -> dict[str, Any]:
        """A reload as POST /wrapper/reload asks for it; with `why` and an empty body, the built-ins' own argv
        changes (their fit for the new generation, given `asks`) are the whole change. Without `cut`, answers
        still in flight at the drain's deadline are left to finish and the reload is given up (`success` false). Raises
        ReloadRefused. Built-ins ask through wrapper/reload_ask.py, which waits for a reload that runs."""
        ...

    def idle_s(self) -> float:
        """How long nothing has been asked of llama-server (0 while a request is in flight, held or arriving)."""
        ...

    def sleep_soon(self, why: str, idle_for: float) -> bool:
        """Fall asleep now (wrapper/life/sleeping.py), when ready and idle for at least `idle_for` seconds; whether it
        will."""
        ...

    async def survive(self, step: Callable[[], Awaitable[T]]) -> T | None:
        """Run a built-in's step on the request path that may kill llama-server (a restore). When the server dies
        under it (ServerLost: the built-in set the culprit aside), the loss is reported and the server started
        again as after a crash (on_startup runs; requests are held meanwhile); None is returned once the wrapper
        no longer serves with the lost one: the request goes on to the next."""
        ...


@dataclass
class Generation:
    config: Config
    launch: Launch
    client: LlamaClient
    child: Child | None = None
    state: Kept = field(default_factory=Kept)  # each built-in's own, for this generation (wrapper/kept.py)
    shared: Kept = field(default_factory=Kept)  # each built-in's own, for the wrapper's whole life
    context: ServerContext | None = None  # what the server runs with, from its /props once it is ready
    _props: tuple[Child, dict[str, Any]] | None = None  # the running server's GET /props, asked once per process

    async def props(self) -> dict[str, Any]:
        """llama-server's GET /props, asked once per process (what it says is fixed at its start); LlamaError
        when it cannot be asked."""
        child = self.child
        if self._props is not None and self._props[0] is child:
            return self._props[1]
        found = await self.client.props()
        if child is not None:
            self._props = (child, found)
        return found

    async def start(self, on_line: Callable[[Generation, str], None]) -> Child:
        """Spawn llama-server and wait until it answers /health 200; StartFailed otherwise (stopped then)."""
        config, launch = self.config, self.launch
        began = time.monotonic()
        try:
            child = await spawn(launch.argv, launch.env, lambda line: on_line(self, line))
        except OSError as exc:
            raise StartFailed(f"cannot start {launch.argv[0]!r}: {exc.strerror}") from exc
        self.child = child
        log.info("child.spawned", pid=child.pid, port=launch.port)
        deadline = began + config.ready_timeout
        while not await self.client.healthy(timeout=1.0):
            if not child.alive:
                finished = await child.wait()
                said = " | ".join(list(child.tail)[-3:])
                raise StartFailed(f"llama-server exited with status {finished.status} before it was ready "
                                  + (f"(last output: {said})" if said else "(it printed nothing)"))
            if time.monotonic() > deadline:
                await child.stop(config.stop_timeout)
                raise StartFailed(f"llama-server was not ready within server.ready_timeout "
                                  f"({config.ready_timeout:g}s)")
            await asyncio.sleep(READY_POLL)
        log.info("child.ready", pid=child.pid, load_s=round(time.monotonic() - began, 3))
        await self._learn_context()
        return child

    async def _learn_context(self) -> None:
        """Ask the server the context it runs with (llama-server caps a slot at the model's training context,
        rounds to 256 cells, ...): when that is not the -c it was given, the argv and the config the wrapper
        keeps say what runs, so that status, a reload's answer and the next reload see that."""
        try:
            props = await self.props()
            settings = props.get("default_generation_settings") or {}
            slot, slots = int(settings.get("n_ctx") or 0), int(props.get("total_slots") or 1)
        except (LlamaError, AttributeError, TypeError, ValueError):
            return
        if slot <= 0 or slots <= 0:
            return
        launch, config = self.launch, self.config
        learned = server_context(launch.argv, slot, slots, training_context(launch))
        known = self.context
        if known is not None and learned.asked == known.runs and learned.runs == known.runs:
            return  # started again with what it runs recorded: what the first start learnt still says why
        self.context = learned
        if learned.asked is None or learned.runs == learned.asked:
            return
        log.info("context.applied", asked=learned.asked, runs=learned.runs, slot=slot, slots=slots, why=learned.why)
        note = {"change": f"-c {learned.asked} -> {learned.runs}",
                "why": f"llama-server runs {learned.runs} (GET /props: {slots} slot(s) of {slot}): {learned.why}; "
                       "the argv shows what runs"}
        self.launch = replace(launch, argv=with_context(launch.argv, learned.runs), notes=[*launch.notes, note])
        if args.get(config.argv, args.CTX_SIZE) == str(learned.asked):  # not a built-in's fit of another -c
            self.config = replace(config, argv=tuple(with_context(config.argv, learned.runs)))

    async def stop(self) -> Exit | None:
        """One SIGTERM, SIGKILL after server.stop_timeout; None when it never started."""
        child = self.child
        if child is None:
            return None
        if child.alive:
            log.info("child.stopping", pid=child.pid, timeout_s=self.config.stop_timeout)
        finished = await child.stop(self.config.stop_timeout)
        log.log(finished.log_level, "child.exited", pid=child.pid, code=finished.code, signal=finished.signal_name,
                killed_after_timeout=finished.killed)
        return finished

    @property
    def alive(self) -> bool:
        return self.child is not None and self.child.alive

    async def while_it_stays(self, work: Awaitable[T]) -> T:
        """`work` against this server, given up (ServerLeaving) once it begins to exit by itself: it got a stop's
        signal too (systemd sends SIGTERM to every process of a unit), says "cleaning up before exit" and answers
        nothing more — a stop's save or its hooks' look at the slots would wait for their timeout, or forever."""
        task = asyncio.ensure_future(work)
        if self.child is None:
            return await task
        leaving = asyncio.ensure_future(self.child.leaving.wait())
        try:
            await asyncio.wait([task, leaving], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            leaving.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ServerLeaving("llama-server is exiting by itself (it got the stop's signal too: 'cleaning up before "
                            "exit') and answers nothing more: not done; what the checkpoints kept stands")
