"""The path of a proxied request to llama-server, top to bottom: its way (wrapper/answers/route.py), its seat in the
slots' queue (a request that decodes: interactive ones first, wrapper/queue/seats.py), the built-ins' steps on its
body, then its passes — one streamed through, or the answer loop (wrapper/answers/answering.py) when a growth, a lost
server or a pause may need the request again — and at the end each step's `after`.

The listener (wrapper/http/listener.py) calls `forward_request` and keeps only the HTTP face."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import structlog
from aiohttp import web

from wrapper import built_ins, paths
from wrapper.answers import apis
from wrapper.answers.answering import AnswerLoop
from wrapper.answers.apis.api import GOES_ON_NOT, Api
from wrapper.answers.passes import Passes, refused
from wrapper.answers.proxy import Outcome, catch, forward, json_error, json_object
from wrapper.answers.route import BODY_LIMIT, Way, shape, way
from wrapper.asked import Asked
from wrapper.configuration import argv as args
from wrapper.configuration.consumers import CONSUMERS, NotAUser, consumer_of, salted
from wrapper.configuration.sections import PRIORITY, WATCHDOG
from wrapper.lifecycle import State
from wrapper.paths import ANSWERED_ASLEEP
from wrapper.queue import priority
from wrapper.queue.gate import Admission
from wrapper.queue.seats import BETWEEN, Seat, Why
from wrapper.server.generation import Generation, Host
from wrapper.serving import Serving
from wrapper.steps import Outgoing

log = structlog.get_logger()

ASLEEP = (State.SLEEPING, State.ASLEEP, State.WAKING)
CACHE_SALT = "cache_salt"  # vLLM's name: the request's conversations private to its consumer and this salt


async def forward_request(request: web.Request, serving: Serving, host: Host, path: str) -> web.StreamResponse:
    """Forward one request, and answer its client."""
    generation = serving.current
    polled = request.method == "GET" and path in ANSWERED_ASLEEP
    remembered = serving.remembered.get(path) if polled and serving.state in ASLEEP else None
    shown = built_ins.shown(generation, path) if request.method == "GET" else []
    growth = built_ins.growth(generation) if path in paths.GENERATING else None
    steps = tuple(step for step in built_ins.before(generation) if path in step.paths)
    watched = WATCHDOG.of(generation.config).enabled  # a request in flight goes on after a restart: kept whole
    seated = request.method == "POST" and path in paths.SEATED
    chosen = way(request.method, remembered is not None, bool(shown),
                 growth is not None or bool(steps) or watched or seated, request.content_length)
    if chosen is Way.REMEMBERED:
        assert remembered is not None
        return _remembered(serving, path, remembered.payload)
    passes = Passes(request, serving, host, path, steps=steps)
    try:
        consumer = consumer_of(request.headers, CONSUMERS.of(generation.config))
    except NotAUser as exc:
        return json_error(400, str(exc), "invalid_request_error", path=path)
    passes.asked = Asked(path, consumer)
    passes.active = not polled  # what clients poll does not keep the server awake
    if chosen is Way.SHOWN:
        return await _shown(passes, path, watched)
    if chosen is Way.THROUGH:  # a body streamed through cannot be sent again
        passes.asked = _asked(serving, request, None, path, consumer, seated)
        seat = Seat(passes.asked) if seated else None
        async with _seated(serving, seat) as admitted:
            if not admitted:
                return refused(serving, Admission.REFUSED, path)
            return await passes.through(lambda to: forward(request, to, path),
                                        watched and request.method in ("GET", "HEAD"))
    body = await _read_whole(request, BODY_LIMIT)
    if body is None:
        return json_error(413, f"a completion request of more than {BODY_LIMIT >> 20} MiB", "invalid_request_error",
                          path=path)
    payload = json_object(body)
    salt = payload.pop(CACHE_SALT, None) if payload is not None else None
    if salt is not None:  # never passed to llama-server, never logged: its digest makes the owner
        if not isinstance(salt, str) or not salt:
            return json_error(400, f"{CACHE_SALT}: a non-empty string (a request's conversations are private to its "
                                   "consumer and that salt)", "invalid_request_error", path=path)
        consumer = salted(consumer, salt)
        body = json.dumps(payload).encode()
    passes.asked = _asked(serving, request, payload, path, consumer, seated)
    seat = Seat(passes.asked) if seated else None
    if payload is not None and priority.unsaid(payload):
        body = json.dumps(payload).encode()
    async with _seated(serving, seat) as admitted:
        if not admitted:
            return refused(serving, Admission.REFUSED, path)
        passes.seat = seat
        status: int | None = None
        try:
            first = Outgoing(request.method, path, body, payload, passes.asked,
                             use=seat.use if seat is not None else None)
            refusal = await passes.stepped(first)
            if refusal is not None:
                status = refusal.status
                return refusal
            api = apis.of(path)
            if seat is not None and seat.asked.background:
                seat.unpausable = _unpausable(first, api)
            passes.pausable = seat is not None and serving.seats.why_not_paused(seat) in (None, BETWEEN)
            goes_on = first.payload is not None and api.cannot_go_on(first.payload) is None
            passes.resumable = watched and goes_on
            if growth is None and not watched and not passes.pausable:
                response = await passes.through(lambda to: forward(request, to, path, first.body), False)
            else:
                continuing = growth is not None and growth.continues(generation.config) and goes_on
                read_as = shape(first.payload, continuing, passes.resumable, passes.pausable)
                prompt = seat.use.prompt if seat is not None and passes.pausable and seat.use.prompt else None
                response = await AnswerLoop(host, growth, api, path, first.body, passes,
                                            lambda: _slot_ctx(serving.current), read_as, watched, prompt).run()
            status = response.status
            return response
        finally:  # also when the client hung up: a step's reservation must not outlive its request
            passes.done(status)


def _asked(serving: Serving, request: web.Request, payload: dict[str, Any] | None, path: str, consumer: str | None,
           seated: bool) -> Asked:
    """Who asks and how, once: a request that takes a seat is classed from its header, its body and its key (the
    queue set for the server that serves now), and the log says how; any other is its consumer's."""
    if not seated:
        return Asked(path, consumer)
    asked = priority.asked(path, consumer, request.headers, payload, PRIORITY.of(serving.queue().config))
    for mark in priority.odd_marks(request.headers, payload):
        if mark not in _ODD_SEEN and len(_ODD_SEEN) < 64:  # once each: a client sends it with every request
            _ODD_SEEN.add(mark)
            log.warning("priority.unknown_mark", mark=mark, read_as=asked.klass.value,
                        hint="X-Priority: background or interactive; service_tier: flex (background) or priority")
    log.info("request.classed", **asked.said())
    return asked


