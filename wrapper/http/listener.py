"""The public HTTP face: /health, /wrapper/status, /metrics, the wrapper's own POSTs (wrapper/http/admin.py) and
every other request to the request path (wrapper/answers/forwarding.py); who may ask what is wrapper/http/access.py's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from wrapper import built_ins
from wrapper.answers.forwarding import forward_request
from wrapper.answers.passes import RETRY_AFTER_S
from wrapper.answers.proxy import BadPath, canonical_path, json_error
from wrapper.configuration.sections import ROUTER
from wrapper.http import admin, gauges
from wrapper.http.access import LIFE, SERVING, SUPERVISOR, as_server_reads, not_operator, unauthorized
from wrapper.http.admin import AWAKE_SOON
from wrapper.life.supervisor import Supervisor
from wrapper.lifecycle import State
from wrapper.metrics import METRICS
from wrapper.serving import Serving

log = structlog.get_logger()

_READ_METHODS = ("GET", "HEAD")




async def health(request: web.Request) -> web.Response:
    """200 when ready (the child is healthy and every on_startup hook is done) and while asleep (the wrapper will
    serve: a request wakes the server). Never waits, never asks a key."""
    state = request.app[SERVING].lifecycle.state
    if state is State.READY:
        return web.json_response({"status": "ok"})
    if state in AWAKE_SOON:
        return web.json_response({"status": "ok", "sleep": str(state)})
    message = "Loading model" if state is State.STARTING else f"llama-wrapper is {state}"
    return json_error(503, message, "unavailable_error", {"Retry-After": RETRY_AFTER_S})


async def status(request: web.Request) -> web.Response:
    return not_operator(request, "the status") or web.json_response(request.app[SUPERVISOR].status())


def _is_slots(path: str) -> bool:
    return path == "/slots" or path.startswith("/slots/")


def _is_slot_action(method: str, path: str) -> bool:
    return method not in _READ_METHODS and _is_slots(path)


async def proxied(request: web.Request) -> web.StreamResponse:
    serving = request.app[SERVING]
    try:
        path = canonical_path(request.rel_url.raw_path)
    except (BadPath, UnicodeDecodeError) as exc:
        return json_error(400, f"bad request path: {exc}", "invalid_request_error")
    if request.body_exists and (refusal := unauthorized(request)) is not None:
        return refusal  # llama-server would refuse it too, after reading the body: don't even stream it there
    if _is_slots(path):
        if (refusal := not_operator(request, "llama-server's /slots")) is not None:
            return refusal  # what each slot holds and does is no consumer's business under consumers.isolate
        request = as_server_reads(request)  # the read-only token is the wrapper's: llama-server gets its own key
    if _is_slot_action(request.method, path) and not serving.current.config.allow_slot_actions:
        return json_error(403, "slot actions are reserved to llama-wrapper, which owns the slot files "
                          "(set proxy.allow_slot_actions: true to allow them)", "permission_error")
    response = await forward_request(request, serving, request.app[LIFE], path)
    METRICS.answered(response.status)
    return response


async def metrics(request: web.Request) -> web.Response:
    """llama-server's own metrics (when it has them), then the wrapper's families; asks for one of llama-server's
    API keys like llama-server's own /metrics (the admin token under consumers.isolate)."""
    if (refusal := not_operator(request, "/metrics")) is not None:
        return refusal
    serving = request.app[SERVING]
    awake = serving.current.launch.metrics and serving.current.alive
    server = await serving.current.client.metrics() if awake else b""
    if server and not server.endswith(b"\n"):
        server += b"\n"
    METRICS.in_flight.set(serving.in_flight)  # the gauges read now
    METRICS.held.set(serving.gate.held)
    built_ins.refresh_metrics(serving.current)
    generation = serving.current
    router = gauges.exposition(ROUTER.of(generation.config), _load(serving))
    return web.Response(body=server + METRICS.text(built_ins.families_off(generation)) + router,
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def loads(request: web.Request) -> web.Response:
    """`GET /v1/loads`: the load in SGLang's shape, which SMG polls (wrapper/http/gauges.py); asks what /metrics
    asks (one of llama-server's keys; the admin or the read-only token under consumers.isolate)."""
    if (refusal := not_operator(request, "/v1/loads", "it tells how busy the server is")) is not None:
        return refusal
    return web.json_response(gauges.loads(_load(request.app[SERVING]), time.time()))


def _load(serving: Serving) -> gauges.Load:
    """What the router gauges and /v1/loads say: the queue's requests, the tokens the slots hold, the context."""
    generation = serving.current
    running = {seat.use.slot: seat.use.tokens for seat in serving.seats.running if seat.use.slot is not None}
    held = built_ins.held_tokens(generation, running)
    if held is not None and not generation.alive:
        held = 0  # asleep (or between a crash and the restart): no slot holds anything
    return gauges.Load(waiting=len(serving.seats.waiting) + serving.gate.held, running=len(serving.seats.running),
                       held=held, context=generation.context.runs if generation.context is not None else None)


def application(supervisor: Supervisor) -> web.Application:
    app = web.Application()
    app[SUPERVISOR] = supervisor
    app[SERVING] = supervisor.serving
    app[LIFE] = supervisor.life
    app.router.add_get("/health", health)
    app.router.add_get("/wrapper/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/wrapper/reload", admin.reload)
    app.router.add_post("/wrapper/drain", admin.drain)
    app.router.add_get("/wrapper/drain", admin.drain)
    app.router.add_post("/wrapper/sleep", admin.sleep)
    app.router.add_post("/wrapper/wake", admin.wake)
    for route in built_ins.all_routes():
        app.router.add_route(route.method, route.path, admin.builtin_route)
    app.router.add_route("*", "/{tail:.*}", proxied)
    return app


@contextlib.asynccontextmanager
async def serve(supervisor: Supervisor) -> AsyncIterator[None]:
    """Listen on the public address while inside; OSError when it cannot be taken."""
    # handler_cancellation: a client that hangs up cancels its handler, and with it the request to llama-server.
    runner = web.AppRunner(application(supervisor), access_log=None, handle_signals=False,
                           handler_cancellation=True)
    await runner.setup()
    try:
        listen = supervisor.serving.current.launch.listen
        site = web.TCPSite(runner, listen.host, listen.port, reuse_address=True)
        await site.start()
        log.info("wrapper.listening", url=listen.url)
        yield
    finally:
        await runner.cleanup()
