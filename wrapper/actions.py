"""Running hook actions: http, shell, exec and built-ins, each with a deadline, bounded retries and a record."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from wrapper.configuration import template
from wrapper.configuration.config import Action
from wrapper.configuration.hook_context import environment
from wrapper.metrics import METRICS
from wrapper.server.child import Child, spawn
from wrapper.server.generation import ServerLost

log = structlog.get_logger()

BuiltinFn = Callable[[], Awaitable[str | None]]
"""A built-in bound to the running wrapper; returns a one-line summary for the record."""


class ActionError(Exception):
    """One attempt of an action failed."""


class HookFailed(Exception):
    """An action failed (after its retries) and does not ignore errors."""

    def __init__(self, event: str, action: Action, error: str) -> None:
        super().__init__(f"{event}: action {action.name!r} ({action.where}) failed: {error}")
        self.event, self.action, self.error = event, action, error


@dataclass(frozen=True)
class HookRun:
    """The record of one action of one hook."""

    hook: str
    action: str
    kind: str
    outcome: str  # ok · failed · ignored · skipped
    duration_s: float
    attempts: int
    detail: str | None = None
    finished_at: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "hook": self.hook, "action": self.action, "kind": self.kind, "outcome": self.outcome,
            "duration_ms": round(self.duration_s * 1000, 1), "attempts": self.attempts, "detail": self.detail,
            "finished_at": self.finished_at,
        }


GUARD_EXIT_S = 0.2  # how long a guard whose program ended may take to exit before its hook counts as lingering
OUTPUT_HEAD = 20  # lines of a hook's output logged from its start ...
OUTPUT_TAIL = 20  # ... and from its end; what lies between is counted, not logged (as journald rate-limits)


class _Output:
    """One hook run's output in the log: its first and last lines, and how many between were dropped."""

    def __init__(self, event: str, action: str) -> None:
        self.event, self.action = event, action
        self.head_left = OUTPUT_HEAD
        self.tail: deque[str] = deque(maxlen=OUTPUT_TAIL)
        self.dropped = 0

    def line(self, line: str) -> None:
        if self.head_left:
            self.head_left -= 1
            log.info("hook.output", hook=self.event, action=self.action, line=line)
            return
        if len(self.tail) == OUTPUT_TAIL:
            self.dropped += 1
        self.tail.append(line)

    def close(self) -> None:
        if self.dropped:
            log.warning("hook.output_dropped", hook=self.event, action=self.action, dropped=self.dropped,
                        kept_first=OUTPUT_HEAD, kept_last=OUTPUT_TAIL)
        for line in self.tail:
            log.info("hook.output", hook=self.event, action=self.action, line=line)
        self.tail.clear()


