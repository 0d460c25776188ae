"""A completion request through context overflows (a built-in's `Growth`, degrade's): sent; refused for a prompt
longer than the context, the context is grown and it is sent again; an answer cut by a full context goes on
after a growth (`degrade.continue`), in the same stream or as one JSON answer, so that the client gets one answer.

The loop is an object whose only I/O is its `exchange` (one pass through the gate to llama-server: forward or
catch, wrapper/proxy.py) and the growth's `grow`; tests/unit/wrapper/test_growing.py drives it with both scripted.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from wrapper import paths
from wrapper.continuation import continued, cut_by_context, merged
from wrapper.generation import Host
from wrapper.proxy import Caught, Held, Wanted, json_object
from wrapper.sse import Events, as_answer
from wrapper.steps import CannotGrow, Grown, Growth

log = structlog.get_logger()

OVERFLOW = "exceed_context_size_error"
POOL_FULL = "Context size has been exceeded."  # llama-server's 500 when the shared KV (-kvu) ran out
MAX_GROWTHS = 3

Exchange = Callable[[bytes, Wanted, Events | None, web.StreamResponse | None],
                    Awaitable[web.StreamResponse | Caught | Held]]
"""(the body to send, which whole answers to catch, the events filter, the client's response it continues)"""


class GrowthLoop:
    def __init__(self, host: Host, growth: Growth, path: str, body: bytes, exchange: Exchange,
                 slot_context: Callable[[], int]) -> None:
        self.host, self.growth, self.path, self.body = host, growth, path, body
        self.exchange, self.slot_context = exchange, slot_context
        self.original = json_object(body)
        config = host.current.config
        self.continuing = (growth.continues(config) and self.original is not None and path in paths.CONTINUABLE)

    async def run(self) -> web.StreamResponse:
        if self.continuing and self.original is not None and self.original.get("stream") is True:
            return await self._streamed(self.original)
        return await self._whole()

    # -- a JSON answer ------------------------------------------------------------------------------------------

    async def _whole(self) -> web.StreamResponse:
        """Sent again after each growth for an overflow; an answer cut by a full context continued after a growth
        (when it may be), the parts merged into one answer."""
        request_now, sent = self.original or {}, self.body
        earlier: dict[str, Any] | None = None
        for attempt in range(MAX_GROWTHS + 1):
            n_ctx = self.slot_context()
            result = await self.exchange(sent, self._wanted(request_now, n_ctx, earlier is not None), None, None)
            if not isinstance(result, Caught):
                return result.response if isinstance(result, Held) else result
            if result.status >= 400:
                if attempt == MAX_GROWTHS:  # it overflowed after every growth: the client gets this refusal
                    refusal: web.Response | None = web.json_response(result.payload, status=result.status)
                else:
                    refusal = await self._grown_for(result, request_now)
                if refusal is None:
                    continue
                return web.json_response(earlier) if earlier is not None else refusal  # a continuation: what came
            answer = merged(self.path, earlier, result.payload) if earlier is not None else result.payload
            cut = cut_by_context(self.path, request_now, result.payload, n_ctx)
            if cut is None:
                return web.json_response(answer)
            used, more = cut
            grown = await self.growth.grow(self.host, used + (more or self._headroom()), False)
            if not isinstance(grown, Grown):
                log.info("degrade.continuation_refused", path=self.path,
                         why=grown.reason if isinstance(grown, CannotGrow) else "no plan to grow with")
                return web.json_response(answer)  # as llama-server cut it
            earlier, request_now = answer, continued(self.path, self.original or {}, answer)
            sent = json.dumps(request_now).encode()
            log.info("degrade.continue", path=self.path, used=used)
        return web.json_response(earlier)  # continued after every growth: what came so far

    def _wanted(self, asked: dict[str, Any], n_ctx: int, going_on: bool) -> Wanted:
        """The answers the loop looks at before the client does: an overflow, and (continuing) an answer a full
        context cut, or any part of an answer already continued."""
        def wanted(payload: dict[str, Any], status: int) -> bool:
            if status >= 400:
                return overflowed(payload)
            return self.continuing and (going_on or cut_by_context(self.path, asked, payload, n_ctx) is not None)
        return wanted

    # -- an event stream ----------------------------------------------------------------------------------------

    async def _streamed(self, original: dict[str, Any]) -> web.StreamResponse:
        """Grown and sent again on an overflow (before any event); an answer cut by a full context goes on in the
        same stream after a growth, its stop event held back until then."""
        chat = self.path in paths.CHAT
        request_now, sent, text, generated = original, self.body, "", 0
        response: web.StreamResponse | None = None
        held = b""  # the last events of the answer so far, sent when it cannot go on
        for attempt in range(MAX_GROWTHS + 1):
            n_ctx = self.slot_context()
            events = Events(chat, skip=text if chat else "", continuing=response is not None)
            result = await self.exchange(sent, lambda p, status: status >= 400 and overflowed(p), events, response)
            if isinstance(result, Caught):
                if attempt == MAX_GROWTHS:  # it overflowed after every growth
                    refusal: web.Response | None = web.json_response(result.payload, status=result.status)
                else:
                    refusal = await self._grown_for(result, request_now)
                if refusal is None:
                    continue
                if response is None:
                    return refusal
                break  # a continuation that cannot go on: end the stream as it ended before
            if not isinstance(result, Held):
                if response is None or result is response:
                    return result
                break  # a refusal (held too long, stopping) after the stream began: end it as it ended before
            response, held = result.response, result.events.release()
            text += "".join(result.events.content)
            final = result.events.final
            cut = cut_by_context(self.path, request_now, as_answer(chat, final), n_ctx) if final is not None else None
            if cut is None:
                break
            used, more = cut
            generated += int(((final or {}).get("timings") or {}).get("predicted_n") or (final or {}).get(
                "tokens_predicted") or 0)
            if not isinstance(await self.growth.grow(self.host, used + (more or self._headroom()), False), Grown):
                break
            so_far = ({"choices": [{"message": {"content": text}}], "usage": {"completion_tokens": generated}} if chat
                      else {"content": text, "tokens_predicted": generated})
            request_now = continued(self.path, original, so_far)
            sent = json.dumps(request_now).encode()
            log.info("degrade.continue", path=self.path, used=used, stream=True)
        if response is None:  # never reached: each pass either returns, continues, or began the stream
            raise RuntimeError("a streamed growth ended before its stream began")
        await response.write(held)
        await response.write_eof()
        return response

    # -- growing --------------------------------------------------------------------------------------------------

    async def _grown_for(self, overflow: Caught, asked: dict[str, Any]) -> web.Response | None:
        """Grow the context for a refused request: None when it may be sent again, else the refusal for the client
        (llama-server's, its message saying why it could not grow)."""
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
        return self.growth.headroom(self.host.current.config)


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
