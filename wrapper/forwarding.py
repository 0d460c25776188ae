"""The path of a proxied request to llama-server: the steps built-ins declare before it is forwarded, one pass
through the gate, and what happens when llama-server answers a context overflow (wrapper/growing.py: a
built-in grows the context and the request is sent again; an answer cut by a full context goes on after a
growth, streamed or not).

The listener (wrapper/listener.py) calls `forward_request` and keeps only the HTTP face.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, overload

import structlog
from aiohttp import web

from wrapper import argv as args
from wrapper import built_ins, paths, priority
from wrapper.answering import AnswerLoop
from wrapper.gate import Admission
from wrapper.generation import Generation, Host
from wrapper.lifecycle import State
from wrapper.metrics import METRICS
from wrapper.proxy import (
    STARTED,
    Caught,
    Collected,
    Cut,
    Held,
    Upstream,
    Wanted,
    broken_off,
    catch,
    collect,
    forward,
    json_error,
    json_object,
)
from wrapper.seats import Paused, Seat
from wrapper.sections import PRIORITY, WATCHDOG
from wrapper.serving import GONE_WHY, Loss, Serving
from wrapper.sleeping import ANSWERED_ASLEEP
from wrapper.sse import Events
from wrapper.steps import Before, Outgoing, Reply, Shown

log = structlog.get_logger()

RETRY_AFTER_S = "5"
BODY_LIMIT = 32 << 20  # a request read whole (for a step, or to be sent again after a growth)
R = TypeVar("R", bound=web.StreamResponse | Caught | Held | Collected | Cut)


async def forward_request(request: web.Request, serving: Serving, host: Host, path: str) -> web.StreamResponse:
    """Forward one request: as a stream, or read whole when a step, a growth, a lost server or a pause may need it
    again. A request that decodes waits for a seat first (wrapper/seats.py: interactive ones go first)."""
    generation = serving.current
    passes = _Passes(request, serving, host, path)
    if request.method == "GET" and path in ANSWERED_ASLEEP:
        passes.active = False  # what clients poll does not keep the server awake
        remembered = serving.remembered.get(path)
        if serving.state in (State.SLEEPING, State.ASLEEP, State.WAKING) and remembered is not None:
            return _remembered(serving, path, remembered.payload)
    if request.method == "GET" and (rewrites := built_ins.shown(generation, path)):
        return await _shown(passes, path, rewrites)
    growth = built_ins.growth(generation) if path in paths.GENERATING else None
    steps = [step for step in built_ins.before(generation) if path in step.paths]
    watched = WATCHDOG.of(generation.config).enabled  # a request in flight goes on after a restart: kept whole
    seated = request.method == "POST" and path in paths.SEATED
    if request.method != "POST" or (growth is None and not steps and not watched and not seated) or \
            (request.content_length or 0) > BODY_LIMIT:  # a body streamed through cannot be sent again
        again = watched and request.method in ("GET", "HEAD")
        async with _seated(serving, _seat(serving, request, None, path) if seated else None):
            return await passes.through(lambda to: forward(request, to, path), again)
    body = await _read_whole(request, BODY_LIMIT)
    if body is None:
        return json_error(413, f"a completion request of more than {BODY_LIMIT >> 20} MiB", "invalid_request_error")
    payload = json_object(body)
    seat = _seat(serving, request, payload, path) if seated else None
    if payload is not None and priority.unsaid(payload):
        body = json.dumps(payload).encode()
    async with _seated(serving, seat):
        outgoing = Outgoing(request.method, path, body, payload, seat=seat)
        runs = [outgoing]  # the steps' runs: one, and one more at each resume after a pause
        status: int | None = None
        try:
            refusal = await _stepped(serving, host, steps, outgoing)
            if refusal is not None:
                status = refusal.status
                return refusal
            sent = outgoing.body
            pauses = _Pauses(passes, steps, runs) if _pausable(serving, outgoing) else None
            if growth is None and not watched and pauses is None:
                result = await passes.through(lambda to: forward(request, to, path, sent), False)
            else:
                passes.resumable = watched and payload is not None and _goes_on(path, payload)
                result = await AnswerLoop(host, growth, path, sent, passes.exchange,
                                          lambda: _slot_ctx(serving.current), passes.lost if watched else None,
                                          pauses).run()
            status = result.status
            return result
        finally:  # also when the client hung up: a step's reservation must not outlive its request
            for run in runs:
                for done in run.after:
                    done(status)


async def _stepped(serving: Serving, host: Host, steps: list[Before], outgoing: Outgoing) -> web.Response | None:
    """Run the steps on `outgoing` (it becomes what they make of it); a refusal or a step's Reply, else None. The
    steps talk to llama-server: only once the gate lets requests through (not counted in flight: a step may wait
    for a slot that a growth's drain would otherwise wait for in turn)."""
    if not steps:
        return None
    admission = await serving.gate.enter(counted=False)
    if admission is not Admission.ADMITTED:
        return _refused(serving, admission)
    for step in steps:
        stepped = await step.run(host, outgoing)
        if isinstance(stepped, Reply):
            return web.json_response(stepped.body, status=stepped.status, headers=dict(stepped.headers))
        outgoing.body, outgoing.payload = stepped.body, stepped.payload
        outgoing.after, outgoing.keep = stepped.after, stepped.keep
    return None


def _seat(serving: Serving, request: web.Request, payload: dict[str, Any] | None, path: str) -> Seat:
    """The request's place in the slots' queue, its class from its header, its body and its key (the queue set for
    the server that serves now)."""
    settings = PRIORITY.of(serving.queue().config)
    klass = priority.classify(request.headers, payload, settings)
    for mark in priority.odd_marks(request.headers, payload):
        if mark not in _ODD_SEEN and len(_ODD_SEEN) < 64:  # once each: a client sends it with every request
            _ODD_SEEN.add(mark)
            log.warning("priority.unknown_mark", mark=mark, read_as=klass.value,
                        hint="X-Priority: background or interactive; service_tier: flex (background) or priority")
    return Seat(klass, path)


_ODD_SEEN: set[str] = set()


def _pausable(serving: Serving, outgoing: Outgoing) -> bool:
    """A background request the answer loop can pause and resume: a step keeps what its slot holds, and its
    answer can be continued (chat, /completion) — not one that asks for tools (a tool call has no prefix to go on
    from), for several choices, or for a JSON answer with token probabilities (a gathered stream has none)."""
    seat, payload = outgoing.seat, outgoing.payload
    if seat is None or seat.klass is not priority.Class.BACKGROUND or not serving.seats.preempt \
            or not outgoing.keep or payload is None or not _goes_on(outgoing.path, payload):
        return False
    whole = payload.get("stream") is not True
    return not (whole and (payload.get("logprobs") or payload.get("n_probs")))


def _goes_on(path: str, payload: dict[str, Any]) -> bool:
    """An answer that can go on from its text so far (an assistant prefix, or the prompt appended to): chat or
    /completion, no tools (a tool call has no prefix to go on from), one choice."""
    return path in paths.CONTINUABLE and not payload.get("tools") and payload.get("n") in (None, 1)


@contextlib.asynccontextmanager
async def _seated(serving: Serving, seat: Seat | None) -> AsyncIterator[None]:
    """Hold a seat while the request is served (none: not one that decodes)."""
    if seat is None:
        yield
        return
    await serving.seats.take(seat)
    try:
        yield
    finally:
        serving.seats.leave(seat)


class _Pauses:
    """A background request's pauses: its exchange gathered when it asked for one JSON answer, what is kept at a
    pause, the wait for a seat again, the steps run again for the request that goes on."""

    def __init__(self, passes: _Passes, steps: list[Before], runs: list[Outgoing]) -> None:
        self.passes, self.steps, self.runs = passes, steps, runs
        seat = runs[0].seat
        assert seat is not None
        self.seat, self.request = seat, passes.request
        passes.seat = seat

    async def collect(self, body: bytes, wanted: Wanted, events: Events) -> web.StreamResponse | Caught | \
            Collected | Cut | Paused:
        request, path = self.passes.request, self.passes.path
        return await self.passes.send(lambda to: collect(request, to, wanted, path, body, events), self.seat)

    async def resume(self, request_now: dict[str, Any], generated: int) -> bytes | str:
        """Keep what the slot holds, give the seat up, wait for one again (ahead of later background requests),
        and run the steps for `request_now` (which goes on from what was generated): the body to send, or why
        the request cannot go on."""
        serving, seat, path = self.passes.serving, self.seat, self.passes.path
        run = self.runs[-1]
        kept = 0
        for keep in run.keep:
            kept = max(kept, await keep())
        for done in run.after:
            done(None)
        run.after.clear()
        seat.pauses += 1
        serving.seats.paused += 1
        METRICS.paused.inc()
        paused_at = time.monotonic()
        log.info("priority.paused", path=path, slot=seat.slot, tokens=kept, generated=generated, pauses=seat.pauses,
                 took_s=round(paused_at - (seat.asked_at or paused_at), 3))
        serving.seats.leave(seat)
        try:
            await serving.seats.take(seat)
        except asyncio.CancelledError:  # its client hung up while it waited: its state stays in the store
            serving.seats.gone += 1
            log.info("priority.gone", path=path, pauses=seat.pauses, pause_s=round(time.monotonic() - paused_at, 3))
            raise
        out = Outgoing("POST", path, json.dumps(request_now).encode(), request_now, seat=seat)
        self.runs.append(out)
        refusal = await _stepped(serving, self.passes.host, self.steps, out)
        pause_s = round(time.monotonic() - paused_at, 3)
        if refusal is not None:
            why = json_object(refusal.body if isinstance(refusal.body, bytes) else b"") or {}
            message = str((why.get("error") or {}).get("message") or f"status {refusal.status}")
            log.warning("priority.not_resumed", path=path, pause_s=pause_s, why=message)
            return f"this answer was paused for an interactive request and cannot go on: {message}"
        serving.seats.resumed += 1
        METRICS.resumed.inc()
        log.info("priority.resumed", path=path, slot=seat.slot, tokens=seat.tokens, pause_s=pause_s)
        return out.body


async def _shown(passes: _Passes, path: str, rewrites: list[Shown]) -> web.StreamResponse:
    """llama-server's answer to a GET, rewritten by the built-ins that say what clients are told of it."""
    def answered(payload: dict[str, Any], status: int) -> bool:
        return status == 200

    serving, request = passes.serving, passes.request
    again = WATCHDOG.of(serving.current.config).enabled
    result = await passes.caught(lambda to: catch(request, to, answered, path), again)
    if not isinstance(result, Caught):
        return result
    answer = result.payload
    for rewrite in rewrites:
        answer = rewrite.rewrite(serving.current, path, answer)
    headers = {k: v for k, v in result.headers.items() if k.lower() not in ("content-length", "content-type")}
    return web.json_response(answer, status=result.status, headers=headers)  # CORS and the rest as they were


def _remembered(serving: Serving, path: str, answer: Any) -> web.Response:
    """While asleep: what llama-server answered this GET before the sleep, as the built-ins rewrite it now."""
    if isinstance(answer, dict):
        for rewrite in built_ins.shown(serving.current, path):
            answer = rewrite.rewrite(serving.current, path, answer)
    return web.json_response(answer)


async def _read_whole(request: web.Request, limit: int) -> bytes | None:
    """The request body (kept to be sent again after a growth); None when it is longer than `limit`."""
    parts: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            return None
    return b"".join(parts)


class _Passes:
    """One request's passes through the gate to llama-server, and the generation the last one went to (so that a
    cut pass can tell a lost server from a refusal)."""

    def __init__(self, request: web.Request, serving: Serving, host: Host, path: str) -> None:
        self.request, self.serving, self.host, self.path = request, serving, host, path
        self.generation: Generation | None = None
        self.seat: Seat | None = None  # a background request's, while the answer loop may pause it
        self.active = True  # it keeps the server awake (sleep.after); not what clients poll
        self.resumable = False  # its streamed passes go on after a cut (the answer loop with `lost`): a reload may
        # hand them over to the next server (wrapper/gate.py)
        self._why: str | None = None  # what a cut's client is told, when not that the server could not be reached

    async def through(self, send: Callable[[Upstream], Awaitable[web.StreamResponse | Cut]],
                      again: bool) -> web.StreamResponse:
        """One pass streamed through (`again`: once more when llama-server was lost under it before its answer
        began); a cut the request does not go on from is told to its client."""
        result = await self._passed(send, again)
        return await result.answer(self._why) if isinstance(result, Cut) else result

    async def caught(self, send: Callable[[Upstream], Awaitable[web.StreamResponse | Caught | Held | Cut]],
                     again: bool) -> web.StreamResponse | Caught:
        """As `through`, for a pass that may catch a whole answer (without an events filter: nothing is held)."""
        result = await self._passed(send, again)
        if isinstance(result, Cut):
            return await result.answer(self._why)
        return result.response if isinstance(result, Held) else result

    async def exchange(self, body: bytes, wanted: Wanted, events: Events | None,
                       going_on: web.StreamResponse | None) -> web.StreamResponse | Caught | Held | Cut | Paused:
        """The answer loop's pass: a whole answer it wants caught, an event stream through `events`."""
        request, path = self.request, self.path
        sender = lambda to: catch(request, to, wanted, path, body, events, going_on)  # noqa: E731
        resumable = None if events is None else (lambda: events.plain and events.final is None)
        return await self.send(sender, self.seat, resumable)

    async def lost(self) -> Loss:
        """After a cut pass: whether its server was lost, and whether another will serve (the next pass waits at
        the gate)."""
        if self.generation is None:
            return Loss.NONE
        loss = await self.serving.lost_under(self.generation)
        self._why = GONE_WHY if loss is Loss.GONE else None
        return loss

    async def _passed(self, send: Callable[[Upstream], Awaitable[R]], again: bool) -> R | web.StreamResponse | Cut:
        """One pass, and (`again`) once more to the server started again when the one it went to was lost under it
        before its answer began. A cut pass learns whether its server was lost, which says what its client is
        told."""
        result = await self.send(send)
        if not isinstance(result, Cut) or await self.lost() is not Loss.BACK or not again \
                or result.response is not None:
            return result
        log.warning("wrapper.request_again", path=self.path, started=False)
        return await self.send(send)

    @overload
    async def send(self, send: Callable[[Upstream], Awaitable[R]]) -> R | web.StreamResponse | Cut: ...

    @overload
    async def send(self, send: Callable[[Upstream], Awaitable[R]], seat: Seat | None,
                   resumable: Callable[[], bool] | None = None) -> R | web.StreamResponse | Cut | Paused: ...

    async def send(self, send: Callable[[Upstream], Awaitable[R]], seat: Seat | None = None,
                   resumable: Callable[[], bool] | None = None) -> R | web.StreamResponse | Cut | Paused:
        """One pass through the gate to what serves now: `send` there, counted in flight, cut by the stop's drain
        deadline; stopped and Paused when `seat` (pausable now) is asked to pause; a Cut that goes on when a
        reload hands a `resumable` pass (of a request the answer loop continues) over to the next server."""
        serving, request = self.serving, self.request
        admission = await serving.gate.enter(active=self.active)
        if admission is not Admission.ADMITTED:
            return _refused(serving, admission)
        self.generation = serving.current
        to = Upstream(serving.current.launch.url, serving.session, built_ins.observer(serving.current),
                      serving.heard)
        exchange = asyncio.ensure_future(send(to))
        serving.gate.track(exchange, resumable if self.resumable else None)
        try:
            if seat is not None and seat.pausable and await self._paused(exchange, seat):
                return Paused(request.get(STARTED))
            return await exchange  # cancelled with us when the client hangs up: llama-server then stops the work
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # we are cancelled ourselves (the client went away)
            started = request.get(STARTED)
            if serving.gate.handed_over(exchange):  # a reload hands it to the next server: the loop goes on there
                return Cut("handed over to the reloaded llama-server", request, started, handed_over=True)
            # Only the exchange was cut (the stop's drain deadline passed): tell the client, if it can still hear.
            log.warning("proxy.cut", method=request.method, path=self.path, mid_response=started is not None)
            if started is not None:
                return await broken_off(request, started, "llama-wrapper is stopping: the answer was cut at the "
                                        "drain deadline")
            return json_error(503, "llama-wrapper is stopping: the request was cut at the drain deadline",
                              "unavailable_error", {"Retry-After": RETRY_AFTER_S})
        finally:
            serving.gate.leave(exchange)
            if seat is not None:
                seat.pausable = False


    async def _paused(self, exchange: asyncio.Future[Any], seat: Seat) -> bool:
        """Wait for the exchange, or for its seat to be asked to pause: then stop it (llama-server sees its stream's
        client go and stops the generation; the slot keeps what it computed) and say so."""
        self.serving.seats.changed()  # it may be the one to pause now
        asked = asyncio.ensure_future(seat.pause.wait())
        try:
            await asyncio.wait([exchange, asked], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client hung up: its exchange goes too (awaited, it would go by itself)
            exchange.cancel()
            raise
        finally:
            asked.cancel()
        if exchange.done():
            return False
        exchange.cancel()
        await asyncio.wait([exchange])
        return exchange.cancelled()


def _refused(serving: Serving, admission: Admission) -> web.Response:
    if admission is Admission.NOT_WOKEN:
        return json_error(503, f"llama-wrapper is asleep and could not wake llama-server: {serving.gate.wake_failed}",
                          "unavailable_error", {"Retry-After": RETRY_AFTER_S})
    if admission is Admission.TIMED_OUT:
        return json_error(503, f"llama-wrapper is {serving.lifecycle.state} and held this request for "
                          f"reload.hold_timeout ({serving.current.config.reload_hold_timeout:g}s)", "unavailable_error",
                          {"Retry-After": RETRY_AFTER_S})
    return json_error(503, f"llama-wrapper is {serving.lifecycle.state}", "unavailable_error",
                      {"Retry-After": RETRY_AFTER_S})


def _slot_ctx(generation: Generation) -> int:
    """The context one slot has: as the server said at its start, else -c, or -c / -np when every slot has its
    own KV (no -kvu)."""
    if generation.context is not None:
        return generation.context.slot
    argv = generation.launch.argv
    n_ctx = int(args.get(argv, args.CTX_SIZE) or 0)
    parallel = max(1, int(args.get(argv, args.PARALLEL) or 1))
    return n_ctx if args.last_of(argv, args.KV_UNIFIED, args.NO_KV_UNIFIED) else n_ctx // parallel


