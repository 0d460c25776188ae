"""The public HTTP face: /health, the wrapper's own endpoints and their auth; every other request goes to the
forwarding pipeline (wrapper/forwarding.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import structlog
from aiohttp import web

from wrapper import built_ins
from wrapper.auth import allowed, presented_bearer, presented_key
from wrapper.forwarding import forward_request
from wrapper.gate import Admission
from wrapper.life import ServerLife
from wrapper.lifecycle import State
from wrapper.metrics import METRICS
from wrapper.passes import RETRY_AFTER_S
from wrapper.proxy import BadPath, canonical_path, json_error
from wrapper.reload_plan import ReloadRefused
from wrapper.sections import SLEEP
from wrapper.serving import Serving
from wrapper.supervisor import Supervisor
from wrapper.units import parse_duration

log = structlog.get_logger()

SUPERVISOR: web.AppKey[Supervisor] = web.AppKey("supervisor", Supervisor)
SERVING: web.AppKey[Serving] = web.AppKey("serving", Serving)
LIFE: web.AppKey[ServerLife] = web.AppKey("life", ServerLife)
_READ_METHODS = ("GET", "HEAD")


AWAKE_SOON = (State.SLEEPING, State.ASLEEP, State.WAKING)  # well, and will serve: a request wakes the server


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


def _unauthorized(request: web.Request) -> web.Response | None:
    """llama-server's own 401 when it has API keys and the request brings none of them."""
    keys = request.app[SERVING].current.launch.keys
    if keys and not allowed(keys, presented_key(request)):
        return json_error(401, "Invalid API Key", "authentication_error")
    return None


def _not_admin(request: web.Request) -> web.Response | None:
    """POST /wrapper/* needs the admin token; without one configured, those endpoints are off."""
    admin = request.app[SERVING].current.launch.admin
    was_off = admin.off
    token, why = admin.read()  # read at each call: a token file made after the start turns them on
    if token is None:
        return json_error(403, f"admin endpoints are off: {why}", "permission_error")
    if was_off is not None:
        log.info("admin.on", why="the admin token can be read now")
    if not allowed((token,), presented_bearer(request)):
        return json_error(401, "a wrong or missing admin token (Authorization: Bearer <token>)",
                          "authentication_error")
    return None


class _NotJson(ValueError):
    """A request body that does not parse: the message says where (the parser's line and column)."""