_ODD_SEEN: set[str] = set()


def _unpausable(out: Outgoing, api: Api) -> Why | None:
    """Why a background request cannot be paused and resumed (None: it can): its answer cannot go on exactly (its
    API's `cannot_pause`), no step keeps what its slot holds (the conversation cache is off), or it asked for a JSON
    answer with token probabilities (a gathered stream has none)."""
    payload = out.payload
    if payload is None:
        return Why("api", "its body is not a JSON object")
    if (code := api.cannot_pause(payload)) is not None:
        return Why(code, GOES_ON_NOT[code])
    if not out.keep:
        return Why("no_keep", "no built-in keeps what its slot holds (the conversation cache is off)")
    if payload.get("stream") is not True and (payload.get("logprobs") or payload.get("n_probs")):
        return Why("logprobs", "it asks for a JSON answer with token probabilities")
    return None


@contextlib.asynccontextmanager
async def _seated(serving: Serving, seat: Seat | None) -> AsyncIterator[bool]:
    """Hold a seat while the request is served (none: not one that decodes); False when a drain or a stop began
    while it waited for one (it is refused now, not once a slot is free)."""
    if seat is None:
        yield True
        return
    if serving.gate.refusing:
        yield False
        return
    taking = asyncio.ensure_future(serving.seats.take(seat))
    refusing = asyncio.ensure_future(serving.gate.until_refusing())
    try:
        await asyncio.wait({taking, refusing}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        refusing.cancel()
        if not taking.done():
            taking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await taking
    if taking.cancelled():
        yield False
        return
    taking.result()  # what went wrong in the queue, if anything did
    try:
        yield True
    finally:
        serving.seats.leave(seat)


async def _shown(passes: Passes, path: str, watched: bool) -> web.StreamResponse:
    """llama-server's answer to a GET, rewritten by the built-ins that say what clients are told of the server."""
    def answered(payload: dict[str, Any], status: int) -> bool:
        return status == 200

    serving, request = passes.serving, passes.request
    got = await passes.once(lambda to: catch(request, to, answered, path), watched)
    if got.outcome is Outcome.CUT:
        return await got.told()
    if got.outcome is not Outcome.CAUGHT:
        return got.answered
    answer = got.payload
    for rewrite in built_ins.shown(serving.current, path):
        answer = rewrite.rewrite(serving.current, path, answer)
    headers = {k: v for k, v in got.headers.items() if k.lower() not in ("content-length", "content-type")}
    return web.json_response(answer, status=got.status, headers=headers)  # CORS and the rest as they were


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


def _slot_ctx(generation: Generation) -> int:
    """The context one slot has: as the server said at its start, else -c, or -c / -np when every slot has its
    own KV (no -kvu)."""
    if generation.context is not None:
        return generation.context.slot
    argv = generation.launch.argv
    n_ctx = int(args.get(argv, args.CTX_SIZE) or 0)
    parallel = max(1, int(args.get(argv, args.PARALLEL) or 1))
    return n_ctx if args.unified_kv(argv) else n_ctx // parallel

