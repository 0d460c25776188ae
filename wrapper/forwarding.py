"""The path of a proxied request to llama-server: the steps built-ins declare before it is forwarded, one pass
through the gate, and what happens when llama-server answers a context overflow (a built-in grows the context
and the request is sent again; an answer cut by a full context goes on after a growth, streamed or not).

The listener (wrapper/listener.py) calls `forward_request` and keeps only the HTTP face.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web

from wrapper import argv as args
from wrapper import extensions, paths
from wrapper.continuation import continued, cut_by_context, merged
from wrapper.gate import Admission
from wrapper.generation import Generation
from wrapper.proxy import STARTED, Caught, Held, broken_off, forward, json_error, json_object
from wrapper.serving import Serving
from wrapper.sse import Events, as_answer
from wrapper.steps import CannotGrow, Grown, Growth, Outgoing, Reply, Shown

log = structlog.get_logger()

RETRY_AFTER_S = "5"
OVERFLOW = "exceed_context_size_error"
POOL_FULL = "Context size has been exceeded."  # llama-server's 500 when the shared KV (-kvu) ran out
BODY_LIMIT = 32 << 20  # a request read whole (for a step, or to be sent again after a growth)
MAX_GROWTHS = 3


async def forward_request(request: web.Request, serving: Serving, path: str) -> web.StreamResponse:
    """Forward one request: as a stream, or read whole when a step or a growth may need it again."""
    generation = serving.current
    if request.method == "GET" and (rewrites := extensions.shown(generation, path)):
        return await _shown(request, serving, path, rewrites)
    growth = extensions.growth(generation) if path in paths.GENERATING else None
    steps = [step for step in extensions.before(generation) if path in step.paths]
    if request.method != "POST" or (growth is None and not steps) or (request.content_length or 0) > BODY_LIMIT:
        result = await _exchange(request, serving, path, None, None)
        assert isinstance(result, web.StreamResponse)  # nothing is caught or held without a body to send again
        return result
    body = await _read_whole(request, BODY_LIMIT)
    if body is None:
        return json_error(413, f"a completion request of more than {BODY_LIMIT >> 20} MiB", "invalid_request_error")
    outgoing = Outgoing(request.method, path, body, json_object(body))
    status: int | None = None
    try:
        if steps:  # the steps talk to llama-server: only once the gate lets requests through (not counted in
            # flight: a step may wait for a slot that a growth's drain would otherwise wait for in turn)
            admission = await serving.gate.enter(counted=False)
            if admission is not Admission.ADMITTED:
                return _refused(serving, admission)
            for step in steps:
                stepped = await step.run(serving, outgoing)
                if isinstance(stepped, Reply):
                    status = stepped.status
                    return web.json_response(stepped.body, status=stepped.status, headers=dict(stepped.headers))
                outgoing = stepped
        if growth is None:
            result = await _exchange(request, serving, path, outgoing.body, None)
            assert isinstance(result, web.StreamResponse)
        else:
            result = await _growing(request, serving, growth, path, outgoing.body)
        status = result.status
        return result
    finally:  # also when the client hung up: a step's reservation must not outlive its request
        for done in outgoing.after:
            done(status)


async def _growing(request: web.Request, serving: Serving, growth: Growth, path: str,
                   body: bytes) -> web.StreamResponse:
    """Send a completion request; on a context overflow grow the context and send it again. A non-streamed
    answer cut by a full context is continued after a growth (degrade.continue): the client gets one answer."""
    original = json_object(body)
    can_continue = growth.continues(serving.current.config) and original is not None and path in paths.CONTINUABLE
    if can_continue and original is not None and original.get("stream") is True:
        return await _growing_stream(request, serving, growth, path, body, original)
    continuing = can_continue and original is not None and original.get("stream") is not True
    request_now, sent, earlier = original or {}, body, None
    result: web.StreamResponse | Caught | Held | None = None
    for _ in range(MAX_GROWTHS + 1):
        n_ctx = _slot_ctx(serving.current)

        def wanted(payload: dict[str, Any], status: int, n_ctx: int = n_ctx, going_on: bool = earlier is not None,
                   asked: dict[str, Any] = request_now) -> bool:
            if status >= 400:
                return _overflowed(payload)
            return continuing and (going_on or cut_by_context(path, asked, payload, n_ctx) is not None)

        result = await _exchange(request, serving, path, sent, wanted)
        if not isinstance(result, Caught):
            assert isinstance(result, web.StreamResponse)  # no events filter: nothing is held
            return result
        if result.status >= 400:
            refusal = await _grown_for(serving, growth, path, result, request_now)
            if refusal is None:
                continue
            return web.json_response(earlier) if earlier is not None else refusal  # a continuation: what came
        answer = merged(path, earlier, result.payload) if earlier is not None else result.payload
        cut = cut_by_context(path, request_now, result.payload, n_ctx)
        if cut is None:
            return web.json_response(answer)
        used, more = cut
        grown = await growth.grow(serving, used + (more or growth.headroom(serving.current.config)), False)
        if not isinstance(grown, Grown):
            log.info("degrade.continuation_refused", path=path,
                     why=grown.reason if isinstance(grown, CannotGrow) else "no plan to grow with")
            return web.json_response(answer)  # as llama-server cut it
        earlier, request_now = answer, continued(path, original or {}, answer)
        sent = json.dumps(request_now).encode()
        log.info("degrade.continue", path=path, used=used)
    if earlier is not None:
        return web.json_response(earlier)
    assert isinstance(result, Caught)  # it overflowed after every growth: the client gets the last refusal
    return web.json_response(result.payload, status=result.status)


async def _shown(request: web.Request, serving: Serving, path: str, rewrites: list[Shown]) -> web.StreamResponse:
    """llama-server's answer to a GET, rewritten by the built-ins that say what clients are told of it."""
    result = await _exchange(request, serving, path, None, lambda payload, status: status == 200)
    if not isinstance(result, Caught):
        assert isinstance(result, web.StreamResponse)
        return result
    answer = result.payload
    for rewrite in rewrites:
        answer = rewrite.rewrite(serving.current, path, answer)
    headers = {k: v for k, v in result.headers.items() if k.lower() not in ("content-length", "content-type")}
    return web.json_response(answer, status=result.status, headers=headers)  # CORS and the rest as they were


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


