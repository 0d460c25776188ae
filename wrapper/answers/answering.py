"""One request read whole, through what may interrupt its answer, so that the client gets one answer — one loop, one
pass at a time, reading top to bottom:

1. a pass to llama-server (wrapper/answers/passes.py), its events read in the answer's shape
   (wrapper/answers/answer.py);
2. cut (a crash, a hang the watchdog ended, a reload's hand-over) or paused (a background request, for an
   interactive one): it goes on from what its client has — a request not yet answered is sent again; a stream
   under way goes on from its text (the partial answer as an assistant prefix, or appended to a /completion
   prompt) with one pause and one final event; a paused one first keeps its state and waits for a seat again.
   A request in flight at MAX_LOSSES losses of the server is not sent again (a prompt that kills it);
3. refused for a prompt longer than the context (with a built-in's `Growth`, degrade's): the context is grown
   and the request sent again;
4. an answer: when a full context cut it (and the growth continues such answers), the context is grown and the
   answer goes on; otherwise it is the client's.

The loop's only I/O is its passes (send, lost, resume) and the growth's `grow`; tests/unit/wrapper/test_answering.py
drives it with both scripted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import structlog
from aiohttp import web

from wrapper.answers.answer import Answer
from wrapper.answers.apis.api import Api
from wrapper.answers.calls import Written
from wrapper.answers.continuation import repeatable
from wrapper.answers.events import Events
from wrapper.answers.proxy import Catching, Outcome, Pass
from wrapper.answers.route import Shape
from wrapper.configuration.sections import WATCHDOG
from wrapper.server.generation import Host
from wrapper.serving import GONE_WHY, Loss
from wrapper.steps import CannotGrow, Grown, Growth, limit

log = structlog.get_logger()

OVERFLOW = "exceed_context_size_error"
POOL_FULL = "Context size has been exceeded."  # llama-server's 500 when the shared KV (-kvu) ran out
MAX_GROWTHS = 3
MAX_LOSSES = 2  # in flight at this many losses of the server: a prompt that kills it, not sent again


class Passing(Protocol):
    """A request's passes to llama-server (wrapper/answers/passes.py)."""

    async def send(self, body: bytes, shape: Shape, catching: Catching, events: Events | None,
                   going_on: web.StreamResponse | None) -> Pass:
        """One pass: `body` sent, its answer read in `shape` (through `events`), `going_on` the client's response
        it continues."""
        ...

    async def lost(self) -> Loss:
        """After a cut: whether the server was lost under it, and whether the wrapper will serve again (the next
        pass waits at the gate for the new server)."""
        ...

    async def resume(self, request: dict[str, Any], generated: int) -> bytes | str:
        """After a pause: the body to send once it may go on, or why it cannot."""
        ...

    async def written(self, name: str, text: str, arguments: str, generated: int | None) -> Written | None:
        """After a cut: an answer's `text` and a call to `name` with its `arguments` so far, as the model wrote them
        (`generated` tokens, when llama-server counted them) in the markup of the template serving now
        (wrapper/answers/calls.py); None when it cannot tell."""
        ...


