"""The path of a proxied request to llama-server: the steps built-ins declare before it is forwarded, one pass
through the gate, and what happens when llama-server answers a context overflow (wrapper/growing.py: a
built-in grows the context and the request is sent again; an answer cut by a full context goes on after a
growth, streamed or not).

The listener (wrapper/listener.py) calls `forward_request` and keeps only the HTTP face.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog
from aiohttp import web

from wrapper import argv as args
from wrapper import built_ins, paths
from wrapper.answering import AnswerLoop
from wrapper.gate import Admission
from wrapper.generation import Generation
from wrapper.proxy import (
    STARTED,
    Caught,
    Cut,
    Held,
    Upstream,
    Wanted,
    broken_off,
    catch,
    forward,
    json_error,
    json_object,
)
from wrapper.serving import Serving
from wrapper.sse import Events
from wrapper.steps import Outgoing, Reply, Shown
from wrapper.watchdog import GONE_WHY, WATCHDOG, Loss

log = structlog.get_logger()

RETRY_AFTER_S = "5"
BODY_LIMIT = 32 << 20  # a request read whole (for a step, or to be sent again after a growth)
R = TypeVar("R", bound=web.StreamResponse | Caught | Held | Cut)


async def forward_request(request: web.Request, serving: Serving, path: str) -> web.StreamResponse:
    """Forward one request: as a stream, or read whole when a step, a growth, or a lost server may need it again."""
    generation = serving.current
    passes = _Passes(request, serving, path)
    if request.method == "GET" and (rewrites := built_ins.shown(generation, path)):
        return await _shown(passes, path, rewrites)
    growth = built_ins.growth(generation) if path in paths.GENERATING else None
    steps = [step for step in built_ins.before(generation) if path in step.paths]
    watched = WATCHDOG.of(generation.config).enabled  # a request in flight goes on after a restart: kept whole
    if request.method != "POST" or (growth is None and not steps and not watched) or \
            (request.content_length or 0) > BODY_LIMIT:  # a body streamed through cannot be sent again
        again = watched and request.method in ("GET", "HEAD")
        return await passes.through(lambda to: forward(request, to, path), again)
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
        sent = outgoing.body
        if growth is None and not watched:
            result = await passes.through(lambda to: forward(request, to, path, sent), False)
        else:
            result = await AnswerLoop(serving, growth, path, sent, passes.exchange, lambda: _slot_ctx(serving.current),
                                      passes.lost if watched else None).run()
        status = result.status
        return result
    finally:  # also when the client hung up: a step's reservation must not outlive its request
        for done in outgoing.after:
            done(status)


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

    def __init__(self, request: web.Request, serving: Serving, path: str) -> None:
        self.request, self.serving, self.path = request, serving, path
        self.generation: Generation | None = None
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
                       going_on: web.StreamResponse | None) -> web.StreamResponse | Caught | Held | Cut:
        """The answer loop's pass: a whole answer it wants caught, an event stream through `events`."""
        request, path = self.request, self.path
        return await self.send(lambda to: catch(request, to, wanted, path, body, events, going_on))

    async def lost(self) -> Loss:
        """After a cut pass: whether its server was lost, and whether another will serve (the next pass waits at
        the gate)."""
        if self.generation is None:
            return Loss.NONE
        loss = await self.serving.lost_under(self.generation)
        self._why = GONE_WHY if loss is Loss.GONE else None
        return loss

    async def _passed(self, send: Callable[[Upstream], Awaitable[R]], again: bool) -> R | web.StreamResponse:
        """One pass, and (`again`) once more to the server started again when the one it went to was lost under it
        before its answer began. A cut pass learns whether its server was lost, which says what its client is
        told."""
        result = await self.send(send)
        if not isinstance(result, Cut) or await self.lost() is not Loss.BACK or not again \
                or result.response is not None:
            return result
        log.warning("wrapper.request_again", path=self.path, started=False)
        return await self.send(send)

    async def send(self, send: Callable[[Upstream], Awaitable[R]]) -> R | web.StreamResponse:
        """One pass through the gate to what serves now: `send` there, counted in flight, cut by the stop's drain
        deadline."""
        serving, request = self.serving, self.request
        admission = await serving.gate.enter()
        if admission is not Admission.ADMITTED:
            return _refused(serving, admission)
        self.generation = serving.current
        to = Upstream(serving.current.launch.url, serving.session, built_ins.observer(serving.current),
                      serving.heard)
        exchange = asyncio.ensure_future(send(to))
        serving.gate.track(exchange)
        try:
            return await exchange  # cancelled with us when the client hangs up: llama-server then stops the work
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # we are cancelled ourselves (the client went away)
            # Only the exchange was cut (the stop's drain deadline passed): tell the client, if it can still hear.
            started = request.get(STARTED)
            log.warning("proxy.cut", method=request.method, path=self.path, mid_response=started is not None)
            if started is not None:
                return await broken_off(request, started, "llama-wrapper is stopping: the answer was cut at the "
                                        "drain deadline")
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


def _slot_ctx(generation: Generation) -> int:
    """The context one slot has: as the server said at its start, else -c, or -c / -np when every slot has its
    own KV (no -kvu)."""
    if generation.context is not None:
        return generation.context.slot
    argv = generation.launch.argv
    n_ctx = int(args.get(argv, args.CTX_SIZE) or 0)
    parallel = max(1, int(args.get(argv, args.PARALLEL) or 1))
    return n_ctx if args.last_of(argv, args.KV_UNIFIED, args.NO_KV_UNIFIED) else n_ctx // parallel