async def _exchange(request: web.Request, serving: Serving, path: str, body: bytes | None,
                    catch: Callable[[dict[str, Any], int], bool] | None, events: Events | None = None,
                    going_on: web.StreamResponse | None = None) -> web.StreamResponse | Caught | Held:
    """One pass through the gate to llama-server; a context overflow is Caught when `body` can be sent again."""
    admission = await serving.gate.enter()
    if admission is not Admission.ADMITTED:
        return _refused(serving, admission)
    exchange = asyncio.ensure_future(forward(request, serving.current.launch.url, serving.session,
                                             extensions.observer(serving.current), path, body, catch, events, going_on))
    serving.gate.track(exchange)
    try:
        return await exchange  # cancelled with us when the client hangs up: llama-server then stops the work
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # we are cancelled ourselves (the client went away)
        # Only the exchange was cut (the stop's drain deadline passed): tell the client, if it can still hear.
        started = request.get(STARTED)
        log.warning("proxy.cut", method=request.method, path=path, mid_response=started is not None)
        if started is not None:
            return broken_off(request, started)
        return json_error(503, "llama-wrapper is stopping: the request was cut at the drain deadline",
                          "unavailable_error", {"Retry-After": RETRY_AFTER_S})
    finally:
        serving.gate.leave(exchange)


def _refused(serving: Serving, admission: Admission) -> web.Response:
    if admission is Admission.TIMED_OUT:
        return json_error(503, f"llama-wrapper is {serving.lifecycle.state} and held this request for "
                          f"reload.hold_timeout ({serving.current.config.reload_hold_timeout:g}s)", "unavailable_error",
                          {"Retry-After": RETRY_AFTER_S})
    return json_error(503, f"llama-wrapper is {serving.lifecycle.state}", "unavailable_error",
                      {"Retry-After": RETRY_AFTER_S})


