"""The public HTTP side: the wrapper's own endpoints, then the gate, then the proxy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from wrapper import argv as args
from wrapper import extensions
from wrapper.auth import ADMIN_TOKEN_ENV, allowed, presented_bearer, presented_key
from wrapper.config import Config
from wrapper.continuation import CHAT_PATHS, continued, cut_by_context, merged
from wrapper.gate import Admission
from wrapper.lifecycle import State
from wrapper.proxy import STARTED, BadPath, Caught, Held, broken_off, canonical_path, forward, json_error, json_object
from wrapper.reload_plan import ReloadRefused
from wrapper.sse import Events, as_answer
from wrapper.supervisor import Supervisor

log = structlog.get_logger()

RETRY_AFTER_S = "5"
OVERFLOW = "exceed_context_size_error"
POOL_FULL = "Context size has been exceeded."  # llama-server's 500 when the shared KV (-kvu) ran out
GROWABLE = ("/completion", "/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions", "/infill")
GROWABLE_BODY_LIMIT = 32 << 20  # a completion request read whole, to be sent again after a growth
MAX_GROWTHS = 3
CONTINUABLE = ("/completion", *CHAT_PATHS)
SUPERVISOR: web.AppKey[Supervisor] = web.AppKey("supervisor", Supervisor)
_READ_METHODS = ("GET", "HEAD")


async def health(request: web.Request) -> web.Response:
    """200 only when ready: the child is healthy and every on_startup hook is done. Never waits, never asks a key."""
    state = request.app[SUPERVISOR].lifecycle.state
    if state is State.READY:
        return web.json_response({"status": "ok"})
    message = "Loading model" if state is State.STARTING else f"llama-wrapper is {state}"
    return json_error(503, message, "unavailable_error", {"Retry-After": RETRY_AFTER_S})


def _unauthorized(request: web.Request) -> web.Response | None:
    """llama-server's own 401 when it has API keys and the request brings none of them."""
    keys = request.app[SUPERVISOR].launch.keys
    if keys and not allowed(keys, presented_key(request)):
        return json_error(401, "Invalid API Key", "authentication_error")
    return None


def _not_admin(request: web.Request) -> web.Response | None:
    """POST /wrapper/* needs the admin token; without one configured, those endpoints are off."""
    token = request.app[SUPERVISOR].launch.admin_token
    if token is None:
        return json_error(403, "admin endpoints are off: set admin.token_file in the config or "
                          f"{ADMIN_TOKEN_ENV}, then send Authorization: Bearer <token>", "permission_error")
    if not allowed((token,), presented_bearer(request)):
        return json_error(401, "a wrong or missing admin token (Authorization: Bearer <token>)",
                          "authentication_error")
    return None


async def reload(request: web.Request) -> web.Response:
    if (refusal := _not_admin(request)) is not None:
        return refusal
    try:
        body = await request.json()
    except ValueError:
        return json_error(400, "the body must be a JSON object of reload fields", "invalid_request_error")
    if not isinstance(body, dict):
        return json_error(400, "the body must be a JSON object of reload fields", "invalid_request_error")
    try:
        answer = await request.app[SUPERVISOR].reload(body)
    except ReloadRefused as exc:
        return json_error(exc.status, str(exc), "invalid_request_error" if exc.status == 400 else "conflict")
    except asyncio.CancelledError:
        if (task := asyncio.current_task()) is not None and task.cancelling():
            raise
        return json_error(503, "llama-wrapper is stopping: the reload was abandoned", "unavailable_error")
    return web.json_response(answer, status=200 if answer["success"] else 500)


async def status(request: web.Request) -> web.Response:
    return _unauthorized(request) or web.json_response(request.app[SUPERVISOR].status())


def _is_slot_action(method: str, path: str) -> bool:
    return method not in _READ_METHODS and (path == "/slots" or path.startswith("/slots/"))


async def proxied(request: web.Request) -> web.StreamResponse:
    supervisor = request.app[SUPERVISOR]
    try:
        path = canonical_path(request.rel_url.raw_path)
    except (BadPath, UnicodeDecodeError) as exc:
        return json_error(400, f"bad request path: {exc}", "invalid_request_error")
    if request.body_exists and (refusal := _unauthorized(request)) is not None:
        return refusal  # llama-server would refuse it too, after reading the body: don't even stream it there
    if _is_slot_action(request.method, path) and not supervisor.config.allow_slot_actions:
        return json_error(403, "slot actions are reserved to llama-wrapper, which owns the slot files "
                          "(set proxy.allow_slot_actions: true to allow them)", "permission_error")
    body: bytes | None = None
    if (request.method == "POST" and path in GROWABLE and extensions.growing(supervisor.config)
            and (request.content_length or 0) <= GROWABLE_BODY_LIMIT):
        body = await _read_whole(request, GROWABLE_BODY_LIMIT)
        if body is None:
            return json_error(413, f"a completion request of more than {GROWABLE_BODY_LIMIT >> 20} MiB",
                              "invalid_request_error")
    if body is None:
        result = await _exchange(request, supervisor, path, None, None)
        assert isinstance(result, web.StreamResponse)  # nothing is caught or held without a body to send again
        return result
    return await _growing(request, supervisor, path, body)


