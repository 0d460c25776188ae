"""The client's answer so far, in its shape, and the request that goes on from it.

One request's answer may take several passes to llama-server — after a context overflow and a growth, after a cut
(the server lost, or a reload handing the stream over), after a pause — and its client must see one answer. This
is that answer: what the client was given (a stream's response and its held end, the answer's id and first
event), its text a piece per token, and the request that goes on from it; its API (wrapper/answers/apis/) says how
each is read and made. Its shape (wrapper/answers/route.py) decides how a pass is read and how the answer ends:

- STREAM: events passed on as they come; a part after the first goes on in the same stream (its echo cut off,
  its id and counts the whole answer's), and the held end is written last;
- GATHERED: events gathered from a stream, never passed on; one JSON answer at the end;
- WHOLE: a JSON answer caught whole; a part continued after a growth is merged into it.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from aiohttp import web

from wrapper.answers.apis.api import Api, less
from wrapper.answers.continuation import SoFar, greedy
from wrapper.answers.events import Events
from wrapper.answers.part import Carry, Had, Part
from wrapper.answers.proxy import Outcome, Pass, broken_off, json_object
from wrapper.answers.route import Shape

SEED_LIMIT = 1 << 31  # a seed of the wrapper's own: below llama-server's "random" value (0xFFFFFFFF)


class Answer:
    def __init__(self, api: Api, shape: Shape, body: bytes, prompt_tokens: int | None = None) -> None:
        self.api, self.shape = api, shape
        parsed = json_object(body)
        self.json = parsed is not None  # the body is a JSON object: a request that can be sent again changed
        self.original: dict[str, Any] = parsed or {}
        self.untimed = False  # the wrapper asked for per-token timings its client did not ask for
        if parsed is not None and shape is not Shape.WHOLE:
            seeded = _regenerable(api, parsed)
            if seeded:
                parsed["seed"] = secrets.randbelow(SEED_LIMIT)  # made again after a loss, it samples the same tokens
            if api.timed and parsed.get("tools") and parsed.get("timings_per_token") is not True:
                parsed["timings_per_token"] = True  # a call cut under way goes on from what was generated, counted
                self.untimed = True  # (wrapper/answers/calls.py); its client is not shown the count
            if seeded or self.untimed:
                body = json.dumps(parsed).encode()
        self.request = self.original  # the request the next pass sends
        self.sent = as_stream(body) if shape is Shape.GATHERED else body  # ... as bytes
        self.prompt_tokens = prompt_tokens  # the request's own prompt, as the steps counted it
        self.so_far = SoFar(api)  # what the client has (STREAM) or will have (GATHERED)
        self.frame = api.frame()  # what the client was shown of the answer's frame (Responses, Messages)
        self.response: web.StreamResponse | None = None  # the client's, once a stream began
        self.held = b""  # the last events of a stream, written when it cannot go on
        self.had: Had | None = None  # what the next part must not show again, once it goes on
        self.carry: Carry | None = None  # the earlier parts' id and counts, once it goes on
        self.id: str | None = None  # the answer's (its first part's) id
        self.first: dict[str, Any] | None = None  # its first event: a gathered answer's id, created, model
        self.last: Events | None = None  # the last part's events
        self.whole: dict[str, Any] | None = None  # a WHOLE answer's parts so far, merged
        self.interrupted: web.BaseRequest | None = None  # the client's request, once a pass was cut or paused

    def events(self, holds: bool) -> Events | None:
        """What the next pass's events go through (`holds`: the end is held back while it may have to go on)."""
        if self.shape is Shape.WHOLE:
            return None
        if self.shape is Shape.GATHERED:
            part = Part(self.had, continuing=self.had is not None)
            return Events(self.api, part, holds=False, frame=self.frame, passes_on=False)
        return Events(self.api, Part(self.had, continuing=self.response is not None), holds=holds,
                      carry=self.carry, frame=self.frame, untimed=self.untimed)

    # -- what a pass came to ----------------------------------------------------------------------------------

    def interrupted_by(self, got: Pass, events: Events | None) -> None:
        """A pass was cut or paused: what its client got of it, and the request that goes on from there."""
        if got.response is not None:
            self.response = got.response
        self.interrupted = got.request
        self._took(events)
        if self.shape is Shape.WHOLE:
            return  # sent again as it was: nothing of it reached the client
        if self.response is not None or self.shape is Shape.GATHERED or got.outcome is Outcome.PAUSED:
            self.request, self.had = self.so_far.going_on(self.original, greedy(self.original))
            if self.shape is Shape.STREAM:  # the events it generates again are not the earlier parts' to count
                self.carry = self._carry(self.had.generated_again)
        self.sent = self._body(self.request)

    def call_goes_on(self, prefill: str, tokens: int) -> None:
        """A stream cut in a tool call goes on from the call's arguments so far, as its model wrote them (`prefill`,
        `tokens` of it), not from the start."""
        self.request, self.had = self.so_far.call_going_on(self.original, prefill, tokens)
        if self.shape is Shape.STREAM:
            self.carry = self._carry(0, tokens + len(self.so_far.reasoning))
        self.sent = self._body(self.request)

    def resumed(self, body: bytes) -> None:
        """The body the steps made for the request that goes on after a pause."""
        self.sent = as_stream(body) if self.shape is Shape.GATHERED else body

    def took(self, got: Pass) -> None:
        """A pass ended with an answer: a stream's held end, a gathered stream, a whole JSON answer."""
        if got.outcome is Outcome.HELD:
            assert got.response is not None and got.events is not None
            self.response, self.held = got.response, got.events.release()
        self._took(got.events)
        if got.outcome is Outcome.CAUGHT:
            self.whole = self.api.merged(self.whole, got.payload) if self.whole is not None else got.payload

    def _took(self, events: Events | None) -> None:
        if events is None:
            return
        self.last = events
        part = events.part
        self.so_far.took(part)
        self.id = self.id or part.id
        self.first = self.first or part.first

    def cut_by_context(self, got: Pass, n_ctx: int) -> tuple[int, int] | None:
        """(tokens used, tokens still wanted) when the part just taken stopped at a full context."""
        if got.outcome is Outcome.CAUGHT:
            return self.part_cut(got.payload, n_ctx)
        final = self.last.final if self.last is not None else None
        if final is None or not self.api.growable:
            return None
        asked = self.original if self.carry is not None else self.request
        return self.api.cut_by_context(asked, self.api.as_answer(final), n_ctx)

    def part_cut(self, payload: dict[str, Any], n_ctx: int) -> tuple[int, int] | None:
        """As `cut_by_context`, for a whole JSON answer to the request just sent."""
        return self.api.cut_by_context(self.request, payload, n_ctx)

    def grown(self) -> None:
        """The context grew for an answer it cut: the request that goes on from all of it."""
        if self.shape is Shape.WHOLE:
            assert self.whole is not None
            text, reasoning, generated = self.api.said(self.whole)
            self.request = less(self.api.going_on(self.original, text, reasoning), generated)
        else:
            self.request, self.had = self.so_far.grown(self.original)
            if self.shape is Shape.STREAM:
                self.carry = self._carry(0)
        self.sent = self._body(self.request)

    # -- how it ends ------------------------------------------------------------------------------------------

    async def finished(self) -> web.StreamResponse:
        """The answer as it stands: a stream ended (its held end written), one JSON answer."""
        if self.shape is Shape.STREAM:
            if self.response is None:  # never reached: each pass either returns, goes on, or began the stream
                raise RuntimeError("a stream ended before it began")
            await self.response.write(self.held)
            await self.response.write_eof()
            return self.response
        if self.shape is Shape.GATHERED:
            assert self.last is not None
            last = self.last.part
            last.first = self.first
            return web.json_response(self.api.gathered(last, self.so_far, self.prompt_tokens, self.original))
        assert self.whole is not None
        return web.json_response(self.whole)

    async def refused(self, refusal: web.StreamResponse) -> web.StreamResponse:
        """A refusal after the answer began (a continuation that overflowed and could not grow): the answer as it
        stands; before, the refusal."""
        if self.response is None and self.whole is None and not self.so_far.pieces:
            return refusal
        return await self.finished()

    async def answered(self, got: Pass) -> web.StreamResponse:
        """A pass answered the client as it came (or was refused at the gate): that answer; in a stream that had
        begun, the stream ends as it ended before — or, when it waited to go on (after a cut or a pause) and was
        refused, with the refusal's reason."""
        response = got.answered
        if self.response is None or response is self.response:
            return response
        if not self.held and self.interrupted is not None and isinstance(response, web.Response):
            said = (json_object(response.body if isinstance(response.body, bytes) else b"") or {}).get("error")
            why = str((said or {}).get("message") or f"status {response.status}") if isinstance(said, dict) \
                else f"status {response.status}"
            return await broken_off(self.interrupted, self.response, why)
        return await self.finished()

    async def broken_off(self, why: str) -> web.StreamResponse:
        """It cannot go on (a paused answer the steps refused to resume): a 503 when nothing reached the client,
        else its stream ends with an error event saying why."""
        if self.response is None or self.interrupted is None:
            return web.json_response(self.api.error_body(503, why, "unavailable_error"), status=503)
        return await broken_off(self.interrupted, self.response, why)

    # -----------------------------------------------------------------------------------------------------------

    def _carry(self, again: int, shown: int | None = None) -> Carry:
        """What the next part makes its counts and id from: the client's answer so far (`shown` tokens, when they
        were counted: else its events), the request's prompt."""
        prompt = self.original.get("prompt") if not self.api.message else None
        return Carry(self.id, self.so_far.tokens if shown is None else shown, again, self.prompt_tokens or None,
                     prompt if isinstance(prompt, str) else None)

    def _body(self, request: dict[str, Any]) -> bytes:
        body = json.dumps(request).encode()
        return as_stream(body) if self.shape is Shape.GATHERED else body


def _regenerable(api: Api, request: dict[str, Any]) -> bool:
    """Whether an answer to `request` may have to be generated again from the start after a loss (an API that cannot
    go on from a prefix; a request that offers tools, whose call under way is made again) and its sampling is not
    made repeatable already (a seed, or greedy)."""
    if "seed" in request or greedy(request) or not api.seeded:
        return False
    return not api.exact or bool(request.get("tools"))


def as_stream(body: bytes) -> bytes:
    """A request body asking for its answer as a stream (a GATHERED answer is read from one)."""
    payload = json_object(body) or {}
    payload["stream"] = True
    payload.pop("stream_options", None)
    return json.dumps(payload).encode()