async def _json_body(request: web.Request) -> Any:
    """The body parsed as JSON; None for an empty one; _NotJson for one that is not JSON at all."""
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw.decode(request.charset or "utf-8"))
    except json.JSONDecodeError as exc:
        raise _NotJson(f"the body is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise _NotJson(f"the body is not valid JSON: not {exc.encoding} text (byte {exc.start})") from exc
    except LookupError as exc:  # a charset Python does not know
        raise _NotJson(f"the body is not valid JSON: an unknown charset {request.charset!r}") from exc


async def reload(request: web.Request) -> web.Response:
    if (refusal := _not_admin(request)) is not None:
        return refusal
    try:
        body = await _json_body(request)
    except _NotJson as exc:
        return json_error(400, str(exc), "invalid_request_error")
    if not isinstance(body, dict):
        return json_error(400, "the body must be a JSON object of reload fields", "invalid_request_error")
    try:
        answer = await request.app[LIFE].reload(body)
    except ReloadRefused as exc:
        return json_error(exc.status, str(exc), "invalid_request_error" if exc.status == 400 else "conflict")
    except asyncio.CancelledError:
        if (task := asyncio.current_task()) is not None and task.cancelling():
            raise
        return json_error(503, "llama-wrapper is stopping: the reload was abandoned", "unavailable_error")
    return web.json_response(answer, status=200 if answer["success"] else 500)


DRAIN_FIELDS = ("timeout",)


async def drain(request: web.Request) -> web.Response:
    """POST /wrapper/drain {"timeout": "30s"}: what a Kubernetes preStop hook calls before the SIGTERM (as GET
    /wrapper/drain?timeout=30s too: a preStop httpGet can only GET). Both need the admin token."""
    if (refusal := _not_admin(request)) is not None:
        return refusal
    body: Any
    if request.method == "GET":
        body = dict(request.query)
    else:
        try:
            body = await _json_body(request)
        except _NotJson as exc:
            return json_error(400, str(exc), "invalid_request_error")
        if body is None:  # an empty body: the default timeout
            body = {}
    if not isinstance(body, dict) or set(body) - set(DRAIN_FIELDS):
        return json_error(400, 'the body must be empty or {"timeout": DURATION} (e.g. "30s"; default '
                          "server.drain_timeout)", "invalid_request_error")
    try:
        timeout = (parse_duration(body["timeout"]) if "timeout" in body
                   else request.app[SERVING].current.config.drain_timeout)
    except ValueError as exc:
        return json_error(400, f"timeout: {exc}", "invalid_request_error")
    try:
        answer = await request.app[LIFE].drain_before_stop(timeout)
    except ReloadRefused as exc:
        return json_error(exc.status, str(exc), "conflict")
    return web.json_response(answer)


async def sleep(request: web.Request) -> web.Response:
    """POST /wrapper/sleep: keep every slot and stop llama-server now (once the requests in flight are done)."""
    if (refusal := _not_admin(request)) is not None:
        return refusal
    life = request.app[LIFE]
    if life.state is State.ASLEEP:
        return web.json_response({**life.sleep.status(True, SLEEP.of(life.current.config)), "why": "asleep already"})
    if life.state is not State.READY:
        return json_error(409, f"llama-wrapper is {life.state}: it falls asleep only when ready", "conflict")
    outcome = await asyncio.shield(life.sleep.ask("asked (POST /wrapper/sleep)"))
    return web.json_response(outcome, status=200 if outcome.get("asleep") else 409)


async def wake(request: web.Request) -> web.Response:
    """POST /wrapper/wake: start llama-server now and restore; answered once it serves (or 503 with the reason)."""
    if (refusal := _not_admin(request)) is not None:
        return refusal
    serving, life = request.app[SERVING], request.app[LIFE]
    state = serving.lifecycle.state
    if state is State.READY:
        return web.json_response({"woken": True, "why": "awake already", "wake_s": None})
    if state not in AWAKE_SOON:
        return json_error(409, f"llama-wrapper is {state}: nothing to wake", "conflict")
    admission = await serving.gate.enter(counted=False)
    if admission is Admission.ADMITTED:
        return web.json_response({"woken": True, "wake_s": life.sleep.last_wake_s})
    why = serving.gate.wake_failed if admission is Admission.NOT_WOKEN else f"llama-wrapper is {serving.state}"
    return json_error(503, f"llama-server could not be woken: {why}", "unavailable_error",
                      {"Retry-After": RETRY_AFTER_S})


async def status(request: web.Request) -> web.Response:
    return _unauthorized(request) or web.json_response(request.app[SUPERVISOR].status())


def _is_slot_action(method: str, path: str) -> bool:
    return method not in _READ_METHODS and (path == "/slots" or path.startswith("/slots/"))


async def proxied(request: web.Request) -> web.StreamResponse:
    serving = request.app[SERVING]
    try:
        path = canonical_path(request.rel_url.raw_path)
    except (BadPath, UnicodeDecodeError) as exc:
        return json_error(400, f"bad request path: {exc}", "invalid_request_error")
    if request.body_exists and (refusal := _unauthorized(request)) is not None:
        return refusal  # llama-server would refuse it too, after reading the body: don't even stream it there
    if _is_slot_action(request.method, path) and not serving.current.config.allow_slot_actions:
        return json_error(403, "slot actions are reserved to llama-wrapper, which owns the slot files "
                          "(set proxy.allow_slot_actions: true to allow them)", "permission_error")
    response = await forward_request(request, serving, request.app[LIFE], path)
    METRICS.answered(response.status)
    return response


async def metrics(request: web.Request) -> web.Response:
    """llama-server's own metrics (when it has them), then the wrapper's families; asks for one of llama-server's
    API keys like llama-server's own /metrics."""
    if (refusal := _unauthorized(request)) is not None:
        return refusal
    serving = request.app[SERVING]
    awake = serving.current.launch.metrics and serving.current.alive
    server = await serving.current.client.metrics() if awake else b""
    if server and not server.endswith(b"\n"):
        server += b"\n"
    METRICS.in_flight.set(serving.in_flight)  # the gauges read now
    METRICS.held.set(serving.gate.held)
    built_ins.refresh_metrics(serving.current)
    return web.Response(body=server + METRICS.text(built_ins.families_off(serving.current)),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def builtin_route(request: web.Request) -> web.Response:
    """An endpoint a built-in declares (GET /wrapper/memory, POST /wrapper/budget)."""
    serving = request.app[SERVING]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else ""
    declared = next((r for r in built_ins.all_routes() if r.path == route and r.method == request.method), None)
    assert declared is not None
    refusal = _not_admin(request) if request.method == "POST" else _unauthorized(request)
    if refusal is not None:
        return refusal
    if declared not in built_ins.routes(serving.current):
        return json_error(409, f"{declared.path} is off: {declared.off}", "conflict")
    body: Any = {}
    if request.method == "POST":
        try:
            body = await _json_body(request)
        except _NotJson as exc:
            return json_error(400, str(exc), "invalid_request_error")
        if not isinstance(body, dict):
            return json_error(400, "the body must be a JSON object", "invalid_request_error")
    if serving.lifecycle.state is not State.READY and request.method == "POST":
        return json_error(409, f"llama-wrapper is {serving.lifecycle.state}", "conflict")
    status_code, answer = await declared.handler(request.app[LIFE], body)
    return web.json_response(answer, status=status_code)


def application(supervisor: Supervisor) -> web.Application:
    app = web.Application()
    app[SUPERVISOR] = supervisor
    app[SERVING] = supervisor.serving
    app[LIFE] = supervisor.life
    app.router.add_get("/health", health)
    app.router.add_get("/wrapper/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/wrapper/reload", reload)
    app.router.add_post("/wrapper/drain", drain)
    app.router.add_get("/wrapper/drain", drain)
    app.router.add_post("/wrapper/sleep", sleep)
    app.router.add_post("/wrapper/wake", wake)
    for route in built_ins.all_routes():
        app.router.add_route(route.method, route.path, builtin_route)
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
