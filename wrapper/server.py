"""The public HTTP side: the wrapper's own endpoints, then the gate, then the proxy."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from wrapper.lifecycle import Supervisor
from wrapper.proxy import forward, json_error
from wrapper.state import State

log = structlog.get_logger()

MAX_REQUEST_BYTES = 512 * 1024 * 1024  # prompts with images or audio can be large; llama-server decides
RETRY_AFTER_S = "5"
SUPERVISOR: web.AppKey[Supervisor] = web.AppKey("supervisor", Supervisor)


async def health(request: web.Request) -> web.Response:
    """200 only when ready: the child is healthy and every on_startup hook is done. Never waits."""
    state = request.app[SUPERVISOR].lifecycle.state
    if state is State.READY:
        return web.json_response({"status": "ok"})
    message = "Loading model" if state is State.STARTING else f"llama-wrapper is {state}"
    return json_error(503, message, "unavailable_error", {"Retry-After": RETRY_AFTER_S})


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SUPERVISOR].status())


async def proxied(request: web.Request) -> web.StreamResponse:
    supervisor = request.app[SUPERVISOR]
    if request.method == "POST" and (request.path == "/slots" or request.path.startswith("/slots/")) \
            and not supervisor.config.allow_slot_actions:
        return json_error(403, "slot actions are reserved to llama-wrapper, which owns the slot files "
                          "(set proxy.allow_slot_actions: true to allow them)", "permission_error")
    if not await supervisor.gate.enter():
        return json_error(503, f"llama-wrapper is {supervisor.lifecycle.state}", "unavailable_error",
                          {"Retry-After": RETRY_AFTER_S})
    try:
        return await forward(request, supervisor.launch.url, supervisor.session, supervisor.observer())
    finally:
        supervisor.gate.leave()


def application(supervisor: Supervisor) -> web.Application:
    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app[SUPERVISOR] = supervisor
    app.router.add_get("/health", health)
    app.router.add_get("/wrapper/status", status)
    app.router.add_route("*", "/{tail:.*}", proxied)
    return app


async def serve(supervisor: Supervisor) -> Callable[[], Awaitable[None]]:
    """Start listening on the public address; returns the coroutine function that stops it."""
    runner = web.AppRunner(application(supervisor), access_log=None, handle_signals=False)
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
