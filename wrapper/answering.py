"""One request read whole, through what may interrupt its answer, so that the client gets one answer:

- a context overflow (with a built-in's `Growth`, degrade's): refused for a prompt longer than the context, the
  context is grown and the request sent again; an answer cut by a full context goes on after a growth
  (`degrade.continue`), in the same stream or as one JSON answer;
- llama-server lost under it (a crash, or a hang the watchdog ended) and started again: a request not yet
  answered is sent again to the new server; a stream under way goes on from the text its client has (the
  partial answer as an assistant prefix, or appended to a /completion prompt), with one pause and one final
  event. A request is sent again at most once per loss; one that was in flight at two losses gets a 502 that
  says so and is not sent a third time (a prompt that kills the server).

- a stream handed over by a reload (wrapper/reloader.py): cut while the new server takes over, it goes on there
  as after a loss, without counting as one;
- a background request paused for an interactive one (wrapper/seats.py): it goes on from the text generated so
  far, as after a loss, once `pauses.resume` has kept its state, waited for a slot and run the steps again for
  the request that goes on (which restore that state). One that asked for a JSON answer is sent as a stream and
  gathered (wrapper/gathered.py): llama-server stops only a stream whose client goes away.

The loop is an object whose only I/O is its `exchange` (one pass through the gate to llama-server: forward or
catch, wrapper/proxy.py), the growth's `grow`, and `lost` (was the server lost under the last pass, and is
another serving now); tests/unit/wrapper/test_answering.py drives it with all three scripted.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog
from aiohttp import web

from wrapper import paths
from wrapper.continuation import SoFar, continued, cut_by_context, greedy, merged
from wrapper.gathered import Gathered, whole_answer
from wrapper.generation import Host
from wrapper.proxy import Caught, Collected, Cut, Held, Wanted, broken_off, json_error, json_object
from wrapper.seats import Paused, Seat
from wrapper.serving import GONE_WHY, Loss
from wrapper.sse import Carry, Events, as_answer
from wrapper.steps import CannotGrow, Grown, Growth

log = structlog.get_logger()

OVERFLOW = "exceed_context_size_error"
POOL_FULL = "Context size has been exceeded."  # llama-server's 500 when the shared KV (-kvu) ran out
MAX_GROWTHS = 3
MAX_LOSSES = 2  # in flight at this many losses of the server: a prompt that kills it, not sent again

Exchange = Callable[[bytes, Wanted, Events | None, web.StreamResponse | None],
                    Awaitable[web.StreamResponse | Caught | Held | Cut | Paused]]
"""(the body to send, which whole answers to catch, the events filter, the client's response it continues)"""
Lost = Callable[[], Awaitable[Loss]]
"""After a Cut: whether llama-server was lost under it, and whether the wrapper will serve again (the next pass
waits at the gate for the new server)."""


class Pauses(Protocol):
    """A background request's pauses (wrapper/forwarding.py): its seat, the exchange that gathers a stream for a
    JSON answer, and the resume (keep, wait, steps again): the body to send, or why it cannot go on."""

    @property
    def seat(self) -> Seat: ...

    @property
    def request(self) -> web.BaseRequest: ...  # the client's, told in its stream when a paused answer cannot go on

    async def collect(self, body: bytes, wanted: Wanted, events: Events) -> web.StreamResponse | Caught | \
        Collected | Cut | Paused: ...

    async def resume(self, request: dict[str, Any], generated: int) -> bytes | str: ...


class AnswerLoop:
    def __init__(self, host: Host, growth: Growth | None, path: str, body: bytes, exchange: Exchange,
                 slot_context: Callable[[], int], lost: Lost | None = None, pauses: Pauses | None = None) -> None:
        self.host, self.growth, self.path, self.body = host, growth, path, body
        self.exchange, self.slot_context, self.lost, self.pauses = exchange, slot_context, lost, pauses
        self.original = json_object(body)
        config = host.current.config
        self.continuing = growth is not None and growth.continues(config) and self.original is not None \
            and path in paths.CONTINUABLE  # an answer cut by a full context goes on
        self.resumable = lost is not None and self.original is not None and path in paths.CONTINUABLE
        self.losses = 0
        self.gone = False  # the server was lost and is not started again

    async def run(self) -> web.StreamResponse:
        streamed = self.original is not None and self.original.get("stream") is True
        pausable = self.pauses is not None and self.original is not None and self.path in paths.CONTINUABLE
        if streamed and (self.continuing or self.resumable or pausable):
            return await self._streamed(self.original or {})
        if pausable:
            return await self._gathered(self.original or {})
        return await self._whole()

    def _watched(self, events: Events | None) -> None:
        """While a pass runs (`events`: its events), its seat may be paused, and sees how far it got and whether it
        can go on from there; between passes (None) it may not."""
        if self.pauses is None:
            return
        seat = self.pauses.seat
        if events is None:
            seat.pausable = False
            return
        seat.generated, seat.plain, seat.pausable = (lambda: events.tokens), (lambda: events.plain), True

    # -- a JSON answer (or a stream passed on as it comes) --------------------------------------------------------

    async def _whole(self) -> web.StreamResponse:
        """Sent again after each growth for an overflow, and after a loss of the server; an answer cut by a full
        context continued after a growth (when it may be), the parts merged into one answer."""
        request_now, sent = self.original or {}, self.body
        earlier: dict[str, Any] | None = None
        growths = 0
        while True:
            n_ctx = self.slot_context()
            result = await self.exchange(sent, self._wanted(request_now, n_ctx, earlier is not None), None, None)
            if isinstance(result, Cut):
                if result.response is None and await self._go_on_after(result):
                    continue  # the same request again, to the server started again
                return await self._told_after_loss(result)
            if isinstance(result, Paused):
                raise RuntimeError("a pass paused that no seat asked to pause")  # only _streamed, _gathered pause
            if not isinstance(result, Caught):
                return result.response if isinstance(result, Held) else result
            if result.status >= 400:
                refusal = await self._grown_for(result, request_now, growths)
                growths += 1
                if refusal is None:
                    continue
                return web.json_response(earlier) if earlier is not None else refusal  # a continuation: what came
            answer = merged(self.path, earlier, result.payload) if earlier is not None else result.payload
            cut = cut_by_context(self.path, request_now, result.payload, n_ctx)
            if cut is None or self.growth is None or growths >= MAX_GROWTHS:
                return web.json_response(answer)
            used, more = cut
            grown = await self.growth.grow(self.host, used + (more or self._headroom()), False)
            growths += 1
            if not isinstance(grown, Grown):
                log.info("degrade.continuation_refused", path=self.path,
                         why=grown.reason if isinstance(grown, CannotGrow) else "no plan to grow with")
                return web.json_response(answer)  # as llama-server cut it
            earlier, request_now = answer, continued(self.path, self.original or {}, answer)
            sent = json.dumps(request_now).encode()
            log.info("degrade.continue", path=self.path, used=used)

    def _wanted(self, asked: dict[str, Any], n_ctx: int, going_on: bool) -> Wanted:
        """The answers the loop looks at before the client does: an overflow (with a growth), and (continuing) an
        answer a full context cut, or any part of an answer already continued."""
        def wanted(payload: dict[str, Any], status: int) -> bool:
            if status >= 400:
                return self.growth is not None and overflowed(payload)
            return self.continuing and (going_on or cut_by_context(self.path, asked, payload, n_ctx) is not None)
        return wanted

    # -- an event stream ----------------------------------------------------------------------------------------

    async def _streamed(self, original: dict[str, Any]) -> web.StreamResponse:
        """Grown and sent again on an overflow (before any event); an answer cut by a full context (after a
        growth), by a lost server (once it is back) or by a pause (once it has a slot again) goes on in the same
        stream, its stop event held back while it may have to go on."""
        chat = self.path in paths.CHAT
        request_now, sent, so_far, skip, again = original, self.body, SoFar(chat), "", 0
        carry: Carry | None = None  # the earlier parts' id and counts, once it goes on after a pause or a loss
        answer_id: str | None = None
        response: web.StreamResponse | None = None
        held = b""  # the last events of the answer so far, sent when it cannot go on
        interrupted: web.BaseRequest | None = None  # the client's request, once a pass was cut or paused
        growths = 0
        while True:
            n_ctx = self.slot_context()
            events = Events(chat, skip=skip, continuing=response is not None, holds=self.continuing, again=again,
                            carry=carry)
            self._watched(events)
            result = await self.exchange(sent, lambda p, status: status >= 400 and self.growth is not None
                                         and overflowed(p), events, response)
            self._watched(None)
            if isinstance(result, Paused | Cut):
                if result.response is not None:
                    response = result.response
                interrupted = result.request if isinstance(result, Cut) else self._request()
                so_far.add(events.content)
                if isinstance(result, Cut) and not await self._go_on_after(result):
                    return await self._told_after_loss(result)
                answer_id = answer_id or events.id
                if response is not None or isinstance(result, Paused):  # the answer goes on from what the client has
                    request_now, skip, again = so_far.going_on(self.path, original, greedy(original))
                    carry = self._carry(answer_id, so_far, again, original)
                if isinstance(result, Cut):
                    sent = json.dumps(request_now).encode()
                    if response is not None:
                        log.info("wrapper.stream_resumed", path=self.path, chars=len(so_far.text),
                                 tokens=so_far.tokens, after="reload" if result.handed_over else "loss")
                    continue
                resumed = await self._resumed(request_now, so_far.tokens)
                if isinstance(resumed, bytes):
                    sent = resumed
                    continue
                if response is None:
                    return json_error(503, resumed, "unavailable_error")
                return await broken_off(result.request if isinstance(result, Cut) else self._request(), response,
                                        resumed)
            if isinstance(result, Caught):
                refusal = await self._grown_for(result, request_now, growths)
                growths += 1
                if refusal is None:
                    continue
                if response is None:
                    return refusal
                break  # a continuation that cannot go on: end the stream as it ended before
            if not isinstance(result, Held):
                if response is None or result is response:
                    return result
                if not held and interrupted is not None and isinstance(result, web.Response):
                    # it waited to go on (a loss, a hand-over, a pause) and was refused: the client is told why
                    why = (json_object(result.body if isinstance(result.body, bytes) else b"") or {}).get("error")
                    told = str((why or {}).get("message") or f"status {result.status}") if isinstance(why, dict) \
                        else f"status {result.status}"
                    return await broken_off(interrupted, response, told)
                break  # a refusal (held too long, stopping) after the stream began: end it as it ended before
            response, held = result.response, result.events.release()
            so_far.add(result.events.content)
            answer_id = answer_id or result.events.id
            final = result.events.final  # its counts are the whole answer's once carried, the part's before
            asked = original if carry is not None else request_now
            cut = cut_by_context(self.path, asked, as_answer(chat, final), n_ctx) if final is not None else None
            if cut is None or self.growth is None or growths >= MAX_GROWTHS:
                break
            used, more = cut
            grown = await self.growth.grow(self.host, used + (more or self._headroom()), False)
            growths += 1
            if not isinstance(grown, Grown):
                break
            request_now, skip, again = continued(self.path, original, so_far.shaped()), so_far.text if chat else "", 0
            carry = self._carry(answer_id, so_far, 0, original)
            sent = json.dumps(request_now).encode()
            log.info("degrade.continue", path=self.path, used=used, stream=True)
        if response is None:  # never reached: each pass either returns, goes on, or began the stream
            raise RuntimeError("a stream ended before it began")
        await response.write(held)
        await response.write_eof()
        return response

    def _carry(self, answer_id: str | None, so_far: SoFar, again: int, original: dict[str, Any]) -> Carry:
        """What the next part makes its counts and id from: the client's answer so far, the request's prompt."""
        prompt = original.get("prompt") if self.path not in paths.CHAT else None
        tokens = self.pauses.seat.prompt if self.pauses is not None and self.pauses.seat.prompt else None
        return Carry(answer_id, so_far.tokens, again, tokens, prompt if isinstance(prompt, str) else None)

    # -- a background request paused ----------------------------------------------------------------------------

    def _request(self) -> web.BaseRequest:
        assert self.pauses is not None  # only a pausable request's exchange is paused
        return self.pauses.request

    async def _resumed(self, request_now: dict[str, Any], generated: int) -> bytes | str:
        assert self.pauses is not None  # only a pausable request's exchange is paused
        return await self.pauses.resume(request_now, generated)

    async def _gathered(self, original: dict[str, Any]) -> web.StreamResponse:
        """A JSON answer asked for, sent as a stream and gathered: paused and resumed, grown for and continued
        after a full context (with a growth), gone on from after a loss, as a stream is — one answer at the end."""
        assert self.pauses is not None
        chat = self.path in paths.CHAT
        prompt = self.pauses.seat.prompt or None  # the request's own prompt, as the steps counted it
        request_now, sent, so_far, skip, again, growths = original, _as_stream(self.body), SoFar(chat), "", 0, 0
        first: dict[str, Any] | None = None  # the answer's first event: its id, created, model
        while True:
            n_ctx = self.slot_context()
            events = Gathered(chat, skip=skip, again=again)
            self._watched(events)
            result = await self.pauses.collect(sent, lambda p, status: status >= 400 and self.growth is not None
                                               and overflowed(p), events)
            self._watched(None)
            first = first or events.first
            if isinstance(result, Paused | Cut):
                so_far.add(events.content)
                if isinstance(result, Cut) and not await self._go_on_after(result):
                    return await self._told_after_loss(result)
                request_now, skip, again = so_far.going_on(self.path, original, greedy(original))
                if isinstance(result, Cut):
                    sent = _as_stream(json.dumps(request_now).encode())
                    continue
                resumed = await self._resumed(request_now, so_far.tokens)
                if isinstance(resumed, str):
                    return json_error(503, resumed, "unavailable_error")
                sent = _as_stream(resumed)
                continue
            if isinstance(result, Caught):
                refusal = await self._grown_for(result, request_now, growths)
                growths += 1
                if refusal is None:
                    continue
                return refusal
            if not isinstance(result, Collected):
                return result  # an answer that was not a stream (an error), passed on as it came
            so_far.add(events.content)
            final = events.final
            cut = cut_by_context(self.path, request_now, as_answer(chat, final), n_ctx) if final is not None else None
            if cut is not None and self.growth is not None and growths < MAX_GROWTHS:
                used, more = cut
                grown = await self.growth.grow(self.host, used + (more or self._headroom()), False)
                growths += 1
                if isinstance(grown, Grown):
                    request_now, skip, again = continued(self.path, original, so_far.shaped()), \
                        so_far.text if chat else "", 0
                    sent = _as_stream(json.dumps(request_now).encode())
                    log.info("degrade.continue", path=self.path, used=used)
                    continue
            events.first = first
            return web.json_response(whole_answer(chat, events, so_far.text, so_far.tokens, prompt, original))

    # -- a lost server --------------------------------------------------------------------------------------------

    async def _go_on_after(self, cut: Cut) -> bool:
        """Whether to send again (or go on) after a cut: the server was lost under it and another serves now, and
        this request was not in flight at MAX_LOSSES losses."""
        if self.lost is None:
            return False
        if cut.handed_over:  # a reload paused it: it goes on on the next server, not a loss
            return True
        loss = await self.lost()
        if loss is not Loss.BACK:
            self.gone = loss is Loss.GONE
            return False
        self.losses += 1
        if self.losses >= MAX_LOSSES:
            log.error("wrapper.request_given_up", path=self.path, losses=self.losses,
                      why="llama-server was lost twice while it served this request")
            return False
        log.warning("wrapper.request_again", path=self.path, started=cut.response is not None)
        return True

    async def _told_after_loss(self, cut: Cut) -> web.StreamResponse:
        """A 502 for a request whose answer had not begun; an error event in a stream that had (and the stream
        ends there)."""
        if self.losses >= MAX_LOSSES:
            return await cut.answer(f"llama-server was lost {self.losses} times while it served this request (a "
                                    "prompt that makes it crash or hang?): it is not sent again")
        return await cut.answer(GONE_WHY if self.gone else None)

    # -- growing --------------------------------------------------------------------------------------------------

    async def _grown_for(self, overflow: Caught, asked: dict[str, Any], growths: int) -> web.Response | None:
        """Grow the context for a refused request: None when it may be sent again, else the refusal for the client
        (llama-server's, its message saying why it could not grow)."""
        if self.growth is None or growths >= MAX_GROWTHS:  # it overflowed after every growth
            return web.json_response(overflow.payload, status=overflow.status)
        pool_full = overflow.payload["error"].get("message") == POOL_FULL
        needed = 0 if pool_full else prompt_and_limit(overflow.payload, asked, self._headroom())
        grown = await self.growth.grow(self.host, needed, pool_full)
        if isinstance(grown, Grown):
            log.info("degrade.retry", path=self.path, needed=needed)
            return None
        reason = grown.reason if isinstance(grown, CannotGrow) else ""
        log.info("degrade.overflow_refused", path=self.path, needed=needed, why=reason or "no plan to grow with")
        error = dict(overflow.payload["error"])
        if reason:
            error["message"] = f"{reason} ({error.get('message')})"
        return web.json_response({**overflow.payload, "error": error}, status=overflow.status)

    def _headroom(self) -> int:
        return self.growth.headroom(self.host.current.config) if self.growth is not None else 0


def _as_stream(body: bytes) -> bytes:
    """A request body asking for its answer as a stream (wrapper/gathered.py gathers it)."""
    payload = json_object(body) or {}
    payload["stream"] = True
    payload.pop("stream_options", None)
    return json.dumps(payload).encode()


def overflowed(payload: dict[str, Any]) -> bool:
    """llama-server's refusal of a prompt longer than a slot's context, or its 500 when the slots' shared KV
    ran out of cells while they filled it together."""
    error = payload.get("error")
    if not isinstance(error, dict):
        return False
    return (error.get("type") == OVERFLOW and isinstance(error.get("n_prompt_tokens"), int)) or \
        error.get("message") == POOL_FULL


def prompt_and_limit(payload: dict[str, Any], asked: dict[str, Any], headroom: int) -> int:
    """The prompt's tokens plus what the request may generate (its max_tokens, else the headroom)."""
    prompt = int(payload["error"]["n_prompt_tokens"])
    limit = next((asked[k] for k in ("max_completion_tokens", "max_tokens", "n_predict")
                  if isinstance(asked.get(k), int) and not isinstance(asked.get(k), bool) and asked[k] > 0), None)
    return prompt + (limit if limit is not None else headroom)