async def _growing(request: web.Request, supervisor: Supervisor, path: str, body: bytes) -> web.StreamResponse:
    """Send a completion request; on a context overflow grow the context and send it again. A non-streamed
    answer cut by a full context is continued after a growth (degrade.continue): the client gets one answer."""
    original = json_object(body)
    degrade = supervisor.config.degrade
    can_continue = degrade is not None and degrade.continue_truncated and original is not None and path in CONTINUABLE
    if can_continue and original is not None and original.get("stream") is True:
        return await _growing_stream(request, supervisor, path, body, original)
    continuing = can_continue and original is not None and original.get("stream") is not True
    request_now, sent, earlier = original or {}, body, None
    result: web.StreamResponse | Caught | Held | None = None
    for _ in range(MAX_GROWTHS + 1):
        n_ctx = _slot_ctx(supervisor.launch.argv)

        def wanted(payload: dict[str, Any], status: int, n_ctx: int = n_ctx, going_on: bool = earlier is not None,
                   asked: dict[str, Any] = request_now) -> bool:
            if status >= 400:
                return _overflowed(payload)
            return continuing and (going_on or cut_by_context(path, asked, payload, n_ctx) is not None)

        result = await _exchange(request, supervisor, path, sent, wanted)
        if not isinstance(result, Caught):
            assert isinstance(result, web.StreamResponse)  # no events filter: nothing is held
            return result
        if result.status >= 400:
            refusal = await _grown_for(supervisor, path, result, request_now)
            if refusal is None:
                continue
            return web.json_response(earlier) if earlier is not None else refusal  # a continuation: what came
        answer = merged(path, earlier, result.payload) if earlier is not None else result.payload
        cut = cut_by_context(path, request_now, result.payload, n_ctx)
        if cut is None:
            return web.json_response(answer)
        used, more = cut
        problem = await extensions.grow(supervisor, used + (more or (degrade.headroom if degrade else 0)))
        if problem is not None:
            log.info("degrade.continuation_refused", path=path, why=problem)
            return web.json_response(answer)  # as llama-server cut it
        earlier, request_now = answer, continued(path, original or {}, answer)
        sent = json.dumps(request_now).encode()
        log.info("degrade.continue", path=path, used=used)
    if earlier is not None:
        return web.json_response(earlier)
    assert isinstance(result, Caught)  # it overflowed after every growth: the client gets the last refusal
    return web.json_response(result.payload, status=result.status)


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


async def _exchange(request: web.Request, supervisor: Supervisor, path: str, body: bytes | None,
                    catch: Callable[[dict[str, Any], int], bool] | None, events: Events | None = None,
                    going_on: web.StreamResponse | None = None) -> web.StreamResponse | Caught | Held:
    """One pass through the gate to llama-server; a context overflow is Caught when `body` can be sent again."""
    admission = await supervisor.gate.enter()
    if admission is Admission.REFUSED:
        return json_error(503, f"llama-wrapper is {supervisor.lifecycle.state}", "unavailable_error",
                          {"Retry-After": RETRY_AFTER_S})
    if admission is Admission.TIMED_OUT:
        return json_error(503, f"llama-wrapper is {supervisor.lifecycle.state} and held this request for "
                          f"reload.hold_timeout ({supervisor.config.reload_hold_timeout:g}s)", "unavailable_error",
                          {"Retry-After": RETRY_AFTER_S})
    exchange = asyncio.ensure_future(forward(request, supervisor.launch.url, supervisor.session,
                                             supervisor.observer(), path, body, catch, events, going_on))
    supervisor.gate.track(exchange)
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
        supervisor.gate.leave(exchange)