class AnswerLoop:
    def __init__(self, host: Host, growth: Growth | None, api: Api, path: str, body: bytes, passes: Passing,
                 slot_context: Callable[[], int], shape: Shape, watched: bool = False,
                 prompt_tokens: int | None = None) -> None:
        """`api`: the API the request speaks; `watched`: a lost server is looked for after a cut (the watchdog is
        on); `prompt_tokens`: the request's own prompt, as the steps counted it."""
        self.host, self.growth, self.path, self.passes = host, growth, path, passes
        self.slot_context, self.watched = slot_context, watched
        self.answer = Answer(api, shape, body, prompt_tokens)
        self.continuing = growth is not None and growth.continues(host.current.config) \
            and self.answer.json and api.growable  # an answer a full context cut goes on
        self.losses = 0
        self.gone = False  # the server was lost and is not started again

    async def run(self) -> web.StreamResponse:
        answer, growths = self.answer, 0
        while True:
            n_ctx = self.slot_context()
            events = answer.events(holds=self.continuing)
            got = await self.passes.send(answer.sent, answer.shape, self._catching(n_ctx), events, answer.response)
            if got.outcome in (Outcome.CUT, Outcome.PAUSED):
                told = await self._interrupted(got, events)
                if told is not None:
                    return told
                continue
            if got.outcome is Outcome.CAUGHT and got.status >= 400:  # an overflow, before any of its answer
                refusal = await self._grown_for(got, growths)
                growths += 1
                if refusal is None:
                    continue
                return await answer.refused(refusal)
            if got.outcome is Outcome.ANSWERED:
                return await answer.answered(got)
            answer.took(got)
            cut = answer.cut_by_context(got, n_ctx)
            if cut is None or self.growth is None or growths >= MAX_GROWTHS:
                return await answer.finished()
            used, more = cut
            grown = await self.growth.grow(self.host, used + (more or self._headroom()), False)
            growths += 1
            if not isinstance(grown, Grown):
                log.info("degrade.continuation_refused", path=self.path,
                         why=grown.reason if isinstance(grown, CannotGrow) else "no plan to grow with")
                return await answer.finished()  # as llama-server cut it
            answer.grown()
            log.info("degrade.continue", path=self.path, used=used, stream=answer.shape is Shape.STREAM)

    def _catching(self, n_ctx: int) -> Catching:
        """The whole answers the loop looks at before the client does: an overflow (with a growth), and in the WHOLE
        shape (continuing) one a full context cut, or any part of an answer already continued."""
        answer = self.answer

        def catching(payload: dict[str, Any], status: int) -> bool:
            if status >= 400:
                return self.growth is not None and overflowed(payload)
            return answer.shape is Shape.WHOLE and self.continuing and (
                answer.whole is not None or answer.part_cut(payload, n_ctx) is not None)
        return catching

    # -- a cut or a pause -----------------------------------------------------------------------------------------

    async def _interrupted(self, got: Pass, events: Events | None) -> web.StreamResponse | None:
        """After a cut or a pause: None when the answer goes on (the next pass is ready), else the client's answer."""
        answer = self.answer
        if got.outcome is Outcome.CUT and not await self._goes_on_after(got):
            return await got.told(self._told_after_loss())
        answer.interrupted_by(got, events)
        if got.outcome is Outcome.CUT:
            await self._call_goes_on(same_server=not got.handed_over)
            if answer.response is not None:
                log.info("wrapper.stream_resumed", path=self.path, chars=len(answer.so_far.text),
                         tokens=answer.so_far.tokens, after="reload" if got.handed_over else "loss")
            return None
        resumed = await self.passes.resume(answer.request, answer.so_far.tokens)
        if isinstance(resumed, str):
            return await answer.broken_off(resumed)
        answer.resumed(resumed)
        return None

    async def _call_goes_on(self, same_server: bool) -> None:
        """A stream cut in a tool call is generated again from the start when that gives the answer it was (it
        samples repeatably, no more than `watchdog.replay_tokens` were generated — a decode step each again — and
        the server started again after a loss is the one it was: a reload's hand-over goes to another, whose KV
        precision, build or context may compute other numbers); else it goes on from the call's arguments so far
        (the same call, its budget less the prefill's tokens), when the served template says how a call is
        written; else it too is generated again from the start."""
        answer = self.answer
        if answer.shape is Shape.WHOLE or answer.had is None:
            return
        under_way = answer.so_far.call_under_way()
        if under_way is None:
            return
        call, arguments = under_way
        so_far = answer.so_far.generated if answer.so_far.generated is not None else answer.so_far.tokens
        if same_server and repeatable(answer.original, answer.api) and \
                so_far <= WATCHDOG.of(self.host.current.config).replay_tokens:
            log.info("wrapper.call_made_again", path=self.path, name=call.name, tokens=so_far,
                     why="it samples repeatably: generated again, it is the uncut answer")
            return
        written = await self.passes.written(call.name, answer.so_far.text, arguments,
                                            answer.so_far.generated_in_message)
        if written is None:
            log.info("wrapper.call_made_again", path=self.path, name=call.name,
                     why="the chat template's markup for a call is not known")
            return
        log.info("wrapper.call_goes_on", path=self.path, name=call.name, tokens=written.tokens,
                 as_generated=written.counted if answer.so_far.generated is not None else None)
        answer.call_goes_on(written.prefill, written.tokens)

    async def _goes_on_after(self, cut: Pass) -> bool:
        """Whether to send again (or go on) after a cut: a reload handed it over, or the server was lost under it
        and another serves now, and this request was not in flight at MAX_LOSSES losses. Only a request nothing of
        whose answer reached the client goes on in the WHOLE shape."""
        if not self.watched or (self.answer.shape is Shape.WHOLE and cut.response is not None):
            return False
        if cut.handed_over:  # a reload paused it: it goes on on the next server, not a loss
            return True
        loss = await self.passes.lost()
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

    def _told_after_loss(self) -> str | None:
        """What a cut's client is told: the losses that made it give up, that the server is gone, or (None) that it
        could not be reached."""
        if self.losses >= MAX_LOSSES:
            return (f"llama-server was lost {self.losses} times while it served this request (a prompt that makes "
                    "it crash or hang?): it is not sent again")
        return GONE_WHY if self.gone else None

    # -- an overflow ----------------------------------------------------------------------------------------------

    async def _grown_for(self, overflow: Pass, growths: int) -> web.Response | None:
        """Grow the context for a refused request: None when it may be sent again, else the refusal for the client
        (llama-server's, its message saying why it could not grow)."""
        if self.growth is None or growths >= MAX_GROWTHS:  # it overflowed after every growth
            return web.json_response(overflow.payload, status=overflow.status)
        pool_full = overflow.payload["error"].get("message") == POOL_FULL
        needed = 0 if pool_full else prompt_and_limit(overflow.payload, self.answer.request, self._headroom())
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
    asked_for = limit(asked)
    return prompt + (asked_for if asked_for is not None else headroom)