class HookRunner:
    def __init__(self, session: aiohttp.ClientSession,
                 builtin: Callable[[str, Mapping[str, Any]], BuiltinFn]) -> None:
        self._session = session
        self._builtin = builtin
        self.history: deque[HookRun] = deque(maxlen=50)
        self._lingering: set[Child] = set()

    async def end_leftovers(self, timeout: float = 2.0) -> int:
        """At the wrapper's stop: end every job a hook left running; returns how many hooks had some."""
        lingering = [process for process in self._lingering if process.lingering]
        self._lingering.clear()
        for process in lingering:
            process.end_leftovers()
        if lingering:
            await asyncio.wait([asyncio.ensure_future(p.gone()) for p in lingering], timeout=timeout)
        return len(lingering)

    async def run(self, event: str, actions: tuple[Action, ...], context: dict[str, Any]) -> None:
        """Run a hook's actions in order; raise HookFailed at the first failure that is not ignored."""
        for action in actions:
            record = await self._run_action(event, action, context)
            self.history.append(record)
            METRICS.hook_runs.labels(hook=event, outcome=record.outcome).inc()
            METRICS.hook_seconds.labels(hook=event).observe(record.duration_s)
            fields = record.as_dict()
            fields.pop("finished_at")
            logger = log.warning if record.outcome in ("failed", "ignored") else log.info
            logger("hook.run", **fields, where=action.where)
            if record.outcome == "failed":
                raise HookFailed(event, action, record.detail or "failed")

    async def _run_action(self, event: str, action: Action, context: dict[str, Any]) -> HookRun:
        started = time.monotonic()
        attempts = 0

        def record(outcome: str, detail: str | None) -> HookRun:
            return HookRun(event, action.name, action.kind, outcome, time.monotonic() - started,
                           attempts, detail, time.time())

        try:
            if action.when is not None and not template.evaluate(action.when, context):
                return record("skipped", f"when {action.when!r} is false")
            retrying = AsyncRetrying(
                stop=stop_after_attempt(action.retries + 1),
                wait=wait_exponential(multiplier=0.5, max=10),
                retry=retry_if_exception_type(ActionError),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    detail = await self._attempt(event, action, context)
            return record("ok", detail)
        except (ActionError, template.TemplateError) as exc:
            return record("ignored" if action.ignore_errors else "failed", str(exc))
        except ServerLost as exc:  # not the action's failure: the supervisor starts llama-server again
            lost = record("failed", str(exc))
            self.history.append(lost)
            log.warning("hook.run", **{k: v for k, v in lost.as_dict().items() if k != "finished_at"},
                        where=action.where)
            raise
        except Exception as exc:  # a bug in a built-in must not take the stop sequence down with it
            log.exception("hook.internal_error", hook=event, action=action.name)
            return record("ignored" if action.ignore_errors else "failed", f"internal error: {exc!r}")

    async def _attempt(self, event: str, action: Action, context: dict[str, Any]) -> str | None:
        try:
            async with asyncio.timeout(action.timeout):
                if action.kind == "http":
                    return await self._http(action, context)
                if action.kind == "builtin":
                    options = template.render_data(action.options, context)
                    return await self._builtin(action.builtin, options)()
                if action.kind == "shell":
                    argv = ["/bin/sh", "-c", template.render_shell(action.shell or "", context)]
                else:
                    argv = [template.render(part, context) for part in action.exec]
                return await self._process(event, action, argv, context)
        except TimeoutError as exc:
            raise ActionError(f"timed out after {action.timeout:g}s") from exc

    async def _http(self, action: Action, context: dict[str, Any]) -> str:
        request = action.http
        assert request is not None
        url = template.render(request.url, context)
        headers = {k: template.render(v, context) for k, v in request.headers.items()}
        kwargs: dict[str, Any] = {"headers": headers}
        if request.json is not None:
            kwargs["json"] = template.render_data(request.json, context)
        elif request.body is not None:
            kwargs["data"] = template.render(request.body, context).encode()
        try:
            async with self._session.request(request.method, url, **kwargs) as reply:
                text = await reply.text(errors="replace")
        except aiohttp.ClientError as exc:
            raise ActionError(f"{request.method} {url}: {exc}") from exc
        wanted = reply.status in request.expect if request.expect else 200 <= reply.status < 300
        if not wanted:
            raise ActionError(f"{request.method} {url}: HTTP {reply.status}: {text[:200]}")
        return f"HTTP {reply.status}"

    async def _process(self, event: str, action: Action, argv: list[str], context: dict[str, Any]) -> str:
        env = {**os.environ, **environment(context)}
        output = _Output(event, action.name)
        try:
            return await self._run_process(action, argv, env, output.line)
        finally:
            output.close()

    async def _run_process(self, action: Action, argv: list[str], env: dict[str, str],
                           on_line: Callable[[str], None]) -> str:
        try:
            # Guarded: its background jobs end with it (setsid escapes on purpose), and never outlive us.
            process = await spawn(argv, env, on_line, guard=True)
        except OSError as exc:
            raise ActionError(f"cannot start {argv[0]!r}: {exc.strerror}") from exc
        try:
            finished = await process.wait()
        except asyncio.CancelledError:  # timed out or a forced stop: the program and all it started go, at once
            process.kill()
            await asyncio.shield(process.wait())
            raise
        if process.lingering:  # its guard may still be on its way out: a moment to go before it counts
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.gone(), GUARD_EXIT_S)
        if process.lingering:  # it left jobs running: they may, until the wrapper stops
            self._lingering.add(process)
        if finished.returncode != 0:
            how = f"signal {finished.signal_name}" if finished.signal else f"exit status {finished.code}"
            last = f": {process.tail[-1]}" if process.tail else ""
            raise ActionError(f"{argv[0]} ended with {how}{last}")
        return "exit status 0"