async def _grown_for(supervisor: Supervisor, path: str, overflow: Caught, asked: dict[str, Any]) -> web.Response | None:
    """Grow the context for a refused request: None when it may be sent again, else the refusal for the client
    (llama-server's, its message saying why it could not grow)."""
    pool_full = overflow.payload["error"].get("message") == POOL_FULL
    needed = 0 if pool_full else _needed(overflow.payload, asked, supervisor.config)
    problem = await extensions.grow(supervisor, needed, pool_full)
    if problem is None:
        log.info("degrade.retry", path=path, needed=needed)
        return None
    log.info("degrade.overflow_refused", path=path, needed=needed, why=problem)
    error = dict(overflow.payload["error"])
    if problem:
        error["message"] = f"{problem} ({error.get('message')})"
    return web.json_response({**overflow.payload, "error": error}, status=overflow.status)


async def _growing_stream(request: web.Request, supervisor: Supervisor, path: str, body: bytes,
                          original: dict[str, Any]) -> web.StreamResponse:
    """A streamed completion request: grown and sent again on an overflow (before any event); an answer cut by
    a full context goes on in the same stream after a growth, its stop event held back until then."""
    chat = path in CHAT_PATHS
    degrade = supervisor.config.degrade
    request_now, sent, text, generated = original, body, "", 0
    response: web.StreamResponse | None = None
    held = b""  # the last events of the answer so far, sent when it cannot go on
    for _ in range(MAX_GROWTHS + 1):
        n_ctx = _slot_ctx(supervisor.launch.argv)
        events = Events(chat, skip=text if chat else "", continuing=response is not None)
        result = await _exchange(request, supervisor, path, sent, lambda p, status: status >= 400 and _overflowed(p),
                                 events, response)
        if isinstance(result, Caught):
            refusal = await _grown_for(supervisor, path, result, request_now)
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
        if await extensions.grow(supervisor, used + (more or (degrade.headroom if degrade else 0))) is not None:
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


def _slot_ctx(argv: list[str]) -> int:
    """The context one slot has: -c, or -c / -np when every slot has its own KV (no -kvu)."""
    n_ctx = int(args.get(argv, args.CTX_SIZE) or 0)
    parallel = max(1, int(args.get(argv, args.PARALLEL) or 1))
    return n_ctx if args.last_of(argv, args.KV_UNIFIED, args.NO_KV_UNIFIED) else n_ctx // parallel


def _needed(payload: dict[str, Any], asked: dict[str, Any], config: Config) -> int:
    """The prompt's tokens plus what the request may generate (its max_tokens, else degrade.headroom)."""
    prompt = int(payload["error"]["n_prompt_tokens"])
    headroom = config.degrade.headroom if config.degrade is not None else 0
    limit = next((asked[k] for k in ("max_completion_tokens", "max_tokens", "n_predict")
                  if isinstance(asked.get(k), int) and not isinstance(asked.get(k), bool) and asked[k] > 0), None)
    return prompt + (limit if limit is not None else headroom)


async def builtin_route(request: web.Request) -> web.Response:
    """An endpoint a built-in declares (GET /wrapper/memory, POST /wrapper/budget)."""
    supervisor = request.app[SUPERVISOR]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else ""
    declared = next((r for r in extensions.all_routes() if r.path == route and r.method == request.method), None)
    assert declared is not None
    refusal = _not_admin(request) if request.method == "POST" else _unauthorized(request)
    if refusal is not None:
        return refusal
    if declared not in extensions.routes(supervisor.config):
        return json_error(409, f"{declared.path} is off: {declared.off}", "conflict")
    body: Any = {}
    if request.method == "POST":
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return json_error(400, "the body must be a JSON object", "invalid_request_error")
    if supervisor.lifecycle.state is not State.READY and request.method == "POST":
        return json_error(409, f"llama-wrapper is {supervisor.lifecycle.state}", "conflict")
    status_code, answer = await declared.handler(supervisor, body)
    return web.json_response(answer, status=status_code)


def application(supervisor: Supervisor) -> web.Application:
    app = web.Application()
    app[SUPERVISOR] = supervisor
    app.router.add_get("/health", health)
    app.router.add_get("/wrapper/status", status)
    app.router.add_post("/wrapper/reload", reload)
    for route in extensions.all_routes():
        app.router.add_route(route.method, route.path, builtin_route)
    app.router.add_route("*", "/{tail:.*}", proxied)
    return app


async def serve(supervisor: Supervisor) -> Callable[[], Awaitable[None]]:
    """Start listening on the public address; returns the coroutine function that stops it."""
    # handler_cancellation: a client that hangs up cancels its handler, and with it the request to llama-server.
    runner = web.AppRunner(application(supervisor), access_log=None, handle_signals=False,
                           handler_cancellation=True)
    await runner.setup()
    listen = supervisor.launch.listen
    site = web.TCPSite(runner, listen.host, listen.port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    log.info("wrapper.listening", url=listen.url)
    return runner.cleanup
