"""The wrapper's own POST endpoints, each behind the admin token: a reload, a drain before a stop, a sleep and a
wake now, and the endpoints the built-ins declare (GET /wrapper/memory, POST /wrapper/budget)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from wrapper import built_ins
from wrapper.answers.passes import RETRY_AFTER_S
from wrapper.answers.proxy import json_error
from wrapper.configuration import consumers
from wrapper.configuration.consumers import ANONYMOUS, CONSUMERS, NotAUser, consumer_of
from wrapper.configuration.reload_plan import ReloadRefused
from wrapper.configuration.sections import SLEEP
from wrapper.configuration.units import parse_duration
from wrapper.http.access import LIFE, SERVING, NotJson, json_body, not_admin, object_body, unauthorized
from wrapper.lifecycle import State
from wrapper.queue.gate import Admission

AWAKE_SOON = (State.SLEEPING, State.ASLEEP, State.WAKING)  # well, and will serve: a request wakes the server


async def reload(request: web.Request) -> web.Response:
    if (refusal := not_admin(request)) is not None:
        return refusal
    body = await object_body(request, " of reload fields")
    if isinstance(body, web.Response):
        return body
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
    if (refusal := not_admin(request)) is not None:
        return refusal
    body: Any
    if request.method == "GET":
        body = dict(request.query)
    else:
        try:
            body = await json_body(request)
        except NotJson as exc:
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
    if (refusal := not_admin(request)) is not None:
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
    if (refusal := not_admin(request)) is not None:
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


async def _consumers_own(request: web.Request, declared: built_ins.Route) -> web.Response:
    """A built-in's endpoint of one consumer's own (what the cache keeps for it: listed, forgotten): asked with that
    consumer's own key, or with the admin token for the consumer `?consumer=NAME` names."""
    serving = request.app[SERVING]
    settings = CONSUMERS.of(serving.current.config)
    if not consumers.on(settings):
        return json_error(409, "no consumers are configured: name them with consumers.keys (docs/consumers.md)",
                          "conflict")
    named = request.query.get("consumer")
    if named is not None:
        if (refusal := not_admin(request)) is not None:
            return refusal
        consumer = named
    else:
        try:
            consumer = consumer_of(request.headers, settings) or ANONYMOUS
        except NotAUser as exc:
            return json_error(400, str(exc), "invalid_request_error")
        if consumer == ANONYMOUS:
            return json_error(401, "send a consumer's own key (Authorization: Bearer KEY), or the admin token with "
                              "?consumer=NAME", "authentication_error")
    if declared not in built_ins.routes(serving.current):
        return json_error(409, f"{declared.path} is off: {declared.off}", "conflict")
    if serving.lifecycle.state not in (State.READY, State.ASLEEP):
        return json_error(409, f"llama-wrapper is {serving.lifecycle.state}: ask again once it is ready", "conflict")
    status_code, answer = await declared.handler(request.app[LIFE], {"consumer": consumer})
    return web.json_response(answer, status=status_code)


async def builtin_route(request: web.Request) -> web.Response:
    """An endpoint a built-in declares (GET /wrapper/memory, POST /wrapper/budget)."""
    serving = request.app[SERVING]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else ""
    declared = next((r for r in built_ins.all_routes() if r.path == route and r.method == request.method), None)
    assert declared is not None
    if declared.per_consumer:
        return await _consumers_own(request, declared)
    refusal = not_admin(request) if request.method == "POST" else unauthorized(request)
    if refusal is not None:
        return refusal
    if declared not in built_ins.routes(serving.current):
        return json_error(409, f"{declared.path} is off: {declared.off}", "conflict")
    body: dict[str, Any] = {}
    if request.method == "POST":
        read = await object_body(request, "")
        if isinstance(read, web.Response):
            return read
        body = read
    if serving.lifecycle.state is not State.READY and request.method == "POST":
        return json_error(409, f"llama-wrapper is {serving.lifecycle.state}", "conflict")
    status_code, answer = await declared.handler(request.app[LIFE], body)
    return web.json_response(answer, status=status_code)