async def _grown_for(serving: Serving, growth: Growth, path: str, overflow: Caught,
                     asked: dict[str, Any]) -> web.Response | None:
    """Grow the context for a refused request: None when it may be sent again, else the refusal for the client
    (llama-server's, its message saying why it could not grow)."""
    pool_full = overflow.payload["error"].get("message") == POOL_FULL
    needed = 0 if pool_full else _needed(overflow.payload, asked, growth.headroom(serving.current.config))
    grown = await growth.grow(serving, needed, pool_full)
    if isinstance(grown, Grown):
        log.info("degrade.retry", path=path, needed=needed)
        return None
    reason = grown.reason if isinstance(grown, CannotGrow) else ""
    log.info("degrade.overflow_refused", path=path, needed=needed, why=reason or "no plan to grow with")
    error = dict(overflow.payload["error"])
    if reason:
        error["message"] = f"{reason} ({error.get('message')})"
    return web.json_response({**overflow.payload, "error": error}, status=overflow.status)


async def _growing_stream(request: web.Request, serving: Serving, growth: Growth, path: str, body: bytes,
                          original: dict[str, Any]) -> web.StreamResponse:
    """A streamed completion request: grown and sent again on an overflow (before any event); an answer cut by
    a full context goes on in the same stream after a growth, its stop event held back until then."""
    chat = path in paths.CHAT
    request_now, sent, text, generated = original, body, "", 0
    response: web.StreamResponse | None = None
    held = b""  # the last events of the answer so far, sent when it cannot go on
    for _ in range(MAX_GROWTHS + 1):
        n_ctx = _slot_ctx(serving.current)
        events = Events(chat, skip=text if chat else "", continuing=response is not None)
        result = await _exchange(request, serving, path, sent, lambda p, status: status >= 400 and _overflowed(p),
                                 events, response)
        if isinstance(result, Caught):
            refusal = await _grown_for(serving, growth, path, result, request_now)
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
        cut = cut_by_context(path, request_now, as_answer(chat, final), n_ctx) if final is not None else None
        if cut is None:
            break
        used, more = cut
        generated += int(((final or {}).get("timings") or {}).get("predicted_n") or (final or {}).get(
            "tokens_predicted") or 0)
        room = used + (more or growth.headroom(serving.current.config))
        if not isinstance(await growth.grow(serving, room, False), Grown):
            break
        so_far = ({"choices": [{"message": {"content": text}}], "usage": {"completion_tokens": generated}} if chat
                  else {"content": text, "tokens_predicted": generated})
        request_now = continued(path, original, so_far)
        sent = json.dumps(request_now).encode()
        log.info("degrade.continue", path=path, used=used, stream=True)
    assert response is not None
    await response.write(held)
    await response.write_eof()
    return response


def _overflowed(payload: dict[str, Any]) -> bool:
    """llama-server's refusal of a prompt longer than a slot's context, or its 500 when the slots' shared KV
    ran out of cells while they filled it together."""
    error = payload.get("error")
    if not isinstance(error, dict):
        return False
    return (error.get("type") == OVERFLOW and isinstance(error.get("n_prompt_tokens"), int)) or \
        error.get("message") == POOL_FULL


def _slot_ctx(generation: Generation) -> int:
    """The context one slot has: as the server said at its start, else -c, or -c / -np when every slot has its
    own KV (no -kvu)."""
    if generation.context is not None:
        return generation.context.slot
    argv = generation.launch.argv
    n_ctx = int(args.get(argv, args.CTX_SIZE) or 0)
    parallel = max(1, int(args.get(argv, args.PARALLEL) or 1))
    return n_ctx if args.last_of(argv, args.KV_UNIFIED, args.NO_KV_UNIFIED) else n_ctx // parallel


def _needed(payload: dict[str, Any], asked: dict[str, Any], headroom: int) -> int:
    """The prompt's tokens plus what the request may generate (its max_tokens, else the headroom)."""
    prompt = int(payload["error"]["n_prompt_tokens"])
    limit = next((asked[k] for k in ("max_completion_tokens", "max_tokens", "n_predict")
                  if isinstance(asked.get(k), int) and not isinstance(asked.get(k), bool) and asked[k] > 0), None)
    return prompt + (limit if limit is not None else headroom)
