"""One request's passes through the gate to llama-server, and the built-ins' steps that make what it sends.

A pass waits at the gate (held while the server starts, reloads, restarts or sleeps), goes to the generation that
serves then, counted in flight until it leaves; it comes to one `Pass` (wrapper/answers/proxy.py). A pass of a
background request that may be paused races its seat's pause (wrapper/queue/seats.py); one a reload hands over is cut
to go on on the next server. After a cut, `lost` says whether the server was lost under it; after a pause, `resume`
keeps what the slot holds, waits for a seat again and runs the steps again for the request that goes on.

The steps run on the server they talk to: a pass that would go to another server than the one its steps ran on (a
crash's restart, a reload's hand-over, a growth) runs them again there first, for the request it sends — so that
what a built-in learns of a slot (the conversation cache's book: its tokens, its conversation) is what that server's
slot holds, whichever way the answer went on."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from wrapper import built_ins
from wrapper.answers import calls
from wrapper.answers.calls import Written
from wrapper.answers.events import Events
from wrapper.answers.proxy import (
    STARTED,
    Catching,
    Outcome,
    Pass,
    Upstream,
    answered,
    broken_off,
    catch,
    collect,
    json_error,
    json_object,
)
from wrapper.answers.route import Shape
from wrapper.asked import Asked
from wrapper.metrics import METRICS
from wrapper.queue.gate import Admission
from wrapper.queue.seats import Seat
from wrapper.server.generation import Generation, Host
from wrapper.serving import GONE_WHY, Loss, Serving
from wrapper.steps import Before, Outgoing, Reply

log = structlog.get_logger()

RETRY_AFTER_S = "5"


class Passes:
    """One request's passes, the runs of its steps (one, and one more at each resume after a pause), and the
    generation the last pass went to (so that a cut pass can tell a lost server from a refusal)."""

    def __init__(self, request: web.Request, serving: Serving, host: Host, path: str, seat: Seat | None = None,
                 steps: tuple[Before, ...] = ()) -> None:
        self.request, self.serving, self.host, self.path = request, serving, host, path
        self.seat, self.steps = seat, steps
        self.runs: list[Outgoing] = []
        self.generation: Generation | None = None
        self.active = True  # it keeps the server awake (sleep.after); not what clients poll
        self.resumable = False  # its streams go on after a cut: a reload may hand them over (wrapper/queue/gate.py)
        self.pausable = False  # a background request whose passes its seat may pause
        self.asked = Asked(path)  # who asks and how (the route tells it once it knows), told to the steps each run
        self.stepped_on: Generation | None = None  # the generation the last run of the steps talked to
        self._why: str | None = None  # what a cut's client is told, when not that the server could not be reached
        self._asked_slot: Any = None  # the `id_slot` the client asked for itself (a later run may choose another)

    # -- the steps ------------------------------------------------------------------------------------------------

    async def stepped(self, out: Outgoing) -> web.Response | None:
        """Run the steps on `out` (it becomes what they make of it); a refusal or a step's Reply, else None. The
        steps talk to llama-server: only once the gate lets requests through (not counted in flight: a step may
        wait for a slot that a growth's drain would otherwise wait for in turn)."""
        if not self.runs and out.payload is not None:
            self._asked_slot = out.payload.get("id_slot")
        self.runs.append(out)
        if not self.steps:
            return None
        admission = await self.serving.gate.enter(counted=False)
        if admission is not Admission.ADMITTED:
            return refused(self.serving, admission, self.path)
        for step in self.steps:
            stepped = await step.run(self.host, out)
            if isinstance(stepped, Reply):
                return web.json_response(stepped.body, status=stepped.status, headers=dict(stepped.headers))
            out.body, out.payload = stepped.body, stepped.payload
            out.after, out.keep = stepped.after, stepped.keep
        self.stepped_on = self.serving.current
        return None

    def again(self, request_now: dict[str, Any]) -> Outgoing:
        """The request that goes on, for the steps to run on again: pinned only where the client pinned it (the
        earlier run's slot was the steps' choice on an earlier server, or before a pause)."""
        payload = dict(request_now)
        if self._asked_slot is None:
            payload.pop("id_slot", None)
        else:
            payload["id_slot"] = self._asked_slot
        return Outgoing("POST", self.path, json.dumps(payload).encode(), payload, self.asked,
                        use=self.seat.use if self.seat is not None else None)

    def _moved(self) -> bool:
        """The steps ran on a server that no longer serves."""
        return bool(self.steps) and self.stepped_on is not None and self.serving.current is not self.stepped_on

    async def _stepped_again(self, body: bytes) -> bytes | web.Response:
        """The steps again, on the server that serves now, for the request the next pass sends (`body`): what they
        make of it, or their refusal. The earlier runs are over (their slots let go on the server they ran on)."""
        payload = json_object(body)
        if payload is None:
            self.stepped_on = self.serving.current
            return body
        self.done(None)
        out = self.again(payload)
        refusal = await self.stepped(out)
        if refusal is not None:
            return refusal
        use = out.use
        log.info("wrapper.stepped_again", path=self.path, slot=use.slot if use is not None else None,
                 tokens=use.tokens if use is not None else None)
        return out.body

    def done(self, status: int | None) -> None:
        """The request is answered (`status`), or cut (None): each run's `after` is told."""
        for run in self.runs:
            for after in run.after:
                after(status)
            run.after.clear()

    # -- a pass ---------------------------------------------------------------------------------------------------

    async def send(self, body: bytes, shape: Shape, catching: Catching, events: Events | None,
                   going_on: web.StreamResponse | None) -> Pass:
        """The answer loop's pass, in `shape`: a whole answer `catching` caught, an event stream through `events`
        (gathered, never passed on, in the GATHERED shape)."""
        request, path = self.request, self.path
        resumable = None if events is None else (lambda: events.plain and events.final is None)
        while True:
            if shape is Shape.GATHERED:
                assert events is not None
                sender = functools.partial(_collected, request, catching, path, body, events)
            else:
                sender = functools.partial(_caught, request, catching, path, body, events, going_on)
            got = await self._sent(sender, events if self.pausable else None, resumable, restep=True)
            if got is not None:
                return got
            again = await self._stepped_again(body)
            if isinstance(again, web.Response):
                return answered(request, again)
            body = again

    async def through(self, send: Callable[[Upstream], Awaitable[Pass]], again: bool) -> web.StreamResponse:
        """One pass answered as it comes (see `once`); a cut the request does not go on from is told to its client."""
        got = await self.once(send, again)
        return await got.told(self._why) if got.outcome is Outcome.CUT else got.answered

    async def once(self, send: Callable[[Upstream], Awaitable[Pass]], again: bool) -> Pass:
        """One pass, and (`again`) once more to the server started again when the one it went to was lost under it
        before its answer began. A cut pass learns whether its server was lost, which says what its client is
        told."""
        got = await self._sent(send)
        assert got is not None
        if got.outcome is not Outcome.CUT or await self.lost() is not Loss.BACK or not again \
                or got.response is not None:
            return got
        log.warning("wrapper.request_again", path=self.path, started=False)
        got = await self._sent(send)
        assert got is not None
        return got

    async def lost(self) -> Loss:
        """After a cut pass: whether its server was lost, and whether another will serve (the next pass waits at
        the gate)."""
        if self.generation is None:
            return Loss.NONE
        loss = await self.serving.lost_under(self.generation)
        self._why = GONE_WHY if loss is Loss.GONE else None
        return loss

    async def _sent(self, send: Callable[[Upstream], Awaitable[Pass]], under_way: Events | None = None,
                    resumable: Callable[[], bool] | None = None, restep: bool = False) -> Pass | None:
        """One pass through the gate to what serves now: `send` there, counted in flight, cut by the stop's drain
        deadline; PAUSED when its seat is asked to pause while `under_way` (the pass's events: how far it got);
        CUT and handed over when a reload hands a `resumable` pass over to the next server. None, sending nothing,
        when `restep` and the steps ran on another server than the one that serves now (they run again first)."""
        serving, request, seat = self.serving, self.request, self.seat
        admission = await serving.gate.enter(active=self.active)
        if admission is not Admission.ADMITTED:
            return answered(request, refused(serving, admission, self.path))
        if restep and self._moved():
            serving.gate.leave()
            return None
        self.generation = serving.current
        to = Upstream(serving.current.launch.url, serving.session, built_ins.observer(serving.current),
                      serving.heard)
        exchange = asyncio.ensure_future(send(to))
        serving.gate.track(exchange, resumable if self.resumable else None)
        try:
            if seat is not None and under_way is not None and await self._paused(exchange, seat, under_way):
                return Pass(Outcome.PAUSED, request, request.get(STARTED))
            return await exchange  # cancelled with us when the client hangs up: llama-server then stops the work
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # we are cancelled ourselves (the client went away)
            started = request.get(STARTED)
            if serving.gate.handed_over(exchange):  # a reload hands it to the next server: the loop goes on there
                return Pass(Outcome.CUT, request, started, error="handed over to the reloaded llama-server",
                            handed_over=True)
            # Only the exchange was cut (the stop's drain deadline passed): tell the client, if it can still hear.
            log.warning("proxy.cut", method=request.method, path=self.path, mid_response=started is not None)
            if started is not None:
                return answered(request, await broken_off(request, started, "llama-wrapper is stopping: the answer "
                                                          "was cut at the drain deadline"))
            return answered(request, json_error(503, "llama-wrapper is stopping: the request was cut at the drain "
                                                "deadline", "unavailable_error", {"Retry-After": RETRY_AFTER_S},
                                                self.path))
        finally:
            serving.gate.leave(exchange)

    async def _paused(self, exchange: asyncio.Future[Any], seat: Seat, under_way: Events) -> bool:
        """Wait for the exchange, or for its seat to be asked to pause: then stop it (llama-server sees its stream's
        client go and stops the generation; the slot keeps what it computed) and say so. Meanwhile the seat may
        be asked: it sees how far the pass got."""
        seat.under_way = under_way
        self.serving.seats.changed()  # it may be the one to pause now
        asked = asyncio.ensure_future(seat.pause.wait())
        try:
            await asyncio.wait([exchange, asked], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client hung up: its exchange goes too (awaited, it would go by itself)
            exchange.cancel()
            raise
        finally:
            asked.cancel()
            seat.under_way = None
        if exchange.done():
            return False
        exchange.cancel()
        await asyncio.wait([exchange])
        return exchange.cancelled()

    async def written(self, name: str, text: str, arguments: str, generated: int | None) -> Written | None:
        """An answer so far with a call under way, as the template serving now writes it (wrapper/answers/calls.py):
        asked of the server once the gate lets requests through (the one started again after a loss)."""
        if await self.serving.gate.enter(counted=False) is not Admission.ADMITTED:
            return None
        return await calls.written(self.serving.current.client, name, text, arguments, generated)

    # -- a pause --------------------------------------------------------------------------------------------------

    async def resume(self, request_now: dict[str, Any], generated: int) -> bytes | str:
        """After a pause: keep what the slot holds, give the seat up, wait for one again (ahead of later background
        requests), and run the steps for `request_now` (which goes on from what was generated): the body to send,
        or why the request cannot go on."""
        serving, seat, path = self.serving, self.seat, self.path
        assert seat is not None
        run = self.runs[-1]
        kept = 0
        for keep in run.keep:
            kept = max(kept, await keep())
        self.done(None)
        seat.use.pauses += 1
        serving.seats.paused += 1
        METRICS.paused.inc()
        paused_at = time.monotonic()
        log.info("priority.paused", path=path, session=seat.asked.session, slot=seat.use.slot, tokens=kept,
                 generated=generated,
                 pauses=seat.pauses, took_s=round(paused_at - (seat.asked_at or paused_at), 3))
        serving.seats.leave(seat)
        try:
            await serving.seats.take(seat)
        except asyncio.CancelledError:  # its client hung up while it waited: its state stays in the store
            serving.seats.gone += 1
            log.info("priority.gone", path=path, pauses=seat.pauses, pause_s=round(time.monotonic() - paused_at, 3))
            raise
        out = self.again(request_now)
        refusal = await self.stepped(out)
        pause_s = round(time.monotonic() - paused_at, 3)
        if refusal is not None:
            why = json_object(refusal.body if isinstance(refusal.body, bytes) else b"") or {}
            message = str((why.get("error") or {}).get("message") or f"status {refusal.status}")
            log.warning("priority.not_resumed", path=path, pause_s=pause_s, why=message)
            return f"this answer was paused for an interactive request and cannot go on: {message}"
        serving.seats.resumed += 1
        METRICS.resumed.inc()
        log.info("priority.resumed", path=path, session=seat.asked.session, slot=seat.use.slot, tokens=seat.use.tokens,
                 pause_s=pause_s)
        return out.body


def _collected(request: web.Request, catching: Catching, path: str, body: bytes, events: Events,
               to: Upstream) -> Awaitable[Pass]:
    return collect(request, to, catching, path, body, events)


def _caught(request: web.Request, catching: Catching, path: str, body: bytes, events: Events | None,
            going_on: web.StreamResponse | None, to: Upstream) -> Awaitable[Pass]:
    return catch(request, to, catching, path, body, events, going_on)


def refused(serving: Serving, admission: Admission, path: str) -> web.Response:
    """The gate's refusal, for the client (in its API's shape): asleep and not woken, held too long, or stopping."""
    if admission is Admission.NOT_WOKEN:
        why = f"llama-wrapper is asleep and could not wake llama-server: {serving.gate.wake_failed}"
    elif admission is Admission.TIMED_OUT:
        why = (f"llama-wrapper is {serving.state} and held this request for reload.hold_timeout "
               f"({serving.current.config.reload_hold_timeout:g}s)")
    else:
        why = f"llama-wrapper is {serving.state}"
    return json_error(503, why, "unavailable_error", {"Retry-After": RETRY_AFTER_S}, path)
